"""Corpus preparation: text, JSON Lines, Parquet or `save_to_disk` inputs -> fixed-length token
sequences in Parquet + `dataset.json`, streaming, on one process, N processes or Ray.

Contract of `prepare_corpus(sources, out, *, seq_len, ...)` (the guide: docs/data.md):
- Sources (`discover.discover`): local files, directories, globs, `s3://` URIs. With none it
  prepares the **default corpus**: every `.py` file of this Python's standard library
  (`sysconfig.get_paths()["stdlib"]`, no `site-packages`/`dist-packages`; about 31 MB / 1,800
  files on CPython 3.11), so no download is ever needed; the manifest records the Python
  version and every file's checksum.
- Inputs in sorted order of their names; `max_bytes` keeps the longest prefix that fits. A
  document is a text file or a row (`text_field` of JSON Lines, `text_column` of
  Parquet/Arrow). Unusable files are listed in the manifest with the reason, unusable rows
  counted by reason (`sources.read_unit`); no usable document at all is a `ValueError` with
  those counts.
- Tokenizer (`tokenizer.py`): `"bytes"` (vocab 256, byte 0 ends each document), a local
  `tokenizer.json` or model directory, or a byte-level BPE of `train_tokenizer` ids trained on
  the train split first (a second pass). Token dtype follows the vocabulary. A tokenizers
  tokenizer is stored as `URI/tokenizer.json` with its SHA-256, vocab size and special tokens.
- Split by document, deterministic, no leakage (`sources`). Each split's token stream (documents
  in input order, each followed by EOS) is cut into `seq_len` sequences (`split_writer.py`),
  crossing document boundaries; the last partial sequence is dropped and counted.
- Streaming: work units of about 2 MB, results consumed in unit order (`parallel.py`), shards
  written as they fill; memory is a few units per worker plus one shard per split (32 MB of
  tokens), whatever the corpus size (the tokenizer trainer's counts grow with distinct words).
- `workers=N` tokenizes in N processes, `use_ray=True` with Ray Data, which writes the shards
  on the cluster (`ray_tokenize.py`: the driver sees counts and writes the manifest); the
  output is byte-identical to the serial run's (nothing about N is recorded).
- Shards (and tokenizer) are written first, each atomically, `dataset.json` last: a dataset
  without its manifest is incomplete and refused. An existing dataset is replaced only with
  `overwrite=True` (its manifest removed first). Same inputs, byte-identical output.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from data_state import storage
from data_state.discover import InputFile, cap, discover, walk
from data_state.manifest import MANIFEST_NAME, DatasetManifest, SplitInfo
from data_state.parallel import Job, UnitResult, merge_rows, run_units
from data_state.progress import Progress
from data_state.sources import SPLITS, ReadOptions, Unit, plan_units
from data_state.split_writer import SplitWriter
from data_state.tokenizer import (
    BYTES,
    MAX_TRAINED_VOCAB,
    TOKENIZER_FILE,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    train_bpe,
)

EOD_TOKEN = 0  # the byte tokenizer's end of document
ROW_GROUP_BYTES = 64 << 10  # random reads fetch whole row groups: keep them small
SHARD_BYTES = 32 << 20  # token bytes per shard file, before compression


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
        for rel in walk(root, skip)
        if rel.endswith(".py")
    ]


def prepare_corpus(
    sources: Sequence[str] | None,
    out: str,
    *,
    seq_len: int = 256,
    val_fraction: float = 0.05,
    tokenizer: str = BYTES,
    train_tokenizer: int | None = None,
    eos_token: str | None = None,
    text_field: str = "text",
    text_column: str = "text",
    workers: int = 1,
    use_ray: bool = False,
    max_bytes: int | None = None,
    rows_per_group: int | None = None,
    sequences_per_shard: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> DatasetManifest:
    """Prepare `sources` (default corpus if empty/None) into a dataset at `out`."""
    _check_options(seq_len=seq_len, val_fraction=val_fraction, max_bytes=max_bytes,
                   workers=workers, tokenizer=tokenizer, train_tokenizer=train_tokenizer,
                   text_field=text_field, text_column=text_column)
    fs, root = storage.resolve(out, storage_options)
    manifest_path = storage.join(root, MANIFEST_NAME)
    if fs.exists(manifest_path) and not overwrite:
        raise ValueError(
            f"{out} already holds a dataset ({MANIFEST_NAME}); pass overwrite=True "
            "(CLI: --overwrite) to replace it, or choose another --out"
        )
    tok = _given_tokenizer(tokenizer, train_tokenizer, eos_token)
    inputs = _default_inputs() if not sources else discover(sources, storage_options)
    inputs = cap(inputs, max_bytes)
    if not inputs:
        raise ValueError("no source files to prepare (max_bytes smaller than the first file?)")
    read = ReadOptions(text_field, text_column, val_fraction, storage_options)
    units = plan_units(inputs, val_fraction=val_fraction, text_column=text_column,
                       storage_options=storage_options)
    if tok is None:
        tok = _train_tokenizer(units, read, train_tokenizer or 0, workers=workers,
                               use_ray=use_ray, progress=progress)
    shape = _ShardShape.of(tok, seq_len, rows_per_group, sequences_per_shard)
    if fs.exists(manifest_path):  # overwrite: the old manifest must not describe new shards
        fs.remove(manifest_path)
    if tok.file_bytes is not None:
        storage.write_atomic(fs, storage.join(root, TOKENIZER_FILE), tok.file_bytes)
    job = Job(tok.file_bytes, getattr(tok, "eos_token", None), read, tokenize=True)
    wanted = [s for s in SPLITS if not (s == "val" and val_fraction == 0)]
    if use_ray:
        uri = root if fs.is_local else out  # an absolute path: Ray workers have their own cwd
        splits, seen = _write_on_ray(uri, storage_options, str(tok.dtype), shape, units, job,
                                     wanted, out, progress, inputs, read)
    else:
        writers = {split: SplitWriter(fs, root, split, seq_len=shape.seq_len, dtype=tok.dtype,
                                      rows_per_group=shape.rows_per_group,
                                      per_shard=shape.per_shard)
                   for split in SPLITS}
        seen = _consume(run_units(units, job, workers=workers), units, writers, progress,
                        inputs, read)
        splits = {split: writers[split].finish(where=out) for split in wanted}
    manifest = DatasetManifest(
        seq_len=seq_len,
        token_dtype=str(tok.dtype),
        tokenizer="tokenizers" if isinstance(tok, HFTokenizer) else BYTES,
        vocab_size=tok.vocab_size,
        eod_token=tok.eos_id,
        rows_per_group=shape.rows_per_group,
        splits=splits,
        sources=_sources_record(sources, inputs, seen.files, seen.skipped, seen.rows),
        tokenizer_file=TOKENIZER_FILE if tok.file_bytes is not None else None,
        tokenizer_sha256=(hashlib.sha256(tok.file_bytes).hexdigest()
                          if tok.file_bytes is not None else None),
        special_tokens=dict(tok.special_tokens),
        made_by=_made_by(tok, tokenizer, train_tokenizer, val_fraction, max_bytes,
                         text_field, text_column, inputs),
    )
    manifest.validate(where=out)
    storage.write_atomic(fs, manifest_path, manifest.to_json().encode())
    return manifest


def _check_options(*, seq_len: int, val_fraction: float, max_bytes: int | None, workers: int,
                   tokenizer: str, train_tokenizer: int | None, text_field: str,
                   text_column: str) -> None:
    """Refuse options that cannot prepare a dataset, before anything is read or written."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (one input and one target), got {seq_len}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if train_tokenizer is not None and tokenizer != BYTES:
        raise ValueError("--train-tokenizer and --tokenizer exclude each other: choose one")
    if not text_field or not text_column:
        raise ValueError("--text-field and --text-column must not be empty")


