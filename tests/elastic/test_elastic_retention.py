"""Retention never retires the snapshot the newest snapshots were trained from (issue 36,
point 8).

A worker group restores snapshot 4 and commits 6, 8, 10 with `keep_last = 2`. Before, 4 was
retired, so when the code that wrote 8 and 10 turned out to have written snapshots no code
restores (a cursor past its last epoch), nothing was left to go back to. Now 4 — the newest
snapshot of an older generation, the one this group restored from — stays until a newer
generation restores a newer snapshot (then that one stays instead); a refusal names it, and
a rewind to it trains on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.state.registry import SnapshotMismatchError
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import TrainState, build, train_step
from trainer.cli import main as baton_main

SETTINGS = SnapshotSettings(snapshot_every=2, keep_last=2)
BATCH = 6  # elastic.testing.train_step's samples per step


def _session(run: str, seed: int, steps: Iterable[int], restores: int | None) -> TrainState:
    """A new worker group (its own generation): restore, train `steps`, commit, close."""
    ts = build(seed=seed)
    snap = Snapshotter(run, ts.registry, settings=SETTINGS)
    assert snap.restore() == (restores or 0)
    for step in steps:
        train_step(ts, step)
        snap.after_step(step)
        snap.persister.wait()
    snap.close()
    return ts


class _ReadsUpTo:
    """A rule of code that cannot read what the newer snapshots hold (as code refuses a
    cursor past its last epoch): at most `steps` steps of data."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def scalars(self, skeletons: Mapping[str, Any]) -> list[str]:
        return []

    def check(self, skeletons: Mapping[str, Any], scalars: Mapping[str, float]) -> None:
        samples = skeletons["data"]["samples"]
        if samples > self.steps * BATCH:
            raise ValueError(f"state data.samples is {samples}: this code reads at most "
                             f"{self.steps * BATCH}")

    def loaded(self) -> None:
        return None


def test_retention_keeps_the_snapshot_the_newer_ones_were_trained_from(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    store = SnapshotStore(run)
    _session(run, 0, range(1, 5), restores=None)  # commits 2 and 4
    _session(run, 1, range(5, 11), restores=4)  # another generation: 6, 8 and 10
    assert store.committed_steps() == [4, 8, 10]  # keep_last 2, and the one it restored

    ts = build(seed=2)
    ts.registry.add_rule(_ReadsUpTo(4))
    with pytest.raises(SnapshotMismatchError) as refused:
        Snapshotter(run, ts.registry).restore()
    message = str(refused.value)
    assert "\n" not in message and "state data.samples is 60" in message, message
    assert f"rewind {run} --to 4 sets [8, 10] aside" in message, message
    assert store.committed_steps() == [4, 8, 10]  # nothing moved

    assert baton_main(["snapshots", "rewind", run, "--to", "4"]) == 0
    _session(run, 3, range(5, 9), restores=4)  # trains on from 4: 6 and 8
    assert store.committed_steps() == [4, 6, 8]
    _session(run, 4, range(9, 13), restores=8)  # a newer group restored 8: 4 goes
    assert store.committed_steps() == [8, 10, 12]  # and 8, what it restored, stays
