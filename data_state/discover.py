"""Finding a corpus's inputs: local paths, `s3://` URIs and globs of either, as `InputFile`s.

Contract:
- `discover(sources)` lists the input files of `sources` (local paths, `s3://` URIs, globs of
  either), sorted by name, each once. A directory is walked (hidden entries and
  `__pycache__` skipped); a directory saved by Hugging Face `datasets`' `save_to_disk` (it
  holds `state.json`, or `dataset_dict.json` for all its splits) is read as rows, its data
  files plain names inside it (untrusted input). A file's kind follows its name:
  `.jsonl`/`.ndjson` are JSON Lines, `.parquet` is Parquet, `.arrow` inside a
  `save_to_disk` directory is Arrow; anything else is a text document. Names recorded in the
  manifest (and hashed for the split) are the path as given plus the walked part, or the
  `s3://` URI. A source that does not exist or matches nothing is a `ValueError`.
- `walk(root, skip)`: the relative POSIX paths of the regular files under `root`, sorted.
- `cap(inputs, max_bytes)`: the longest prefix of `inputs` within `max_bytes`.

Reading them (units, splits, documents) is `data_state.sources`.
"""

from __future__ import annotations

import fnmatch
import glob
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from data_state import storage

_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class InputFile:
    name: str  # stable name recorded in the manifest and hashed for the split
    uri: str  # where to read it: a local path or an s3:// URI
    kind: str  # "text" | "jsonl" | "parquet" | "arrow"
    size: int


def discover(sources: Sequence[str], storage_options: Mapping[str, Any] | None = None
             ) -> list[InputFile]:
    """The input files of `sources`, sorted by name, each once (module contract)."""
    found: list[InputFile] = []
    for source in sources:
        found += _discover_one(source, storage_options)
    unique = {f.name: f for f in found}  # a file named twice (overlapping globs) counts once
    return sorted(unique.values(), key=lambda f: f.name)


def _discover_one(source: str, options: Mapping[str, Any] | None) -> list[InputFile]:
    remote = "://" in source and not source.startswith("file://")
    if not remote:
        return _discover_local(source)
    scheme = source.split("://", 1)[0]
    store, path = storage.resolve(source, options)
    if _GLOB_CHARS & set(path):
        base = path[: min(path.index(c) for c in _GLOB_CHARS if c in path)].rsplit("/", 1)[0]
        listed = {storage.join(base, rel): size for rel, size in store.find(base).items()}
        matches = {p: n for p, n in listed.items() if fnmatch.fnmatchcase(p, path)}
    elif store.isdir(path):
        if store.exists(storage.join(path, "state.json")) or store.exists(
            storage.join(path, "dataset_dict.json")
        ):
            return _saved_dataset(store, path, f"{scheme}://{path}")
        matches = {storage.join(path, rel): size for rel, size in store.find(path).items()}
    elif store.isfile(path):
        matches = {path: store.size(path)}
    else:
        raise ValueError(f"source {source!r} does not exist (no such object or prefix)")
    files = [
        _input(f"{scheme}://{p}", f"{scheme}://{p}", size)
        for p, size in sorted(matches.items())
        if not any(part.startswith(".") for part in p.split("/")[1:])
    ]
    if not files:
        raise ValueError(f"source {source!r} matches no files")
    return files


def _discover_local(source: str) -> list[InputFile]:
    source = source.removeprefix("file://")
    if _GLOB_CHARS & set(source):
        matches = sorted(glob.glob(source, recursive=True))
        if not matches:
            raise ValueError(f"source {source!r} matches no files")
        return [f for m in matches for f in _discover_local(m)]
    if os.path.isdir(source):
        base = os.path.normpath(source)
        marker = [n for n in ("state.json", "dataset_dict.json") if os.path.isfile(f"{base}/{n}")]
        if marker:
            store, root = storage.resolve(base, follow_links=True)  # a person's own input
            return _saved_dataset(store, root, base)
        return [
            _input(f"{base}/{rel}", path, os.path.getsize(path))
            for rel in walk(base)
            for path in [os.path.join(base, rel)]
        ]
    if os.path.isfile(source):
        return [_input(os.path.normpath(source), source, os.path.getsize(source))]
    raise ValueError(f"source {source!r} is neither a file nor a directory")


def _input(name: str, uri: str, size: int) -> InputFile:
    lower = name.lower()
    kind = "text"
    if lower.endswith(_JSONL_SUFFIXES):
        kind = "jsonl"
    elif lower.endswith(".parquet"):
        kind = "parquet"
    return InputFile(name, uri, kind, size)


def _saved_dataset(store: storage.Storage, path: str, name: str) -> list[InputFile]:
    """The Arrow files of a `save_to_disk` dataset (all splits of a DatasetDict, in order)."""
    dict_file = storage.join(path, "dataset_dict.json")
    if store.exists(dict_file):
        splits = _json(store, dict_file).get("splits")
        if not isinstance(splits, list) or not all(_plain(s) for s in splits):
            raise ValueError(f"{name}/dataset_dict.json: 'splits' must list plain names")
        return [f for split in splits
                for f in _saved_dataset(store, storage.join(path, split), f"{name}/{split}")]
    state = _json(store, storage.join(path, "state.json"))
    entries = state.get("_data_files")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{name}/state.json lists no _data_files: is it a save_to_disk dataset?")
    files = []
    for entry in entries:
        filename = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(filename, str) or not _plain(filename):
            # Untrusted input (P8): data files are plain names inside the dataset directory.
            raise ValueError(f"{name}/state.json: data file {filename!r} is not a plain name")
        full = storage.join(path, filename)
        uri = full if store.is_local else f"{name.split('://', 1)[0]}://{full}"
        files.append(InputFile(f"{name}/{filename}", uri, "arrow", store.size(full)))
    return files


def _json(store: storage.Storage, path: str) -> dict[str, Any]:
    try:
        raw = store.read_json(path)  # bounded: size, depth, numbers
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is not readable JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object")
    return raw


def _plain(name: object) -> bool:
    return isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name \
        and name not in (".", "..")


def walk(root: str, skip: frozenset[str] = frozenset()) -> list[str]:
    """Relative POSIX paths of regular files under `root`, sorted, hidden/skip dirs pruned."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d for d in dirnames if not d.startswith(".") and d != "__pycache__" and d not in skip
        ]
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            if not name.startswith(".") and os.path.isfile(os.path.join(dirpath, name)):
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                found.append(rel.replace(os.sep, "/"))
    return sorted(found)


def cap(inputs: list[InputFile], max_bytes: int | None) -> list[InputFile]:
    """The longest prefix of `inputs` whose sizes sum to at most `max_bytes`."""
    if max_bytes is None:
        return inputs
    kept, total = [], 0
    for f in inputs:
        total += f.size
        if total > max_bytes:
            break
        kept.append(f)
    return kept
