"""Parquet token shards: writing one, and reading its row groups from fetched byte ranges.

Contract:
- `encode_shard(tokens, rows_per_group)` turns an `(n, seq_len)` integer array into the bytes
  of a Parquet file with one column `tokens` (FIXED_LEN_BYTE_ARRAY, `seq_len * itemsize` bytes
  per row, little-endian), zstd-compressed, no dictionary, no statistics (min/max of token
  blobs would only bloat the footer), and CRC checksums on every page.
- `ShardReader.open()` reads the footer only (one ranged read of the file's tail) and checks
  it against the manifest: row count, column name and width. Any mismatch, a missing file or
  an unparsable footer raises `DatasetError` naming the shard.
- `ShardReader.byte_range(g)` is the byte range of row group `g`'s column chunk, and
  `decode(g, chunk)` turns those bytes into an `(rows, seq_len)` array. Splitting fetch from
  decode lets the dataset fetch many row groups with few requests (`storage.merge_ranges`).
  Page checksums are verified on decode, so a corrupt chunk raises `DatasetError`.

Decoding from a fetched chunk uses a read-only file object that serves pyarrow's reads from
the bytes we already hold (footer + chunk). If pyarrow ever asks for bytes outside them, the
object reads them from storage instead — slower, never wrong.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data_state.manifest import DatasetError, ShardInfo
from data_state.storage import RangeFile, Storage, TruncatedError, read_span

COLUMN = "tokens"
_FOOTER_READ = 1 << 16  # the footer of a shard with ~1000 row groups fits in one read


def encode_shard(tokens: np.ndarray, *, rows_per_group: int) -> bytes:
    """Parquet bytes holding `tokens` (shape `(n, seq_len)`, unsigned integer dtype)."""
    if tokens.ndim != 2 or tokens.dtype.kind != "u":
        raise ValueError(f"tokens must be a 2-D unsigned array, got {tokens.dtype} {tokens.shape}")
    n, seq_len = tokens.shape
    little = np.ascontiguousarray(tokens, dtype=tokens.dtype.newbyteorder("<"))
    width = seq_len * little.dtype.itemsize
    column = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(width), n, [None, pa.py_buffer(little.tobytes())]
    )
    sink = pa.BufferOutputStream()
    pq.write_table(
        pa.table({COLUMN: column}),
        sink,
        row_group_size=rows_per_group,
        compression="zstd",
        use_dictionary=False,
        write_statistics=False,
        write_page_checksum=True,
    )
    return sink.getvalue().to_pybytes()


class ShardReader:
    """Footer-level view of one shard; row groups are fetched by the caller and decoded here."""

    def __init__(
        self,
        io: Storage,
        path: str,
        info: ShardInfo,
        *,
        seq_len: int,
        dtype: np.dtype,
    ) -> None:
        self.io, self.path, self.info = io, path, info
        self.seq_len, self.dtype = seq_len, np.dtype(dtype).newbyteorder("<")
        self._metadata: pq.FileMetaData | None = None
        self._footer: tuple[int, bytes] = (0, b"")
        self.row_starts = np.zeros(1, dtype=np.int64)  # row group g covers [starts[g], starts[g+1])

    def open(self) -> ShardReader:
        size = self.info.num_bytes
        start = max(0, size - _FOOTER_READ)
        try:
            actual = self.io.size(self.path)
            tail = self.io.read_range(self.path, start, size) if actual == size else b""
        except FileNotFoundError:
            raise DatasetError(
                f"shard {self.path} listed in the manifest is missing: copy it back or prepare "
                "the dataset again"
            ) from None
        except TruncatedError:  # shrunk between the two requests
            actual = self.io.size(self.path)
            if actual == size:  # and grew back: what was read is not one version of it
                raise DatasetError(f"shard {self.path} changed while it was read; read it "
                                   "again once nothing writes it") from None
        if actual != size:
            raise DatasetError(
                f"shard {self.path} is {actual} bytes, the manifest says {size}: "
                "it was truncated or replaced; restore it or prepare the dataset again"
            )
        self._footer = (start, tail)
        try:
            self._metadata = pq.ParquetFile(self._file(), page_checksum_verification=True,
                                            pre_buffer=False).metadata
        except (pa.ArrowException, OSError) as err:
            raise DatasetError(f"shard {self.path} is corrupt (footer unreadable: {err})") from None
        self._check_against_manifest()
        counts = [self._metadata.row_group(g).num_rows for g in range(self.num_row_groups)]
        self.row_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return self

    @property
    def num_row_groups(self) -> int:
        return 0 if self._metadata is None else self._metadata.num_row_groups

    def byte_range(self, group: int) -> tuple[int, int]:
        assert self._metadata is not None, "open() first"
        chunk = self._metadata.row_group(group).column(0)
        start = chunk.data_page_offset
        if chunk.has_dictionary_page and chunk.dictionary_page_offset is not None:
            start = min(start, chunk.dictionary_page_offset)
        return start, start + chunk.total_compressed_size

    def decode(self, group: int, chunk: bytes) -> np.ndarray:
        """The `(rows, seq_len)` tokens of row group `group`, from its fetched column chunk."""
        start, _ = self.byte_range(group)
        try:
            parquet = pq.ParquetFile(
                self._file({start: chunk}),
                metadata=self._metadata,
                page_checksum_verification=True,
                pre_buffer=False,  # no read on Arrow's IO pool (see below)
            )
            # Everything in this thread: a task on Arrow's thread pools (pre-buffering, the
            # decode) can hold buffers of this Python file object, and one released there
            # during interpreter shutdown aborts the process ("terminate called without an
            # active exception"). One column of one row group gains nothing from them.
            column = parquet.read_row_group(group, columns=[COLUMN],
                                            use_threads=False).column(COLUMN)
        except (pa.ArrowException, OSError) as err:
            raise DatasetError(
                f"shard {self.path} is corrupt (row group {group}: {err}): prepare the dataset "
                "again or restore the file"
            ) from None
        arrays = [_flba_to_numpy(c, self.dtype, self.seq_len) for c in column.chunks]
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)

    def _file(self, pieces: dict[int, bytes] | None = None) -> RangeFile:
        # Fetched chunks first: a small shard's footer read also covers its row groups, and
        # a decode must use the bytes it was given.
        held = [*(pieces or {}).items(), self._footer]
        return RangeFile(self.info.num_bytes, self._fetch, held)

    def _fetch(self, start: int, end: int) -> bytes:
        return read_span(self.io, self.path, start, end)

    def _check_against_manifest(self) -> None:
        assert self._metadata is not None
        md, info = self._metadata, self.info
        if md.num_rows != info.num_sequences:
            raise DatasetError(
                f"shard {self.path} holds {md.num_rows} sequences but the manifest says "
                f"{info.num_sequences}: the shard and dataset.json do not belong together"
            )
        schema = md.schema.to_arrow_schema()
        width = self.seq_len * self.dtype.itemsize
        if schema.names != [COLUMN] or schema.field(COLUMN).type != pa.binary(width):
            raise DatasetError(
                f"shard {self.path} has schema {schema} but the manifest expects one column "
                f"{COLUMN!r} of fixed_size_binary[{width}] (seq_len {self.seq_len})"
            )


def _flba_to_numpy(array: pa.FixedSizeBinaryArray, dtype: np.dtype, seq_len: int) -> np.ndarray:
    width = seq_len * dtype.itemsize
    data = array.buffers()[1]
    flat = np.frombuffer(
        data, dtype=np.uint8, count=len(array) * width, offset=array.offset * width
    )
    return flat.view(dtype).reshape(len(array), seq_len)
