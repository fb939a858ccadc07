"""Running work units: in this process, in N worker processes, or on Ray — results in order.

Contract:
- A `Job` is everything a worker needs, small and plain: the tokenizer (the bytes of its
  `tokenizer.json`, or None for bytes), its EOS token, the `ReadOptions`, and whether to
  tokenize (False: return the train documents' text, used to train a tokenizer).
- `run_units(units, job, workers=N)` (and `ray_tokenize.run_units_on_ray(units, job)`) yield
  one `UnitResult` per unit, in unit order, whatever the parallelism: results are consumed
  in order, never by arrival, so the output is byte-identical for any N, on Ray or serial.
  (The Ray path that writes shards on the cluster returns results whose `tokens` are empty
  and whose `token_counts` say how many tokens of each split the unit has.)
- Bounded memory: at most `2 * N + 2` units, and `MAX_IN_FLIGHT_BYTES` of planned input
  (one unit more when a single unit is larger: a big Parquet row group), are in flight or
  waiting (most units are about `sources.UNIT_BYTES`), so memory does not grow with the
  corpus.
- Processes are started with `spawn` (safe with threads in the parent; every platform), each
  builds its tokenizer once, with the tokenizers library's own thread pool off (N processes
  already fill N cores). The serial path keeps that thread pool: `encode_batch` then uses
  every core of the machine for one unit's documents.
- `UnitResult.to_bytes()/from_bytes()` is how results cross Ray: a JSON header and raw token
  arrays (no pickle).
"""

from __future__ import annotations

import json
import os
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any

import numpy as np

from data_state.sources import SPLITS, ReadOptions, Unit, UnitText, read_unit
from data_state.tokenizer import ByteTokenizer, Tokenizer, from_file_bytes


@dataclass(frozen=True)
class Job:
    tokenizer_json: bytes | None  # None: the byte tokenizer
    eos_token: str | None
    read: ReadOptions
    tokenize: bool = True

    def build_tokenizer(self) -> Tokenizer:
        if self.tokenizer_json is None:
            return ByteTokenizer()
        return from_file_bytes(self.tokenizer_json, name="tokenizer", eos_token=self.eos_token)


@dataclass
class UnitResult:
    index: int
    tokens: dict[str, np.ndarray] = field(default_factory=dict)  # split -> token stream part
    texts: list[str] = field(default_factory=list)  # train documents (when not tokenizing)
    token_counts: dict[str, int] = field(default_factory=dict)  # split -> tokens kept elsewhere
    files: list[dict[str, Any]] = field(default_factory=list)
    skipped_files: list[dict[str, str]] = field(default_factory=list)
    rows: dict[str, dict[str, int]] = field(default_factory=dict)
    bytes_read: int = 0

    def to_bytes(self) -> bytes:
        arrays = dict(self.tokens)
        header = {
            "index": self.index, "texts": self.texts, "token_counts": self.token_counts,
            "files": self.files,
            "skipped_files": self.skipped_files, "rows": self.rows, "bytes_read": self.bytes_read,
            "arrays": [[s, str(a.dtype), int(a.size)] for s, a in arrays.items()],
        }
        head = json.dumps(header).encode()
        return b"".join([len(head).to_bytes(8, "little"), head,
                         *(np.ascontiguousarray(a).tobytes() for a in arrays.values())])

    @classmethod
    def from_bytes(cls, blob: bytes) -> UnitResult:
        size = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8 : 8 + size])
        position, tokens = 8 + size, {}
        for split, dtype, count in header.pop("arrays"):
            dt = np.dtype(dtype)
            tokens[split] = np.frombuffer(blob, dtype=dt, count=count, offset=position)
            position += count * dt.itemsize
        return cls(tokens=tokens, **header)


MAX_IN_FLIGHT_BYTES = 128 << 20
_worker: dict[str, Any] = {}


def init_worker(job: Job, own_threads: bool = False) -> None:
    """Per-process set-up: build the tokenizer once. `own_threads=False` turns off the
    tokenizers library's thread pool (set before its first use, which fixes it)."""
    if not own_threads:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        os.environ["RAYON_NUM_THREADS"] = "1"
    _worker["job"] = job
    _worker["tokenizer"] = job.build_tokenizer() if job.tokenize else None


def process_unit(unit: Unit) -> UnitResult:
    job: Job = _worker["job"]
    text: UnitText = read_unit(unit, job.read)
    result = UnitResult(
        index=unit.index,
        files=text.files,
        skipped_files=text.skipped_files,
        rows={name: dict(counts) for name, counts in text.rows.items()},
        bytes_read=text.bytes_read,
    )
    if job.tokenize:
        tokenizer = _worker["tokenizer"]
        result.tokens = {s: tokenizer.encode_documents(text.documents[s]) for s in SPLITS}
    else:
        result.texts = text.documents["train"]
    return result


def run_units(units: Sequence[Unit], job: Job, *, workers: int = 1) -> Iterator[UnitResult]:
    """Results in unit order, in this process (`workers=1`) or in `workers` processes.
    (The Ray path is `ray_tokenize.run_units_on_ray`, with the same results.)"""
    if workers <= 1:
        init_worker(job, own_threads=True)
        try:
            for unit in units:
                yield process_unit(unit)
        finally:
            _worker.clear()
    else:
        yield from _run_in_processes(units, job, workers)


def _run_in_processes(units: Sequence[Unit], job: Job, workers: int) -> Iterator[UnitResult]:
    window = 2 * workers + 2
    in_flight = 0  # planned input bytes of the pending units: large row groups count fully
    with ProcessPoolExecutor(
        max_workers=workers,
        mp_context=get_context("spawn"),
        initializer=init_worker,
        initargs=(job, False),
    ) as pool:
        pending: deque[Future[UnitResult]] = deque()
        sizes: deque[int] = deque()
        remaining = iter(units)
        try:
            for unit in remaining:
                while pending and (len(pending) >= window
                                   or in_flight + unit.size > MAX_IN_FLIGHT_BYTES):
                    done = pending.popleft()
                    in_flight -= sizes.popleft()
                    yield done.result()
                pending.append(pool.submit(process_unit, unit))
                sizes.append(unit.size)
                in_flight += unit.size
            while pending:
                sizes.popleft()
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def merge_rows(total: dict[str, Counter[str]], rows: dict[str, dict[str, int]]) -> None:
    for name, counts in rows.items():
        total.setdefault(name, Counter()).update(counts)
