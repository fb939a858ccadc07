"""Preparing on a Ray cluster with Ray Data: shards written on the cluster, never via the driver.

Contract:
- `RayShardWriter(layout)` writes a dataset's shards from the cluster, in two Ray Data
  stages; only metadata (counts, file records, `ShardInfo`s) passes through the driver.
  1. `tokenize(units, job)`: an actor pool (one actor per CPU of the cluster, each building
     the tokenizer once) tokenizes one unit at a time and writes its token arrays (all
     splits, in `SPLITS` order, little-endian, the dataset's dtype) to the temporary object
     `OUT/.prepare-tmp/unit-NNNNNN.bin`; the driver gets `UnitResult`s in unit order with
     empty `tokens` and the unit's `token_counts` (a result carrying tokens is an error).
  2. `finish(splits, where=)`: the driver cuts each split's stream with
     `split_writer.shard_spans` (the serial writer's rule) on the counts' prefix sums, so
     shard k of a split is a list of `(unit, first token, end token)` pieces
     (`plan_shards`, pure); Ray Data tasks read the pieces, build the shard with
     `split_writer.write_shard` (the serial writer's encoder, atomic write, checksums) and
     return its `ShardInfo`. The temporary objects hold the raw token stream again on storage
     until `close()`. A split with no complete
     sequence is the serial path's `ValueError`, raised before any shard is written.
  `close()` removes the temporary directory (call it on failure too); a leftover one from a
  crashed run is removed when a writer starts. The output is byte-identical to the serial
  run: which node tokenized or wrote what changes nothing.
- Memory is bounded per task: one unit (stage 1) or one shard (stage 2); the driver holds a
  few numbers per unit. `preserve_order` makes Ray Data hand stage-1 results back in unit
  order (the file records of the manifest follow it); its streaming executor's backpressure
  bounds how many are in flight.
- `run_units_on_ray(units, job)` yields whole `UnitResult`s in unit order, as the serial
  path does: used for the tokenizer-training pass, whose documents the driver needs.
- It connects to the cluster in `RAY_ADDRESS` (or uses the Ray this process already started;
  else starts a local one). Inputs and the output must be reachable from every node
  (`s3://`, or a path shared by all nodes).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from data_state import storage
from data_state.manifest import ShardInfo, SplitInfo
from data_state.parallel import Job, UnitResult, init_worker, process_unit
from data_state.sources import SPLITS, Unit
from data_state.split_writer import require_a_sequence, shard_spans, split_info, write_shard

TEMP_DIR = ".prepare-tmp"


@dataclass(frozen=True)
class ShardLayout:
    """Where and how shards are written; small and plain, it travels to every task."""

    uri: str  # the dataset root: an absolute local path or s3://bucket/prefix
    storage_options: Mapping[str, Any] | None
    dtype: str
    seq_len: int
    rows_per_group: int
    per_shard: int

    def open(self) -> tuple[storage.Storage, str]:
        return storage.resolve(self.uri, self.storage_options)


def _unit_object(root: str, index: int) -> str:
    return storage.join(root, TEMP_DIR, f"unit-{index:06d}.bin")


class _TokenizeUnits:
    """Ray Data actor: the whole `UnitResult` goes back (tokenizer-training pass)."""

    def __init__(self, units: Sequence[Unit], job: Job) -> None:
        self._units = units
        init_worker(job, False)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        blobs = [process_unit(self._units[int(i)]).to_bytes() for i in batch["unit"]]
        return {"unit": batch["unit"], "result": np.array(blobs, dtype=object)}


class _TokenizeToTemp:
    """Ray Data actor of stage 1: tokens go to a temporary object, their counts back."""

    def __init__(self, units: Sequence[Unit], job: Job, layout: ShardLayout) -> None:
        self._units = units
        self._io, self._root = layout.open()
        self._dtype = np.dtype(layout.dtype).newbyteorder("<")
        init_worker(job, False)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        blobs = []
        for i in batch["unit"]:
            result = process_unit(self._units[int(i)])
            arrays = [np.asarray(result.tokens[s], dtype=self._dtype) for s in SPLITS]
            if any(a.size for a in arrays):
                blob = b"".join(a.tobytes() for a in arrays)
                self._io.write_file(_unit_object(self._root, result.index), blob,
                                    durable=False)  # temporary: read back within this run
            result.token_counts = {s: int(a.size) for s, a in zip(SPLITS, arrays, strict=True)}
            result.tokens = {}
            blobs.append(result.to_bytes())
        return {"unit": batch["unit"], "result": np.array(blobs, dtype=object)}


def _write_shards(batch: dict[str, np.ndarray], layout: ShardLayout) -> dict[str, Any]:
    """Ray Data task of stage 2: build each planned shard from its pieces and write it."""
    io, root = layout.open()
    dtype = np.dtype(layout.dtype)
    stored = dtype.newbyteorder("<")
    infos = []
    for text in batch["plan"]:
        plan = json.loads(text)
        parts = [np.frombuffer(io.read_range(_unit_object(root, unit), first * dtype.itemsize,
                                             end * dtype.itemsize), dtype=stored)
                 for unit, first, end in plan["pieces"]]
        tokens = np.concatenate(parts).astype(dtype)
        info = write_shard(io, root, plan["split"], plan["index"], tokens,
                           seq_len=layout.seq_len, rows_per_group=layout.rows_per_group)
        infos.append(json.dumps({"split": plan["split"], "index": plan["index"],
                                 **dataclasses.asdict(info)}))
    return {"info": np.array(infos, dtype=object)}


def _connect() -> int:
    """Join (or start) Ray; the cluster's CPU count."""
    import ray

    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        ray.init(address=address or None, log_to_driver=False)
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    return int(ray.cluster_resources().get("CPU", 1))


