"""Corpus inputs: cutting them into work units, and reading a unit's documents.

Contract:
- Inputs come from `data_state.discover` (`InputFile`: name, uri, kind, size).
- Documents: a text file is one document; for JSON Lines, Parquet and Arrow inputs a
  document is a row (`text_field` of a JSON object, `text_column` of a table).
- `plan_units(inputs, ...)` cuts the inputs, in order, into `Unit`s of about `UNIT_BYTES`:
  several whole text files, a byte range of a JSON Lines file (a line belongs to the range
  its first byte is in), one Parquet row group, or a run of Arrow record batches. Units
  depend only on the inputs, never on how many workers read them, so the concatenation of
  units' documents in unit order is the same for any parallelism.
- The split is by document, deterministic, and no document is in both splits. Text files:
  ordered by the SHA-256 of their names, they go to `val` until it holds `val_fraction` of
  the text files' bytes (at least one when there are two or more; never all). Rows: a row
  is in `val` when the first 8 bytes of the SHA-256 of `"NAME#ROW"` (Parquet/Arrow: row
  number in the file) or `"NAME@OFFSET"` (JSON Lines: byte offset of the line), read as a
  number below 2^64, are below `val_fraction * 2^64`, so about that share of rows.
- `read_unit(unit, options)` returns the unit's usable documents per split, in order, and
  what it skipped: a text file that is not UTF-8, holds NUL bytes or is over
  `MAX_DOCUMENT_BYTES` is listed with the reason; a bad row (invalid JSON, not an object,
  missing field, not a string, not UTF-8, empty or only whitespace, NUL bytes, too large) is
  counted by reason. A Parquet/Arrow input without the text column is a `ValueError`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from data_state import storage
from data_state.discover import InputFile

UNIT_BYTES = 2 << 20  # input bytes per work unit: small enough to bound memory per worker
MAX_DOCUMENT_BYTES = 256 << 20  # one document is tokenized whole: larger ones are skipped
SPLITS = ("train", "val")
ROW_KINDS = ("jsonl", "parquet", "arrow")


@dataclass(frozen=True)
class Piece:
    """A part of one input: a whole text file, a byte range, a row group or a batch run."""

    input: InputFile
    nbytes: int  # planned input bytes (progress, unit sizes)
    start: int = 0  # jsonl: byte offset; parquet: row group; arrow: first record batch
    end: int = 0  # jsonl: byte offset (exclusive); arrow: the batch after the last
    first_row: int = 0  # parquet/arrow: number of the piece's first row in its file
    split: str = ""  # text files: the file's split; rows: decided per row


@dataclass(frozen=True)
class Unit:
    index: int
    pieces: tuple[Piece, ...]

    @property
    def size(self) -> int:
        return sum(p.nbytes for p in self.pieces)


@dataclass(frozen=True)
class ReadOptions:
    text_field: str = "text"
    text_column: str = "text"
    val_fraction: float = 0.0
    storage_options: Mapping[str, Any] | None = None


@dataclass
class UnitText:
    """What reading a unit gives: documents per split, in order, and the bookkeeping."""

    documents: dict[str, list[str]] = field(default_factory=lambda: {s: [] for s in SPLITS})
    files: list[dict[str, Any]] = field(default_factory=list)  # text files used
    skipped_files: list[dict[str, str]] = field(default_factory=list)
    rows: dict[str, Counter[str]] = field(default_factory=dict)  # input name -> counts
    bytes_read: int = 0


# -- planning ----------------------------------------------------------------------------


def split_text_files(inputs: Sequence[InputFile], val_fraction: float) -> dict[str, str]:
    """Text file name -> split (module docstring), from the listed sizes."""
    sizes = {f.name: f.size for f in inputs if f.kind == "text"}
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


def row_split(key: str, val_fraction: float) -> str:
    digest = hashlib.sha256(key.encode()).digest()
    return "val" if int.from_bytes(digest[:8], "big") < val_fraction * 2**64 else "train"


def plan_units(inputs: Sequence[InputFile], *, val_fraction: float, text_column: str,
               storage_options: Mapping[str, Any] | None = None) -> list[Unit]:
    assignment = split_text_files(inputs, val_fraction)
    pieces: list[Piece] = []
    for f in inputs:
        if f.kind == "text":
            pieces.append(Piece(f, f.size, split=assignment[f.name]))
        elif f.kind == "jsonl":
            pieces += [Piece(f, min(UNIT_BYTES, f.size - s), s, min(s + UNIT_BYTES, f.size))
                       for s in range(0, max(f.size, 1), UNIT_BYTES)]
        elif f.kind == "parquet":
            pieces += _parquet_pieces(f, text_column, storage_options)
        else:
            pieces += _arrow_pieces(f, text_column, storage_options)
    units: list[Unit] = []
    group: list[Piece] = []
    for piece in pieces:  # whole text files are grouped; every other piece is its own unit
        if group and (piece.input.kind != "text" or
                      sum(p.nbytes for p in group) + piece.nbytes > UNIT_BYTES):
            units.append(Unit(len(units), tuple(group)))
            group = []
        group.append(piece)
        if piece.input.kind != "text":
            units.append(Unit(len(units), tuple(group)))
            group = []
    if group:
        units.append(Unit(len(units), tuple(group)))
    return units


_storages: dict[str, storage.Storage] = {}  # one per bucket (or local disk) per process


def _locate(uri: str, options: Mapping[str, Any] | None) -> tuple[storage.Storage, str]:
    """The storage holding input `uri` and its path there (storages are reused)."""
    scheme, sep, rest = uri.partition("://")
    base = f"{scheme}://{rest.split('/', 1)[0]}" if sep and scheme != "file" else "/"
    if base not in _storages:
        # The sources are a person's own files (a cache of links, say), not a run or dataset
        # directory: links are followed; what is not a regular file is still refused.
        _storages[base] = storage.resolve(base, options, follow_links=True)[0]
    io = _storages[base]
    return io, (rest if sep and scheme != "file" else os.path.abspath(rest or uri))


def _open(uri: str, options: Mapping[str, Any] | None) -> io.BufferedReader:
    """A buffered, seekable read-only file over `uri` (local or s3://)."""
    store, path = _locate(uri, options)
    def fetch(start: int, end: int) -> bytes:  # exact, with the layer's deadlines and retries
        return store.read_range(path, start, end)

    return io.BufferedReader(storage.RangeFile(store.size(path), fetch), buffer_size=1 << 20)


def _check_column(schema: pa.Schema, column: str, f: InputFile) -> None:
    if column not in schema.names:
        raise ValueError(
            f"--text-column {column!r}: {f.name} has no such column (columns: "
            f"{', '.join(schema.names)})"
        )
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
        raise ValueError(f"--text-column {column!r} of {f.name} is {kind}, not text")


def _parquet_pieces(f: InputFile, column: str, options: Mapping[str, Any] | None
                    ) -> list[Piece]:
    with _open(f.uri, options) as handle:
        try:
            meta = pq.ParquetFile(handle).metadata
        except (pa.ArrowException, OSError) as err:
            raise ValueError(f"{f.name} is not a readable Parquet file ({err})") from None
        _check_column(meta.schema.to_arrow_schema(), column, f)
    pieces, row = [], 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        pieces.append(Piece(f, group.total_byte_size, g, g + 1, first_row=row))
        row += group.num_rows
    return pieces


def _arrow_pieces(f: InputFile, column: str, options: Mapping[str, Any] | None) -> list[Piece]:
    """Runs of record batches of about UNIT_BYTES each."""
    pieces: list[Piece] = []
    with _arrow_reader(f, options) as reader:
        _check_column(reader.schema, column, f)
        first, size, row, first_row, number = 0, 0, 0, 0, -1
        for number, batch in enumerate(reader):
            if number > first and size + batch.nbytes > UNIT_BYTES:
                pieces.append(Piece(f, size, first, number, first_row=first_row))
                first, size, first_row = number, 0, row
            size, row = size + batch.nbytes, row + batch.num_rows
        if number >= first:
            pieces.append(Piece(f, size, first, number + 1, first_row=first_row))
    return pieces


class _arrow_reader:  # noqa: N801 - used as a function in `with`
    """A record batch reader over an Arrow IPC input: memory-mapped when local (skipping
    batches costs nothing), streamed through fsspec otherwise (bounded memory)."""

    def __init__(self, f: InputFile, options: Mapping[str, Any] | None) -> None:
        self._f, self._options = f, options
        self._handle: Any = None

    def __enter__(self) -> Any:
        f = self._f
        for opener in (pa.ipc.open_stream, pa.ipc.open_file):
            if "://" in f.uri:
                self._handle = pa.PythonFile(_open(f.uri, self._options), mode="r")
            else:  # memory-mapped: skipping batches reads nothing
                self._handle = pa.memory_map(f.uri)
            try:
                return opener(self._handle)
            except pa.ArrowInvalid:
                self._handle.close()
        raise ValueError(f"{f.name} is not an Arrow IPC file (save_to_disk writes Arrow streams)")

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.close()


# -- reading -----------------------------------------------------------------------------


def read_unit(unit: Unit, options: ReadOptions) -> UnitText:
    out = UnitText()
    for piece in unit.pieces:
        kind = piece.input.kind
        if kind == "text":
            _read_text_file(piece, options, out)
        else:
            counts = out.rows.setdefault(piece.input.name, Counter())
            rows = {"jsonl": _jsonl_rows, "parquet": _parquet_rows, "arrow": _arrow_rows}[kind]
            for key, value in rows(piece, options, out):
                text, reason = _row_text(value)
                if reason:
                    counts[f"skipped: {reason}"] += 1
                    continue
                split = row_split(key, options.val_fraction)
                counts[split] += 1
                out.documents[split].append(text)
    return out


def _read_text_file(piece: Piece, options: ReadOptions, out: UnitText) -> None:
    f = piece.input
    if f.size > MAX_DOCUMENT_BYTES:
        reason = (f"larger than {MAX_DOCUMENT_BYTES >> 20} MiB (a text file is one document, "
                  "tokenized whole: split it, or use JSON Lines)")
        out.skipped_files.append({"path": f.name, "reason": reason})
        return
    store, path = _locate(f.uri, options.storage_options)
    data = store.read_range(path, 0, f.size)
    out.bytes_read += len(data)
    reason = not_text(data)
    if reason:
        out.skipped_files.append({"path": f.name, "reason": reason})
        return
    out.files.append({"path": f.name, "bytes": len(data),
                      "sha256": hashlib.sha256(data).hexdigest(), "split": piece.split})
    out.documents[piece.split].append(data.decode("utf-8"))


def not_text(data: bytes) -> str:
    if b"\0" in data:
        return "contains NUL bytes (binary?)"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"not UTF-8 ({err.reason} at byte {err.start})"
    return ""


_MISSING = object()


def _row_text(value: Any) -> tuple[str, str]:
    """(text, "") for a usable row value, ("", reason) otherwise."""
    if value is _MISSING:
        return "", "missing field"
    if isinstance(value, tuple):  # (reason,) from the row reader
        return "", value[0]
    if isinstance(value, bytes):
        if len(value) > MAX_DOCUMENT_BYTES:
            return "", "too large"
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return "", "not UTF-8"
    if value is None:
        return "", "missing field"
    if not isinstance(value, str):
        return "", "not a string"
    if not value.strip():
        return "", "empty"
    if "\0" in value:
        return "", "contains NUL"
    if len(value) > MAX_DOCUMENT_BYTES:
        return "", "too large"
    return value, ""


def _jsonl_rows(piece: Piece, options: ReadOptions, out: UnitText) -> Iterator[tuple[str, Any]]:
    name = piece.input.name
    with _open(piece.input.uri, options.storage_options) as handle:
        position = piece.start
        if position > 0:  # skip the line that started in the previous range
            handle.seek(position - 1)
            position += len(handle.readline()) - 1
        while position < piece.end:
            line = handle.readline()
            if not line:
                break
            key, position = f"{name}@{position}", position + len(line)
            out.bytes_read += len(line)
            if not line.strip():
                continue  # blank lines separate nothing in JSON Lines: not a row
            try:
                row = json.loads(line)
            except UnicodeDecodeError:
                yield key, ("not UTF-8",)
                continue
            except (ValueError, RecursionError):  # a crafted line nested 100,000 deep
                yield key, ("invalid JSON",)
                continue
            if not isinstance(row, dict):
                yield key, ("not a JSON object",)
                continue
            yield key, row.get(options.text_field, _MISSING)


def _parquet_rows(piece: Piece, options: ReadOptions, out: UnitText
                  ) -> Iterator[tuple[str, Any]]:
    with _open(piece.input.uri, options.storage_options) as handle:
        table = pq.ParquetFile(handle).read_row_group(piece.start, columns=[options.text_column])
    out.bytes_read += piece.nbytes
    yield from _column_rows(piece, table.column(options.text_column))


def _arrow_rows(piece: Piece, options: ReadOptions, out: UnitText) -> Iterator[tuple[str, Any]]:
    with _arrow_reader(piece.input, options.storage_options) as reader:
        batches = []
        for number, batch in enumerate(reader):
            if number >= piece.end:
                break
            if number >= piece.start:
                batches.append(batch.column(options.text_column))
    out.bytes_read += piece.nbytes
    yield from _column_rows(piece, pa.chunked_array(batches, type=batches[0].type))


def _column_rows(piece: Piece, column: pa.ChunkedArray) -> Iterator[tuple[str, Any]]:
    for offset, value in enumerate(column.to_pylist()):
        yield f"{piece.input.name}#{piece.first_row + offset}", value
