"""Cutting a split's token stream into Parquet shards: one rule, streamed or planned.

Contract:
- `shard_spans(total_tokens, seq_len=, per_shard=)` is the cutting rule, stated on a
  stream's length: shard k holds tokens `[k*S, (k+1)*S)` (`S = per_shard * seq_len`) while
  full shards fit, then one shorter shard with the remaining whole sequences; the partial
  sequence at the end is dropped. Shard numbering and contents depend only on the token
  stream, so the same stream gives the same bytes, however it was produced.
- `write_shard(fs, root, split, index, tokens, ...)` writes shard `SPLIT/part-NNNNN.parquet`
  atomically (`shards.encode_shard`) and returns its `ShardInfo` (checksums of the file and
  of the token bytes). Pure of any writer state: the Ray path calls it on the cluster.
- `split_info(split, shards, total_tokens, ...)` is the split's `SplitInfo`;
  `require_a_sequence` raises the `ValueError` naming a split with no complete sequence.
- `SplitWriter(fs, root, split, ...)` applies the rule while streaming: it takes the split's
  tokens in order through `append(tokens)` (any lengths), writes each full shard as soon as
  it fills and forgets it, so it holds at most one shard of tokens plus the last appended
  array; `finish()` writes the last, shorter shard and returns the `SplitInfo`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from data_state import storage
from data_state.manifest import ShardInfo, SplitInfo
from data_state.shards import encode_shard


def shard_spans(total_tokens: int, *, seq_len: int, per_shard: int) -> list[tuple[int, int]]:
    """`[start, end)` token ranges of the shards of a stream of `total_tokens` tokens."""
    shard_tokens = per_shard * seq_len
    full = total_tokens // shard_tokens
    spans = [(k * shard_tokens, (k + 1) * shard_tokens) for k in range(full)]
    rest = (total_tokens - full * shard_tokens) // seq_len * seq_len
    if rest:
        spans.append((full * shard_tokens, full * shard_tokens + rest))
    return spans


def write_shard(fs: Any, root: str, split: str, index: int, tokens: np.ndarray, *,
                seq_len: int, rows_per_group: int) -> ShardInfo:
    part = tokens.reshape(-1, seq_len)
    blob = encode_shard(part, rows_per_group=rows_per_group)
    rel = f"{split}/part-{index:05d}.parquet"
    storage.write_atomic(fs, storage.join(root, rel), blob)
    return ShardInfo(
        path=rel,
        num_sequences=len(part),
        num_bytes=len(blob),
        sha256=hashlib.sha256(blob).hexdigest(),
        tokens_sha256=hashlib.sha256(part.tobytes()).hexdigest(),
    )


def require_a_sequence(split: str, total_tokens: int, *, seq_len: int, where: str) -> None:
    if total_tokens < seq_len:
        raise ValueError(
            f"split {split!r} of {where} has {total_tokens} tokens, fewer than one "
            f"sequence of seq_len {seq_len}: add text, lower --seq-len or change "
            "--val-fraction"
        )


def split_info(split: str, shards: Sequence[ShardInfo], total_tokens: int, *, seq_len: int,
               where: str) -> SplitInfo:
    require_a_sequence(split, total_tokens, seq_len=seq_len, where=where)
    num_sequences = sum(s.num_sequences for s in shards)
    return SplitInfo(
        num_sequences=num_sequences,
        num_tokens=num_sequences * seq_len,
        num_dropped_tokens=total_tokens - num_sequences * seq_len,
        shards=tuple(shards),
    )


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
            full = [(a, b) for a, b in self._spans(len(stream)) if b - a == shard_tokens]
            for start, end in full:
                self._write(stream[start:end])
            written = full[-1][1]
            self._pending = [stream[written:]]
            self._pending_tokens = len(stream) - written

    def finish(self, *, where: str) -> SplitInfo:
        stream = np.concatenate(self._pending) if self._pending else np.zeros(0, self.dtype)
        for start, end in self._spans(len(stream)):  # less than a shard: the tail, if any
            self._write(stream[start:end])
        self._pending, self._pending_tokens = [], 0
        return split_info(self.split, self._shards, self.total_tokens, seq_len=self.seq_len,
                          where=where)

    def _spans(self, pending_tokens: int) -> list[tuple[int, int]]:
        return shard_spans(pending_tokens, seq_len=self.seq_len, per_shard=self.per_shard)

    def _write(self, tokens: np.ndarray) -> None:
        self._shards.append(write_shard(self.fs, self.root, self.split, len(self._shards),
                                        tokens, seq_len=self.seq_len,
                                        rows_per_group=self.rows_per_group))
