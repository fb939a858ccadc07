"""Failures are visible (issue 13, point 5): a full disk during a run is warned about with its
reason, and a run whose final step could not be committed is refused as finished.

The worker loop runs in-process (no Ray) with a real coordinator over a real run directory;
the disk fills up after step 8 (every shard write fails with ENOSPC), then frees up again.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
from snapshot_compare import assert_same_state, final_state

from elastic.coord.local_coordinator import LocalCoordinator
from elastic.format.records import DEFAULT_BLOCK_BYTES
from elastic.store.snapshot_store import SnapshotStore
from trainer.config import load_recipe
from trainer.run.commit_watch import STALE_INTERVALS, CommitWatch, final_commit_error
from trainer.train.loop import WorkerEnv, run_worker

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20


def _config(run: Path, dataset: str):
    return load_recipe(ROOT / "recipes" / "tiny.toml", [
        f'snapshots.run_uri="{run}"', f'data.uri="{dataset}"', f"steps={STEPS}",
        "eval.every=0", "snapshots.snapshot_every=4",
    ])


def test_commit_watch_warns_once_per_stale_episode() -> None:
    watch = CommitWatch(snapshot_every=10)
    failing = {"latest": 20, "failures": [
        {"step": 40, "rank": 1, "where": "node-b", "reason": "ENOSPC: No space left on device"}]}
    assert watch.check(20 + STALE_INTERVALS * 10 - 1, failing) is None
    warning = watch.check(20 + STALE_INTERVALS * 10, failing)
    assert warning is not None and "ENOSPC" in warning and "step 20" in warning
    assert "rank 1 on node-b" in warning
    assert watch.check(60, failing) is None  # said once
    recovered = {**failing, "latest": 60}
    assert watch.check(70, recovered) is None
    assert watch.check(90, recovered) is not None  # a new episode is warned again
    fenced = CommitWatch(snapshot_every=1).check(5, {"latest": None, "fenced": "lease lost"})
    assert fenced is not None and "fenced: lease lost" in fenced and "none yet" in fenced


def test_a_warning_without_a_cause_is_followed_by_one_with_it() -> None:
    """Persists run behind training: the stale point can come before the failing write has
    reported. The watch says so, then once more when the cause is known, then nothing."""
    watch = CommitWatch(snapshot_every=4)
    quiet = {"latest": 8, "failures": [
        {"step": 4, "rank": 0, "reason": "an old failure, before the newest commit"}]}
    first = watch.check(20, quiet)
    assert first is not None and "no worker reported an error since the newest commit" in first
    assert "before it: rank 0 at step 4" in first  # the old failure, named as such
    assert watch.check(21, quiet) is None
    watch = CommitWatch(snapshot_every=4)
    unknown = {"latest": 8, "failures": []}
    first = watch.check(20, unknown)
    assert first is not None and "no worker reported an error" in first
    assert watch.check(21, unknown) is None
    known = {"latest": 8, "failures": [
        {"step": 16, "rank": 0, "reason": "ENOSPC: No space left on device"}]}
    second = watch.check(21, known)
    assert second is not None and "ENOSPC" in second and "step 16" in second
    assert watch.check(22, known) is None


def test_disk_full_run_is_not_reported_finished(tmp_path: Path, tiny_dataset: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    cfg = _config(run, tiny_dataset)
    coord = LocalCoordinator(SnapshotStore(str(run)), keep_last=2,
                             block_bytes=DEFAULT_BLOCK_BYTES)
    watch = CommitWatch(cfg.snapshots.snapshot_every)
    warnings: list[str] = []
    real_write = SnapshotStore.write_file

    def disk_fills_after_step_8(self, path, data, **kwargs):
        if path.endswith(".safetensors") and "/000000008/" not in path and any(
                f"/0000000{s:02d}/" in path for s in range(9, STEPS + 1)):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_write(self, path, data, **kwargs)

    def on_metrics(record: dict) -> None:
        warning = watch.check(record["step"], coord.health())
        if warning:
            warnings.append(warning)

    monkeypatch.setattr(SnapshotStore, "write_file", disk_fills_after_step_8)
    result = run_worker(cfg, WorkerEnv(coordinator=coord, on_metrics=on_metrics))
    assert result.step == STEPS  # training itself went on
    health = coord.health()
    # The driver's next poll: the persists are done, so a warning given before the failing
    # write reported (a loaded machine) is followed by one that names it.
    last = watch.check(STEPS, health)
    warnings += [last] if last else []
    latest = health["latest"]  # a due snapshot is skipped while the previous one persists
    assert latest is not None and latest <= 8
    error = final_commit_error(health, STEPS)
    assert error is not None and "ENOSPC" in error and f"step {latest}" in error
    assert len([w for w in warnings if "ENOSPC" in w]) == 1, warnings

    # Space is freed; the same command continues from the newest commit and ends where an
    # uninterrupted run ends (P1-P6: nothing committed was lost).
    monkeypatch.undo()
    coord = LocalCoordinator(SnapshotStore(str(run)), keep_last=2,
                             block_bytes=DEFAULT_BLOCK_BYTES)
    assert run_worker(cfg, WorkerEnv(coordinator=coord)).start_step == latest
    assert final_commit_error(coord.health(), STEPS) is None
    reference = tmp_path / "reference"
    run_worker(_config(reference, tiny_dataset), WorkerEnv())
    assert_same_state(final_state(reference, tmp_path, STEPS), final_state(run, tmp_path, STEPS))


def test_a_failure_before_the_newest_commit_is_not_named_as_the_cause() -> None:
    """A disk that filled at step 3 and was freed before step 4 committed is not why step 6
    did not commit: the messages name only failures after the newest commit."""
    old = {"step": 3, "rank": 0, "where": "vm", "reason": "OSError: [Errno 28] ENOSPC"}
    health: dict[str, Any] = {"latest": 4, "failures": [old], "fenced": None}
    error = final_commit_error(health, 6)
    assert error is not None and "no worker reported an error since the newest commit" in error
    assert "before it: rank 0 on vm at step 3" in error
    warning = CommitWatch(1).check(4 + STALE_INTERVALS, health)
    assert warning is not None and "before it" in warning
    new = {**old, "step": 6, "reason": "PermissionError: EACCES"}
    health["failures"].append(new)
    error = final_commit_error(health, 6)
    assert error is not None and "EACCES" in error and "step 6" in error
