"""A Ray Data pipeline's units, read by one feeder that every rank of a run asks.

Contract:
- `unit_reader(units)`: reads unit k of `data_state.ray_units.PipelineUnits` through the
  whole pipeline (Ray Data runs it: tasks or actors, on any node) into one `pyarrow.Table`.
- `FeederActor` (a Ray actor class; `create_feeder(ds, name, units=, options=)`
  starts one, named, in the current namespace) holds a `data_state.stream_feeder.UnitFeeder`
  over `ds`'s units; the ranks of a run share it, so each unit goes through the pipeline once
  for all of them and each rank receives only its rows. If its process dies, Ray starts it
  again (up to `FEEDER_RESTARTS` times) and repeats the calls it was serving.
  `FeederClient(handle)` is its client (`count`, `digest`, `rows`, `read_ahead`, `labels`,
  `fingerprint`, `units`), blocking; a call that waits longer than `WAIT_WARN_S` says so every
  `WAIT_WARN_S` (a pipeline whose tasks wait for CPUs the trainers hold waits without end:
  never in silence).
- `local_feeder(ds, units=)` is the same feeder in this process, for a `Session`
  outside Ray Train (every rank that makes one reads every unit itself).
The actor serves several ranks at once (threads); reads run on the feeder's own threads.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pyarrow as pa
import ray
from ray.exceptions import GetTimeoutError

from data_state.ray_units import PipelineUnits, pipeline_units
from data_state.stream_feeder import UnitFeeder

KEEP_UNITS = 4
READ_AHEAD = 2
WAIT_WARN_S = 60.0
# A feeder whose process dies (killed, out of memory) is started again by Ray, and the calls
# it was serving are sent again: every call only reads, so a repeat is harmless. Bounded: a
# feeder that dies on every start ends the run with Ray's error instead of retrying forever.
FEEDER_RESTARTS = 3

log = logging.getLogger("baton.data")


def unit_reader(units: PipelineUnits) -> Any:
    def read(unit: int) -> pa.Table:
        tables = [ray.get(ref) for ref in units.dataset(unit).to_arrow_refs()]
        tables = [t for t in tables if t.num_rows]
        if not tables:
            return pa.table({})
        return pa.concat_tables(tables, promote_options="default") \
            if len(tables) > 1 else tables[0]
    return read


class _Feeder:
    """The actor's body: a `UnitFeeder` and what the loader needs to know of the data."""

    def __init__(self, found: PipelineUnits) -> None:
        self._feeder = _feeder_over(found)
        self._info = {"units": self._feeder.units, "fingerprint": self._feeder.fingerprint,
                      "labels": list(self._feeder.labels)}

    def info(self) -> dict[str, Any]:
        return self._info

    def count(self, unit: int, on_error: str) -> int:
        return self._feeder.count(unit, on_error)

    def digest(self, unit: int, on_error: str) -> str:
        return self._feeder.digest(unit, on_error)

    def rows(self, unit: int, indices: list[int], on_error: str) -> pa.Table:
        return self._feeder.rows(unit, indices, on_error)

    def read_ahead(self, units: list[int]) -> None:
        self._feeder.read_ahead(units)

    def skipped(self) -> dict[int, str]:
        return self._feeder.skipped()

    def reads(self) -> int:
        return self._feeder.reads


FeederActor = ray.remote(_Feeder)


def create_feeder(ds: Any, name: str, *, units: int | None = None,
                  options: dict[str, Any] | None = None) -> Any:
    """A feeder actor called `name` for `ds`, once the units are listed here (before trainers
    take the CPUs the listing needs); checks the pipeline first (a `ValueError` naming what is
    refused, raised here in the caller). The actor is handed the listing: a listing is a Ray
    Data task, seconds on a busy cluster, and a restarted actor gets the same one."""
    found = pipeline_units(ds, units)
    handle = FeederActor.options(name=name, num_cpus=0, max_concurrency=16,
                                 max_restarts=FEEDER_RESTARTS,
                                 max_task_retries=FEEDER_RESTARTS,
                                 **(options or {})).remote(found)
    ray.get(handle.info.remote())  # type: ignore[attr-defined]
    return handle


class FeederClient:
    """The ranks' side of a feeder actor (module contract)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        info = ray.get(handle.info.remote())
        self.units, self.fingerprint = int(info["units"]), str(info["fingerprint"])
        self.labels = tuple(info["labels"])

    def count(self, unit: int, on_error: str = "raise") -> int:
        return int(self._get(self.handle.count.remote(unit, on_error), unit))

    def digest(self, unit: int, on_error: str = "raise") -> str:
        return str(self._get(self.handle.digest.remote(unit, on_error), unit))

    def rows(self, unit: int, indices: Any, on_error: str = "raise") -> pa.Table:
        table: pa.Table = self._get(self.handle.rows.remote(unit, [int(i) for i in indices],
                                                            on_error), unit)
        return table

    def _get(self, ref: Any, unit: int) -> Any:
        started = time.monotonic()
        while True:
            try:
                return ray.get(ref, timeout=WAIT_WARN_S)
            except GetTimeoutError:
                log.warning("waiting %.0f s for %s to go through the Ray Data pipeline: are its "
                            "tasks waiting for CPUs the trainers hold? (docs/ray-data.md)",
                            time.monotonic() - started, self.labels[unit])

    def read_ahead(self, units: list[int]) -> None:
        self.handle.read_ahead.remote(list(units))  # no wait: a hint


class LocalFeeder(UnitFeeder):
    """A `UnitFeeder` in this process that also says what the data is (as `FeederClient`)."""

    units: int
    fingerprint: str


def local_feeder(ds: Any, *, units: int | None = None) -> LocalFeeder:
    return _feeder_over(pipeline_units(ds, units))


def _feeder_over(found: PipelineUnits) -> LocalFeeder:
    feeder = LocalFeeder(unit_reader(found), found.labels, keep=KEEP_UNITS,
                         read_ahead=READ_AHEAD)
    feeder.units, feeder.fingerprint = found.count, found.fingerprint
    return feeder