def _given_tokenizer(tokenizer: str, train_tokenizer: int | None,
                     eos_token: str | None) -> Tokenizer | None:
    """The tokenizer named by `tokenizer`, loaded before any input is read (a bad one fails
    first); None when one is to be trained (`train_tokenizer`)."""
    if train_tokenizer is None:
        return load_tokenizer(tokenizer, eos_token=eos_token)
    if eos_token is not None:
        raise ValueError("--eos-token applies to --tokenizer PATH (a trained BPE uses "
                         "<|endoftext|>)")
    return None


@dataclass(frozen=True)
class _ShardShape:
    """Tokens per sequence, sequences per Parquet row group and per shard file."""

    seq_len: int
    rows_per_group: int
    per_shard: int

    @staticmethod
    def of(tok: Tokenizer, seq_len: int, rows_per_group: int | None,
           sequences_per_shard: int | None) -> _ShardShape:
        """The sizes given, else about `ROW_GROUP_BYTES` and `SHARD_BYTES` of tokens."""
        rows = rows_per_group or max(1, ROW_GROUP_BYTES // (seq_len * tok.dtype.itemsize))
        per_shard = sequences_per_shard or max(rows,
                                               SHARD_BYTES // (seq_len * tok.dtype.itemsize))
        if rows < 1 or per_shard < 1:
            raise ValueError("rows_per_group and sequences_per_shard must be >= 1")
        return _ShardShape(seq_len, rows, per_shard)


@dataclass
class _Seen:
    """What the tokenizing pass found: documents' files, unusable files, rows per input."""

    files: list[dict[str, Any]]
    skipped: list[dict[str, str]]
    rows: dict[str, Counter[str]]


def _consume(results: Iterator[UnitResult], units: Sequence[Unit],
             writers: Mapping[str, SplitWriter], progress: bool, inputs: Sequence[InputFile],
             read: ReadOptions) -> _Seen:
    """Append every unit's tokens to its split's writer (none on Ray: the cluster writes
    them) and collect what was found; an input with no document at all is a `ValueError`."""
    seen = _Seen([], [], {})
    for result in _with_progress(results, units, "prepare: tokenizing", progress):
        for split, writer in writers.items():
            writer.append(result.tokens[split])
        seen.files += result.files
        seen.skipped += result.skipped_files
        merge_rows(seen.rows, result.rows)
    documents = len(seen.files) + sum(c["train"] + c["val"] for c in seen.rows.values())
    if documents == 0:
        raise ValueError(_no_text_message(inputs, seen.skipped, seen.rows, read.text_field,
                                          read.text_column))
    return seen


def _write_on_ray(uri: str, storage_options: Mapping[str, Any] | None, dtype: str,
                  shape: _ShardShape, units: Sequence[Unit], job: Job, wanted: list[str],
                  out: str, progress: bool, inputs: Sequence[InputFile], read: ReadOptions
                  ) -> tuple[dict[str, SplitInfo], _Seen]:
    """Tokenize and write the shards on the Ray cluster (`ray_tokenize.RayShardWriter`):
    the wanted splits' records and what was found."""
    from data_state.ray_tokenize import RayShardWriter, ShardLayout  # Ray only when asked

    on_ray = RayShardWriter(ShardLayout(uri, storage_options, dtype, shape.seq_len,
                                        shape.rows_per_group, shape.per_shard))
    results = on_ray.tokenize(units, job)
    try:
        seen = _consume(results, units, {}, progress, inputs, read)
        return on_ray.finish(wanted, where=out), seen
    finally:
        on_ray.close()


def _default_inputs() -> list[InputFile]:
    return [InputFile(f.name, f.path, "text", os.path.getsize(f.path))
            for f in default_corpus_files()]


def _run(units: Sequence[Unit], job: Job, workers: int, use_ray: bool
         ) -> Iterator[UnitResult]:
    if use_ray:
        from data_state.ray_tokenize import run_units_on_ray  # Ray only when asked for

        return run_units_on_ray(units, job)
    return run_units(units, job, workers=workers)


def _with_progress(results: Iterator[UnitResult], units: Sequence[Unit], what: str,
                   enabled: bool) -> Iterator[UnitResult]:
    with Progress(what, sum(u.size for u in units), enabled=enabled) as bar:
        for result in results:
            bar.advance(units[result.index].size)
            yield result


def _train_tokenizer(units: Sequence[Unit], read: ReadOptions, vocab_size: int, *,
                     workers: int, use_ray: bool, progress: bool) -> HFTokenizer:
    """First pass: read the train split's documents (in order) and train a BPE on them."""
    if not 257 <= vocab_size <= MAX_TRAINED_VOCAB:  # refused before reading anything
        train_bpe([], vocab_size)
    job = Job(None, None, read, tokenize=False)
    results = _with_progress(_run(units, job, workers, use_ray), units,
                             "prepare: reading the train split for the tokenizer", progress)

    def batches() -> Iterator[list[str]]:
        for result in results:
            if result.texts:
                yield result.texts

    return train_bpe(batches(), vocab_size)


def _no_text_message(inputs: Sequence[InputFile], skipped: list[dict[str, str]],
                     rows: dict[str, Counter[str]], text_field: str, text_column: str) -> str:
    reasons: Counter[str] = Counter()
    for counts in rows.values():
        reasons.update({k.removeprefix("skipped: "): v for k, v in counts.items()
                        if k.startswith("skipped: ")})
    parts = [f"{len(skipped)} file(s) skipped"] if skipped else []
    if skipped:
        parts[0] += f" (first: {skipped[0]['path']}: {skipped[0]['reason']})"
    parts += [f"{n} row(s) {reason}" for reason, n in sorted(reasons.items())]
    hint = ""
    if reasons.get("missing field"):
        kinds = {f.kind for f in inputs}
        hint = (f"; set --text-field (JSON Lines, now {text_field!r})" if "jsonl" in kinds
                else f"; set --text-column (now {text_column!r})")
    return (f"no usable text in {len(inputs)} input file(s): "
            f"{', '.join(parts) or 'they are empty'}{hint}")


def _sources_record(sources: Sequence[str] | None, inputs: Sequence[InputFile],
                    files: list[dict[str, Any]], skipped: list[dict[str, str]],
                    rows: dict[str, Counter[str]]) -> dict[str, Any]:
    row_inputs, totals = [], Counter[str]()
    for f in inputs:
        if f.name not in rows:
            continue
        counts = rows[f.name]
        bad = {k.removeprefix("skipped: "): v for k, v in sorted(counts.items())
               if k.startswith("skipped: ")}
        totals.update(bad)
        row_inputs.append({"path": f.name, "kind": f.kind, "bytes": f.size,
                           "train_rows": counts["train"], "val_rows": counts["val"],
                           "skipped_rows": bad})
    return {
        "default_corpus": not sources,
        "files": files,
        "skipped": skipped,
        "row_inputs": row_inputs,
        "skipped_rows": dict(sorted(totals.items())),
    }


def _made_by(tok: Tokenizer, tokenizer: str, train_tokenizer: int | None, val_fraction: float,
             max_bytes: int | None, text_field: str, text_column: str,
             inputs: Sequence[InputFile]) -> dict[str, Any]:
    made: dict[str, Any] = {
        "tool": "baton data prepare",
        "python": platform.python_version(),
        "pyarrow": pa.__version__,
        "val_fraction": val_fraction,
        "max_bytes": max_bytes,
    }
    if isinstance(tok, HFTokenizer):
        import tokenizers

        made["tokenizers"] = tokenizers.__version__
        made["tokenizer_source"] = (f"trained: byte-level BPE, {train_tokenizer} ids, on the "
                                    "train split" if train_tokenizer else tokenizer)
    kinds = {f.kind for f in inputs}
    if "jsonl" in kinds:
        made["text_field"] = text_field
    if kinds & {"parquet", "arrow"}:
        made["text_column"] = text_column
    return made
