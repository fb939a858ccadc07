"""Reads the units of a stream, keeps a few and reads ahead: what every rank's loader asks.

Contract:
- `UnitFeeder(read_unit, labels, *, keep=4, read_ahead=2)`: `read_unit(k)`
  returns unit k's output (`data_state.ray_units`) as a `pyarrow.Table`; `labels[k]` names it.
  `count(k)`, `digest(k)` and `rows(k, indices)` (unit k's rows at `indices`, in that order)
  read the unit if need be. A unit read is kept while among the `keep` used last; the counts
  of every unit read stay (a few bytes each), so planning steps over units already passed
  never reads them again; a digest is computed when asked (a snapshot's unit) and kept.
- `read_ahead(units)` reads those units in the background, `read_ahead` at a time (the loader
  names the next units of its epoch), so a step rarely waits for a read.
- A unit whose read fails raises `UnitReadError` naming the unit and the error from every call
  that needs it, each reading it again (a passing fault may pass), unless the call says
  `on_error="skip"`: then the failure stands for the feeder's life, the unit holds 0 rows, is
  listed in `skipped()` and warned about once. A unit that fails to read (a corrupt file)
  fails again, so every rank and every resume skips the same units.
- `digest(k)` is a BLAKE2b of the unit's rows (schema and values), whatever blocks Ray Data
  made them in: the loader records it with its position and compares it after a resume.
Thread-safe. `trainer.on_ray.data_feeder` runs one in a named actor that every rank of a run
shares, so each unit is read once for all ranks.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa

log = logging.getLogger("baton.data")

ON_ERROR = ("raise", "skip")
_EMPTY = pa.table({})


class UnitReadError(RuntimeError):
    """A unit of the stream could not be read (the user's pipeline failed on it)."""


class UnitFeeder:
    """See the module docstring."""

    def __init__(self, read_unit: Callable[[int], pa.Table], labels: Sequence[str], *,
                 keep: int = 4, read_ahead: int = 2) -> None:
        if keep < 1 or read_ahead < 0:
            raise ValueError(f"keep must be >= 1 and read_ahead >= 0, got {keep}, {read_ahead}")
        self._read_unit = read_unit
        self.labels = tuple(labels)
        self.keep = keep
        self._lock = threading.Lock()
        self._kept: OrderedDict[int, pa.Table] = OrderedDict()
        self._reading: dict[int, Future[pa.Table]] = {}
        self._counts: dict[int, int] = {}
        self._digests: dict[int, str] = {}
        self._failed: dict[int, str] = {}  # unit -> why its last read failed
        self._skipped: set[int] = set()  # failed units a loader skipped (`on_error="skip"`)
        self._pool = ThreadPoolExecutor(max(1, read_ahead), thread_name_prefix="baton-units")
        self.reads = 0  # units read (a unit read again after it was dropped counts again)

    # ------------------------------------------------------------------ asked by loaders

    def count(self, unit: int, on_error: str = "raise") -> int:
        with self._lock:
            if unit in self._counts:
                return self._counts[unit]
        return self._table(unit, on_error).num_rows

    def digest(self, unit: int, on_error: str = "raise") -> str:
        with self._lock:
            if unit in self._digests:
                return self._digests[unit]
        digest = table_digest(self._table(unit, on_error))
        with self._lock:
            self._digests[unit] = digest
        return digest

    def rows(self, unit: int, indices: Sequence[int] | np.ndarray,
             on_error: str = "raise") -> pa.Table:
        return self._table(unit, on_error).take(pa.array(np.asarray(indices, dtype=np.int64)))

    def read_ahead(self, units: Sequence[int]) -> None:
        with self._lock:
            for unit in units:
                if unit not in self._kept and unit not in self._reading \
                        and unit not in self._failed:
                    self._reading[unit] = self._pool.submit(self._read, unit)

    def skipped(self) -> dict[int, str]:
        """Units skipped under `on_error="skip"`, with why."""
        with self._lock:
            return {unit: self._failed[unit] for unit in sorted(self._skipped)}

    def close(self) -> None:
        """Cancel the reads not started and wait for the others (they run Ray Data)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ internals

    def _check(self, unit: int) -> None:
        if not 0 <= unit < len(self.labels):
            raise IndexError(f"unit {unit} of {len(self.labels)}")

    def _table(self, unit: int, on_error: str) -> pa.Table:
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        self._check(unit)
        with self._lock:
            if unit in self._kept:
                self._kept.move_to_end(unit)
                return self._kept[unit]
            if unit in self._failed and on_error == "skip":
                return self._skip(unit)
            future = self._reading.get(unit)
            if future is None:
                future = self._reading[unit] = self._pool.submit(self._read, unit)
        try:
            return future.result()
        except UnitReadError:
            if on_error == "raise":
                raise
            with self._lock:
                return self._skip(unit)

    def _skip(self, unit: int) -> pa.Table:
        """Unit `unit` failed and a loader skips it (called under the lock)."""
        if unit not in self._skipped:
            self._skipped.add(unit)
            log.warning("skipping %s: %s", self.labels[unit], self._failed[unit])
        self._counts[unit] = 0
        return _EMPTY

    def _read(self, unit: int) -> pa.Table:
        try:
            table = self._read_unit(unit)
        except Exception as err:  # noqa: BLE001 - the user's pipeline: any error
            reason = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
            with self._lock:
                self._failed[unit] = reason
                self._reading.pop(unit, None)
            raise UnitReadError(f"reading {self.labels[unit]} through the pipeline failed: "
                                f"{reason} (data_loader(on_error='skip') skips such units "
                                "and counts them)") from err
        with self._lock:
            self.reads += 1
            self._failed.pop(unit, None)
            self._counts[unit] = table.num_rows
            self._kept[unit] = table
            self._kept.move_to_end(unit)
            while len(self._kept) > self.keep:
                self._kept.popitem(last=False)
            self._reading.pop(unit, None)
        return table


def table_digest(table: pa.Table) -> str:
    """BLAKE2b of a table's schema and values, the same however its columns are chunked."""
    combined = table.combine_chunks()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, combined.schema) as writer:
        for batch in combined.to_batches():
            writer.write_batch(batch)
    return hashlib.blake2b(memoryview(sink.getvalue()), digest_size=16).hexdigest()

