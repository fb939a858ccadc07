"""What the full replica checksums cost a snapshot (part (e) of ``benchmarks.snapshot_stall.run``).

At world size > 1 every rank's capture thread takes the crc32 of every replicated model and
optimizer tensor it holds, whole (``elastic.write.replica_sums``), after copying the part it
writes and before ``wait_capture`` returns; the coordinator compares them before it commits.
One process stands for rank 0 of a DDP group of 2 (no process group: the collective and the
commit are not what is timed; its receipts wait for a rank 1 that never reports, as each
snapshot's persist still runs in the background), with two snapshotters over the same model:

- A: checksums off (``Capturer(replica_checksums=False)``): the capture as before;
- B: checksums on (what a rank of a group does).

Each round runs one snapshot of each, A and B in alternating order (ABBA), and measures:

- the pipelined stall (time in ``begin_capture`` + in the ``wait_capture`` before the next
  optimizer step: what the copy and the checksums did not hide behind forward/backward);
- the blocking capture (``begin_capture`` then ``wait_capture`` at once: the copy and the
  checksums themselves, nothing to hide them behind);

and reports medians and per-round B/A ratios (median, min, max), plus the checksums alone.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Protocol

import torch

from benchmarks.common import alternating, ratios, spread, timed
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.state.registry import StateRegistry
from elastic.write.capture import Capturer
from elastic.write.replica_sums import replica_checksums

SIDES = ("A", "B")  # A: checksums off, B: on


class Training(Protocol):
    """What the stall benchmark's ``Run`` offers (the GPT, its optimizer and registry)."""

    @property
    def registry(self) -> StateRegistry: ...
    @property
    def optim(self) -> torch.optim.Optimizer: ...

    def forward_backward(self) -> None: ...
    def step(self) -> None: ...


def _snapshotter(run: Training, root: str, checksums: bool) -> Snapshotter:
    """Rank 0 of 2 with its own store coordinator; the capturer decides the checksums."""
    settings = SnapshotSettings(snapshot_every=1, on_busy="wait", durable=False, keep_last=1)
    snap = Snapshotter(root, run.registry, rank=0, world_size=2, settings=settings)
    snap.capturer.close()
    snap.capturer = Capturer(run.registry, 0, 2, split_min_bytes=settings.split_min_bytes,
                             replica_checksums=checksums)
    return snap


def _pipelined(run: Training, snap: Snapshotter, step: int) -> float:
    """One snapshot, pipelined as the training loop does it; returns its stall."""
    run.step()
    t0 = time.perf_counter()
    snap.begin_capture(step)
    began = time.perf_counter() - t0
    run.forward_backward()
    waited = timed(snap.wait_capture)
    run.optim.step()
    snap.persister.wait()  # the next snapshot starts with nothing in flight
    return began + waited


def _blocking(snap: Snapshotter, step: int) -> float:
    def capture() -> None:
        snap.begin_capture(step)
        snap.wait_capture()

    took = timed(capture)
    snap.persister.wait()
    return took


def replica_checksum_cost(run: Training, root: str, rounds: int) -> dict[str, Any]:
    """Part (e): A/B alternated in one run (module docstring)."""
    # Rank 1 never reports, so the coordinator aborts what waits for it: expected, not news.
    logging.getLogger("baton.elastic").setLevel(logging.ERROR)
    snaps = {side: _snapshotter(run, f"{root}/{side}", side == "B") for side in SIDES}
    step = 0
    for side in SIDES:  # the first capture allocates and touches the image: not typical
        step += 1
        _pipelined(run, snaps[side], step)
    stall: dict[str, list[float]] = {side: [] for side in SIDES}
    blocking: dict[str, list[float]] = {side: [] for side in SIDES}
    for r in range(rounds):
        for side in alternating(SIDES, r):
            step += 1
            stall[side].append(_pipelined(run, snaps[side], step))
            step += 1
            blocking[side].append(_blocking(snaps[side], step))
    for snap in snaps.values():
        snap.persister.close()
        snap.capturer.close()
    models = run.registry.flatten(run.registry.model_keys()).tensors
    state_bytes = sum(t.numel() * t.element_size() for t in models.values())
    alone = [timed(lambda: replica_checksums(models)) for _ in range(rounds)]
    steps = [timed(run.step) for _ in range(3)]
    return {
        "rounds": rounds, "replicated_bytes": state_bytes, "tensors": len(models),
        "step_s": statistics.median(steps),
        "checksums_alone_s": spread(alone),
        "checksums_gb_per_s": state_bytes / statistics.median(alone) / 1e9,
        "pipelined_stall_s": {side: spread(stall[side]) for side in SIDES},
        "pipelined_stall_b_over_a": ratios(stall["B"], stall["A"]),
        "pipelined_stall_b_minus_a_s": spread([b - a for a, b in zip(stall["A"], stall["B"],
                                                                     strict=True)]),
        "blocking_capture_s": {side: spread(blocking[side]) for side in SIDES},
        "blocking_capture_b_over_a": ratios(blocking["B"], blocking["A"]),
    }