def _map_units(units: Sequence[Unit], actor: type, args: tuple[Any, ...]
               ) -> Iterator[UnitResult]:
    import ray

    cpus = _connect()
    if not units:
        return
    dataset = ray.data.from_items([{"unit": i} for i in range(len(units))]).map_batches(
        actor,
        fn_constructor_args=args,
        batch_size=1,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=max(1, min(len(units), cpus))),
        num_cpus=1,
    )
    expected = 0
    for row in dataset.iter_rows():
        result = UnitResult.from_bytes(row["result"])
        if result.index != expected:  # preserve_order is what byte-identical output rests on
            raise RuntimeError(f"Ray Data returned unit {result.index}, expected {expected}")
        expected += 1
        yield result


def run_units_on_ray(units: Sequence[Unit], job: Job) -> Iterator[UnitResult]:
    return _map_units(units, _TokenizeUnits, (list(units), job))


def plan_shards(counts: Sequence[Mapping[str, int]], split: str, *, seq_len: int,
                per_shard: int) -> Iterator[dict[str, Any]]:
    """Each shard of `split` as `{"split", "index", "pieces"}`, pieces `[unit, first token,
    end token]` of the unit objects, given every unit's token counts in unit order."""
    sizes = [c[split] for c in counts]
    before = SPLITS[: SPLITS.index(split)]  # earlier splits come first in a unit object
    offsets = [sum(c[s] for s in before) for c in counts]
    ends = list(itertools.accumulate(sizes))  # where each unit's part of the stream ends
    spans = shard_spans(ends[-1] if ends else 0, seq_len=seq_len, per_shard=per_shard)
    for index, (start, stop) in enumerate(spans):
        pieces = []
        unit = bisect.bisect_right(ends, start)  # the first unit ending after `start`
        while start < stop:
            unit_start = ends[unit] - sizes[unit]
            take = min(stop, ends[unit])
            if take > start:
                pieces.append([unit, offsets[unit] + start - unit_start,
                               offsets[unit] + take - unit_start])
            start, unit = take, unit + 1
        yield {"split": split, "index": index, "pieces": pieces}


class RayShardWriter:
    """The two stages of the module contract, and the temporary directory's lifetime."""

    def __init__(self, layout: ShardLayout) -> None:
        self.layout = layout
        self._io, self._root = layout.open()
        self._counts: list[dict[str, int]] = []  # per unit, in unit order
        self.close()  # a crashed run's leftovers

    def tokenize(self, units: Sequence[Unit], job: Job) -> Iterator[UnitResult]:
        for result in _map_units(units, _TokenizeToTemp, (list(units), job, self.layout)):
            if result.tokens:
                raise RuntimeError(f"unit {result.index}: tokens came back to the driver")
            self._counts.append(result.token_counts)
            yield result

    def finish(self, splits: Sequence[str], *, where: str) -> dict[str, SplitInfo]:
        import ray

        layout = self.layout
        totals = {s: sum(c[s] for c in self._counts) for s in splits}
        for split in splits:
            require_a_sequence(split, totals[split], seq_len=layout.seq_len, where=where)
        plans = [plan for split in splits for plan in plan_shards(
            self._counts, split, seq_len=layout.seq_len, per_shard=layout.per_shard)]
        dataset = ray.data.from_items([{"plan": json.dumps(p)} for p in plans]).map_batches(
            functools.partial(_write_shards, layout=layout),
            batch_size=1,
            batch_format="numpy",
            compute=ray.data.TaskPoolStrategy(size=max(1, min(len(plans), _connect()))),
            num_cpus=1,
        )
        written = {}
        for row in dataset.iter_rows():
            info = json.loads(row["info"])
            key = (info.pop("split"), info.pop("index"))
            written[key] = ShardInfo(**info)
        return {
            split: split_info(split, [written[(split, p["index"])] for p in plans
                                      if p["split"] == split],
                              totals[split], seq_len=layout.seq_len, where=where)
            for split in splits
        }

    def close(self) -> None:
        self._io.remove_tree(storage.join(self._root, TEMP_DIR))
