"""Corpus preparation: text files -> fixed-length token sequences in Parquet + `dataset.json`.

Contract of `prepare_corpus(sources, out, *, seq_len, ...)`:
- Sources are local files or directories (walked recursively; hidden entries and
  `__pycache__` skipped). With no sources it prepares the **default corpus**: every `.py` file
  of this Python's standard library (`sysconfig.get_paths()["stdlib"]`, without
  `site-packages`/`dist-packages`), about 31 MB / 1,800 files on CPython 3.11 — real text
  present on every machine with Python, so no download is ever needed. Its content depends on
  the Python version; the manifest records the version and every file's checksum.
- Files are taken in sorted order of their names; `max_bytes` keeps the longest prefix of that
  list that fits. Files that are not UTF-8 text (or contain NUL bytes) are skipped and listed
  in the manifest with the reason.
- Tokenizer `"bytes"`: a token is a byte of the UTF-8 text (vocab 256), with byte 0 (NUL,
  absent from text) appended after every file as the end-of-document token.
- Split by file, deterministically: files are ordered by the SHA-256 of their names and go to
  `val` until it holds `val_fraction` of the bytes (at least one file when `val_fraction > 0`
  and there are two or more files); the rest is `train`. No file contributes to both splits,
  so no text leaks between them.
- Each split's token stream (its files in name order, each followed by EOD) is cut into
  sequences of `seq_len` tokens; the last partial sequence is dropped and counted in the
  manifest. Sequences cross file boundaries (the EOD token marks them).
- Shards are written first, each atomically, and `dataset.json` last: a dataset without its
  manifest is incomplete and readers refuse it. An existing dataset at `out` is only replaced
  with `overwrite=True`.
- Preparing the same files twice gives byte-identical shards and manifest (no timestamps).
- Approximation of scale: a split's text is held in memory while it is cut (fine up to a few
  GB of text; the default corpus takes well under a second). A streaming writer for larger
  corpora would keep the same format.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from data_state import storage
from data_state.manifest import MANIFEST_NAME, DatasetManifest, ShardInfo, SplitInfo
from data_state.progress import Progress
from data_state.shards import encode_shard

TOKENIZERS = ("bytes",)
EOD_TOKEN = 0
SPLITS = ("train", "val")
ROW_GROUP_BYTES = 64 << 10  # random reads fetch whole row groups: keep them small
SHARD_BYTES = 32 << 20  # tokens per shard file, before compression


@dataclass(frozen=True)
class SourceFile:
    name: str  # stable name recorded in the manifest and hashed for the split
    path: str  # where to read it on this machine


def default_corpus_files() -> list[SourceFile]:
    """The standard library's `.py` files, sorted by their path inside the stdlib."""
    root = sysconfig.get_paths()["stdlib"]
    skip = frozenset({"site-packages", "dist-packages"})
    return [
        SourceFile(f"stdlib/{rel}", os.path.join(root, rel))
        for rel in _walk(root, skip)
        if rel.endswith(".py")
    ]


def collect_files(sources: Sequence[str]) -> list[SourceFile]:
    files: list[SourceFile] = []
    for source in sources:
        if os.path.isdir(source):
            base = os.path.normpath(source)
            files += [SourceFile(f"{base}/{rel}", os.path.join(base, rel)) for rel in _walk(base)]
        elif os.path.isfile(source):
            files.append(SourceFile(os.path.normpath(source), source))
        else:
            raise ValueError(f"source {source!r} is neither a file nor a directory")
    return sorted(files, key=lambda f: f.name)


