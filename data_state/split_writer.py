"""The streaming writer of one split: tokens in, full Parquet shards out as they fill.

Contract: `SplitWriter(fs, root, split, ...)` takes a split's token stream in order through
`append(tokens)` (any lengths) and cuts it into sequences of `seq_len` tokens; every time
`per_shard` sequences are complete it writes shard `SPLIT/part-NNNNN.parquet` (atomically,
`shards.encode_shard`) and forgets them, so it holds at most one shard of tokens plus the
last appended array. `finish()` writes the last, shorter shard, drops the partial sequence
at the end (counted as `num_dropped_tokens`) and returns the split's `SplitInfo`; a split
with no complete sequence is a `ValueError` naming it. Shard numbering and contents depend
only on the token stream, so the same stream gives the same bytes, however it was produced.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from data_state import storage
from data_state.manifest import ShardInfo, SplitInfo
from data_state.shards import encode_shard


class SplitWriter:
    def __init__(self, fs: Any, root: str, split: str, *, seq_len: int, dtype: np.dtype,
                 rows_per_group: int, per_shard: int) -> None:
        self.fs, self.root, self.split = fs, root, split
        self.seq_len, self.dtype = seq_len, np.dtype(dtype)
        self.rows_per_group, self.per_shard = rows_per_group, per_shard
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._shards: list[ShardInfo] = []
        self.total_tokens = 0

    def append(self, tokens: np.ndarray) -> None:
        if tokens.size == 0:
            return
        self._pending.append(np.asarray(tokens, dtype=self.dtype))
        self._pending_tokens += tokens.size
        self.total_tokens += tokens.size
        shard_tokens = self.per_shard * self.seq_len
        if self._pending_tokens >= shard_tokens:
            stream = np.concatenate(self._pending)
            full = len(stream) // shard_tokens * shard_tokens
            for start in range(0, full, shard_tokens):
                self._write(stream[start : start + shard_tokens])
            self._pending = [stream[full:]]
            self._pending_tokens = len(stream) - full

    def finish(self, *, where: str) -> SplitInfo:
        stream = np.concatenate(self._pending) if self._pending else np.zeros(0, self.dtype)
        tail = len(stream) // self.seq_len * self.seq_len
        if tail:
            self._write(stream[:tail])
        num_sequences = sum(s.num_sequences for s in self._shards)
        if num_sequences == 0:
            raise ValueError(
                f"split {self.split!r} of {where} has {self.total_tokens} tokens, fewer than one "
                f"sequence of seq_len {self.seq_len}: add text, lower --seq-len or change "
                "--val-fraction"
            )
        self._pending, self._pending_tokens = [], 0
        return SplitInfo(
            num_sequences=num_sequences,
            num_tokens=num_sequences * self.seq_len,
            num_dropped_tokens=self.total_tokens - num_sequences * self.seq_len,
            shards=tuple(self._shards),
        )

    def _write(self, tokens: np.ndarray) -> None:
        part = tokens.reshape(-1, self.seq_len)
        blob = encode_shard(part, rows_per_group=self.rows_per_group)
        rel = f"{self.split}/part-{len(self._shards):05d}.parquet"
        storage.write_atomic(self.fs, storage.join(self.root, rel), blob)
        self._shards.append(
            ShardInfo(
                path=rel,
                num_sequences=len(part),
                num_bytes=len(blob),
                sha256=hashlib.sha256(blob).hexdigest(),
                tokens_sha256=hashlib.sha256(part.tobytes()).hexdigest(),
            )
        )
