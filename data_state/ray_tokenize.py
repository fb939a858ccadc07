"""Tokenizing work units on a Ray cluster with Ray Data (the one Ray module of `data_state`).

Contract: `run_units_on_ray(units, job)` yields the same `UnitResult`s as the serial path,
in unit order. It connects to the cluster in `RAY_ADDRESS` (or uses the Ray this process
already started; else starts a local one), builds a Ray Data dataset of unit numbers and
maps it with an actor pool (one actor per CPU of the cluster, each building the tokenizer
once). `preserve_order` makes Ray Data hand the results back in unit order, and its
streaming executor's backpressure bounds how many are in flight, so memory stays bounded.

Inputs must be readable from every node (`s3://`, or a path shared by all nodes). The
driver writes the shards as results arrive, in order (local or `s3://`): the stream cut
into sequences decides which shard holds which tokens, so shard contents do not depend on
which node tokenized what.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from data_state.parallel import Job, UnitResult, init_worker, process_unit
from data_state.sources import Unit


class _TokenizeUnits:
    """A Ray Data actor: the units and the job arrive once, the rows name unit numbers."""

    def __init__(self, units: Sequence[Unit], job: Job) -> None:
        self._units = units
        init_worker(job, False)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        blobs = [process_unit(self._units[int(i)]).to_bytes() for i in batch["unit"]]
        return {"unit": batch["unit"], "result": np.array(blobs, dtype=object)}


def run_units_on_ray(units: Sequence[Unit], job: Job) -> Iterator[UnitResult]:
    import ray

    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        ray.init(address=address or None, log_to_driver=False)
    if not units:
        return
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    actors = max(1, min(len(units), int(ray.cluster_resources().get("CPU", 1))))
    dataset = ray.data.from_items([{"unit": i} for i in range(len(units))]).map_batches(
        _TokenizeUnits,
        fn_constructor_args=(list(units), job),
        batch_size=1,
        batch_format="numpy",
        concurrency=actors,
        num_cpus=1,
    )
    expected = 0
    for row in dataset.iter_rows():
        result = UnitResult.from_bytes(row["result"])
        if result.index != expected:  # preserve_order is what byte-identical output rests on
            raise RuntimeError(f"Ray Data returned unit {result.index}, expected {expected}")
        expected += 1
        yield result