def prepare_corpus(
    sources: Sequence[str] | None,
    out: str,
    *,
    seq_len: int = 256,
    val_fraction: float = 0.05,
    tokenizer: str = "bytes",
    max_bytes: int | None = None,
    rows_per_group: int | None = None,
    sequences_per_shard: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> DatasetManifest:
    """Prepare `sources` (default corpus if empty/None) into a dataset at `out`."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer {tokenizer!r} is not supported; use one of {TOKENIZERS}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (one input and one target), got {seq_len}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    rows_per_group = rows_per_group or max(1, ROW_GROUP_BYTES // seq_len)
    per_shard = sequences_per_shard or max(rows_per_group, SHARD_BYTES // seq_len)
    if rows_per_group < 1 or per_shard < 1:
        raise ValueError("rows_per_group and sequences_per_shard must be >= 1")

    fs, root = storage.resolve(out, storage_options)
    if fs.exists(storage.join(root, MANIFEST_NAME)) and not overwrite:
        raise ValueError(
            f"{out} already holds a dataset ({MANIFEST_NAME}); pass overwrite=True "
            "(CLI: --overwrite) to replace it, or choose another --out"
        )
    files = default_corpus_files() if not sources else collect_files(sources)
    files = _cap(files, max_bytes)
    if not files:
        raise ValueError("no source files to prepare (max_bytes smaller than the first file?)")
    texts, skipped = _read_texts(files, progress=progress)
    if not texts:
        raise ValueError("none of the source files is UTF-8 text; nothing to prepare")
    assignment = _split_by_file(
        {name: len(data) for name, (data, _) in texts.items()}, val_fraction
    )

    splits: dict[str, SplitInfo] = {}
    for split in SPLITS:
        names = sorted(n for n, s in assignment.items() if s == split)
        if not names and split == "val" and val_fraction == 0:
            continue
        splits[split] = _write_split(
            fs,
            root,
            split,
            [texts[n][0] for n in names],
            seq_len=seq_len,
            rows_per_group=rows_per_group,
            per_shard=per_shard,
            where=out,
        )
    manifest = DatasetManifest(
        seq_len=seq_len,
        token_dtype="uint8",
        tokenizer=tokenizer,
        vocab_size=256,
        eod_token=EOD_TOKEN,
        rows_per_group=rows_per_group,
        splits=splits,
        sources={
            "default_corpus": not sources,
            "files": [
                {
                    "path": n,
                    "bytes": len(texts[n][0]),
                    "sha256": texts[n][1],
                    "split": assignment[n],
                }
                for n in sorted(texts)
            ],
            "skipped": skipped,
        },
        made_by={
            "tool": "baton data prepare",
            "python": platform.python_version(),
            "pyarrow": pa.__version__,
            "val_fraction": val_fraction,
            "max_bytes": max_bytes,
        },
    )
    manifest.validate(where=out)
    storage.write_atomic(fs, storage.join(root, MANIFEST_NAME), manifest.to_json().encode())
    return manifest


def _walk(root: str, skip: frozenset[str] = frozenset()) -> Iterator[str]:
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
    return iter(sorted(found))


def _cap(files: list[SourceFile], max_bytes: int | None) -> list[SourceFile]:
    if max_bytes is None:
        return files
    kept, total = [], 0
    for f in files:
        total += os.path.getsize(f.path)
        if total > max_bytes:
            break
        kept.append(f)
    return kept


def _read_texts(
    files: list[SourceFile], *, progress: bool
) -> tuple[dict[str, tuple[bytes, str]], list[dict[str, str]]]:
    """name -> (bytes, sha256) of the text files; the others listed with the reason."""
    texts: dict[str, tuple[bytes, str]] = {}
    skipped: list[dict[str, str]] = []
    total = sum(os.path.getsize(f.path) for f in files)
    with Progress("prepare: reading sources", total, enabled=progress) as bar:
        for f in files:
            with open(f.path, "rb") as handle:
                data = handle.read()
            bar.advance(len(data))
            reason = _not_text(data)
            if reason:
                skipped.append({"path": f.name, "reason": reason})
            else:
                texts[f.name] = (data, hashlib.sha256(data).hexdigest())
    return texts, skipped


def _not_text(data: bytes) -> str:
    if b"\0" in data:
        return "contains NUL bytes (binary?)"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"not UTF-8 ({err.reason} at byte {err.start})"
    return ""


def _split_by_file(sizes: dict[str, int], val_fraction: float) -> dict[str, str]:
    assignment = dict.fromkeys(sizes, "train")
    if val_fraction <= 0 or len(sizes) < 2:
        return assignment
    target, val_bytes = val_fraction * sum(sizes.values()), 0
    by_hash = sorted(sizes, key=lambda n: hashlib.sha256(n.encode()).hexdigest())
    for name in by_hash[:-1]:  # never all files: train keeps at least one
        if val_bytes >= target and val_bytes > 0:
            break
        assignment[name] = "val"
        val_bytes += sizes[name]
    return assignment


def _write_split(
    fs: Any,
    root: str,
    split: str,
    docs: list[bytes],
    *,
    seq_len: int,
    rows_per_group: int,
    per_shard: int,
    where: str,
) -> SplitInfo:
    stream = np.frombuffer(b"".join(d + bytes([EOD_TOKEN]) for d in docs), dtype=np.uint8)
    num_sequences = len(stream) // seq_len
    if num_sequences == 0:
        raise ValueError(
            f"split {split!r} of {where} has {len(stream)} tokens, fewer than one sequence of "
            f"seq_len {seq_len}: add text, lower --seq-len or change --val-fraction"
        )
    sequences = stream[: num_sequences * seq_len].reshape(num_sequences, seq_len)
    shards = []
    for number, first in enumerate(range(0, num_sequences, per_shard)):
        part = sequences[first : first + per_shard]
        blob = encode_shard(part, rows_per_group=rows_per_group)
        rel = f"{split}/part-{number:05d}.parquet"
        storage.write_atomic(fs, storage.join(root, rel), blob)
        shards.append(
            ShardInfo(
                path=rel,
                num_sequences=len(part),
                num_bytes=len(blob),
                sha256=hashlib.sha256(blob).hexdigest(),
                tokens_sha256=hashlib.sha256(part.tobytes()).hexdigest(),
            )
        )
    return SplitInfo(
        num_sequences=num_sequences,
        num_tokens=num_sequences * seq_len,
        num_dropped_tokens=len(stream) - num_sequences * seq_len,
        shards=tuple(shards),
    )
