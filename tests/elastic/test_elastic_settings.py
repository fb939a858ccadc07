"""`SnapshotSettings` (elastic/settings.py): a `Snapshotter`'s tunables as one frozen object,
checked when made; and the restore verdicts' order (elastic/read/verdict.py), which ranks
agree on by taking the maximum."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

import elastic
from elastic.read.group_read import _failure_code
from elastic.read.newest import Attempt, attempt
from elastic.read.verdict import Verdict
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.state.registry import SnapshotMismatchError
from elastic.testing import build


@pytest.mark.parametrize(("change", "message"), [
    ({"layout": "zero"}, "layout must be one of"),
    ({"snapshot_every": 0}, "snapshot_every must be >= 1, got 0"),
    ({"on_busy": "block"}, "on_busy must be 'skip' or 'wait', got 'block'"),
])
def test_bad_settings_are_refused_with_one_line(change: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        SnapshotSettings(**change)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_settings_are_frozen_and_a_snapshotter_uses_them(tmp_path) -> None:
    settings = SnapshotSettings(snapshot_every=3, on_busy="wait", ram=False,
                                storage_timeout_s=5.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.snapshot_every = 4  # type: ignore[misc]
    assert settings.storage_deadlines() == {"timeout_s": 5.0}
    assert SnapshotSettings().storage_deadlines() == {}
    assert elastic.SnapshotSettings is SnapshotSettings
    snap = Snapshotter(str(tmp_path / "run"), build(seed=1).registry, settings=settings)
    assert snap.settings is settings and snap.ram_tier is None
    assert [s for s in range(10) if snap.due(s)] == [3, 6, 9]
    with pytest.raises(ValueError, match="rank 1 is outside world_size 1"):
        Snapshotter(str(tmp_path / "run"), build(seed=1).registry, 1, 1, settings)
    snap.close()


def test_verdicts_are_ordered_by_precedence() -> None:
    # All-reduced with MAX: a rank short of memory outranks doubt, doubt a corrupt
    # snapshot, corruption a misfit, and any of them success.
    assert [int(v) for v in Verdict] == list(range(len(Verdict)))
    assert (Verdict.OK < Verdict.MISFIT < Verdict.CORRUPT < Verdict.UNREACHABLE
            < Verdict.NO_MEMORY < Verdict.OTHER)
    assert attempt(lambda: 1) == Attempt(1, Verdict.OK, "")
    assert attempt(_raise(FileNotFoundError("x"))).verdict is Verdict.CORRUPT
    assert attempt(_raise(ConnectionResetError("x"))).verdict is Verdict.UNREACHABLE
    with pytest.raises(SnapshotMismatchError):
        attempt(_raise(SnapshotMismatchError("another model")))
    assert _failure_code(KeyError("x")) is Verdict.OTHER
    assert _failure_code(ValueError("x")) is Verdict.CORRUPT


def _raise(err: Exception) -> Callable[[], None]:
    def read() -> None:
        raise err
    return read
