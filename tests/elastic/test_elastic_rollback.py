"""A code rollback never costs a run its newest snapshots; going back is explicit (issue 29).

Code v2 trains a run to step 8; code v1, whose state no longer fits snapshots 6 and 8 (a
component's state changed type), starts on it: the restore refuses in one line naming
snapshot 8, what does not fit and snapshot 4 (the newest that fits), and nothing moves; v2
then restores 8, bitwise. With an explicit ``baton snapshots rewind RUN --to 4`` the newer
steps are set aside (reported, with the command that brings them back), v1 restores 4, and
``baton snapshots restore-quarantined`` brings them back verifying, so v2 restores 8 again;
unless the run trained on from 4 meanwhile, which would mix two histories: then they stay.
Also: a run whose generation passes 999,999 still commits (writer and reader agree on the
shard names), and one that would pass the last nameable generation is one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.coord.generation import GENERATION_NAME, read_generation
from elastic.format.records import MAX_GENERATION, step_dirname
from elastic.lease import held_lease
from elastic.lease.run_lease import LeaseLostError, RunLease
from elastic.set_aside import restore_quarantined
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.state.registry import SnapshotMismatchError
from elastic.storage import JSONBoundsError
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import TrainState, build, full_state, json_state, train_step
from trainer.cli import main


class Mode:
    """A component whose state changed type between code versions: v1 keeps an int, v2 a
    string (and, fresh, a null: it loads v1's int and converts it)."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.value: Any = 0 if version == 1 else None

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        value = state["mode"]
        self.value = f"v2-{value}" if self.version == 2 and isinstance(value, int) else value


def _code(version: int, seed: int) -> TrainState:
    ts = build(seed=seed)
    ts.registry.register("mode", Mode(version))
    return ts


def _snapshotter(run: Path, ts: TrainState) -> Snapshotter:
    return Snapshotter(str(run), ts.registry,
                       settings=SnapshotSettings(snapshot_every=2, keep_last=5, durable=False,
                                                 block_bytes=256, split_min_bytes=64))


def _train(run: Path, ts: TrainState, first: int, last: int) -> None:
    snap = _snapshotter(run, ts)
    assert snap.restore() == first - 1
    for step in range(first, last + 1):
        train_step(ts, step)
        snap.after_step(step)
        snap.persister.wait()
    snap.close()


@pytest.fixture
def rolled_back(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor], Any]:
    """v1 trains to 4, v2 (which converts v1's state) from 4 to 8: committed 2, 4, 6, 8."""
    run = tmp_path / "run"
    _train(run, _code(1, seed=0), 1, 4)
    v2 = _code(2, seed=1)
    _train(run, v2, 5, 8)
    assert SnapshotStore(str(run)).committed_steps() == [2, 4, 6, 8]
    return run, full_state(v2), json_state(v2)


def _restores_8_bitwise(run: Path, final: dict[str, torch.Tensor], js: Any) -> None:
    v2 = _code(2, seed=7)
    snap = _snapshotter(run, v2)
    assert snap.restore() == 8 and snap.restore_errors == []
    snap.close()
    for key, value in final.items():
        assert torch.equal(full_state(v2)[key], value), key
    assert json_state(v2) == js and v2.registry._components["mode"].value == "v2-0"


def _verifies(capsys: pytest.CaptureFixture[str], run: Path, steps: list[int]) -> None:
    for step in steps:
        assert main(["snapshots", "verify", str(run), str(step)]) == 0, capsys.readouterr()
    capsys.readouterr()


def test_old_code_refuses_in_one_line_and_moves_nothing(
        rolled_back: tuple[Path, dict[str, torch.Tensor], Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    run, final, js = rolled_back
    store = SnapshotStore(str(run))
    files = {s: sorted(store.step_files(s)) for s in store.committed_steps()}
    v1 = _code(1, seed=3)
    snap = _snapshotter(run, v1)
    with pytest.raises(SnapshotMismatchError) as info:
        snap.restore()
    snap.close()
    text = str(info.value)
    assert "\n" not in text, text
    assert f"snapshot 8 of {run} does not fit" in text and "state mode.mode" in text, text
    assert f"baton snapshots rewind {run} --to 4 sets [6, 8] aside" in text, text
    assert {s: sorted(store.step_files(s)) for s in store.committed_steps()} == files
    assert store.quarantined() == [] and not (run / "quarantine").exists()
    _restores_8_bitwise(run, final, js)
    _verifies(capsys, run, [2, 4, 6, 8])


def test_an_explicit_rewind_sets_aside_and_restore_quarantined_brings_back(
        rolled_back: tuple[Path, dict[str, torch.Tensor], Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    run, final, js = rolled_back
    assert main(["snapshots", "rewind", str(run), "--to", "4"]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "set aside 6" in said and "8 (in" in said, said
    assert f"baton snapshots restore-quarantined {run}" in said, said
    store = SnapshotStore(str(run))
    assert store.committed_steps() == [2, 4]
    with held_lease(store) as lease:  # a lease taken over meanwhile: nothing more moves
        lease.lost = "the run lease was taken over by another driver"
        with pytest.raises(LeaseLostError):
            restore_quarantined(store, lease=lease)
    assert store.committed_steps() == [2, 4]
    assert [(r["step"], r["rewound_to"]) for r in store.quarantined()] == [(6, 4), (8, 4)]
    v1 = _code(1, seed=3)  # the old code now restores 4, and only reads
    snap = _snapshotter(run, v1)
    assert snap.restore() == 4
    snap.close()
    assert main(["snapshots", "restore-quarantined", str(run)]) == 0
    said = capsys.readouterr().out
    assert "snapshot 6: verified" in said and "snapshot 8: verified" in said, said
    assert store.committed_steps() == [2, 4, 6, 8] and store.quarantined() == []
    _verifies(capsys, run, [2, 4, 6, 8])
    _restores_8_bitwise(run, final, js)


def test_set_aside_snapshots_stay_once_the_run_trained_on(
        rolled_back: tuple[Path, dict[str, torch.Tensor], Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    """After a rewind the old code trains 5..6 and commits a new 6: bringing the set-aside
    6 and 8 back would mix two histories, so both stay (and still verify where they are);
    a live driver's lease refuses the command before it looks."""
    run, _, _ = rolled_back
    assert main(["snapshots", "rewind", str(run), "--to", "4"]) == 0
    capsys.readouterr()
    _train(run, _code(1, seed=3), 5, 6)
    store = SnapshotStore(str(run))
    new_6 = store.load_manifest(6).files
    lease = RunLease(store)
    lease.acquire()
    try:
        assert main(["snapshots", "restore-quarantined", str(run)]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "lease" in err, err
    finally:
        lease.release()
    assert main(["snapshots", "restore-quarantined", str(run)]) == 1
    said = " ".join(capsys.readouterr().out.split())
    assert "snapshot 6: stays quarantined: step 6 is committed again" in said, said
    assert "snapshot 8: stays quarantined: snapshot 6 was committed after" in said, said
    assert store.committed_steps() == [2, 4, 6] and store.load_manifest(6).files == new_6
    assert [r["step"] for r in store.quarantined()] == [6, 8]
    _verifies(capsys, run, [2, 4, 6])
    for row in store.quarantined():
        from elastic.catalog import verify

        verify(store.viewing(row["step"], row["where"]), row["step"])


def test_a_corrupt_quarantined_snapshot_stays(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    _train(run, _code(1, seed=0), 1, 4)
    assert main(["snapshots", "rewind", str(run), "--to", "2"]) == 0
    store = SnapshotStore(str(run))
    where = Path(store.quarantined()[0]["where"])
    shard = next(where.glob("shard-*"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["snapshots", "restore-quarantined", str(run), "4"]) == 1
    said = capsys.readouterr().out
    assert "snapshot 4: stays quarantined: it does not verify" in said, said
    assert store.committed_steps() == [2] and [r["step"] for r in store.quarantined()] == [4]


# ---------------------------------------------------------------- generations past 999,999


def test_a_generation_past_999999_still_commits(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / GENERATION_NAME).write_text(json.dumps({"generation": 999_999, "time": 0}))
    ts = _code(1, seed=0)
    _train(run, ts, 1, 4)
    store = SnapshotStore(str(run))
    assert store.committed_steps() == [2, 4] and read_generation(store) == 1_000_000
    assert store.load_manifest(4).files == ["shard-00000-of-00001-g1000000.safetensors"]
    _verifies(capsys, run, [2, 4])
    again = _code(1, seed=5)
    snap = _snapshotter(run, again)
    assert snap.restore() == 4
    snap.close()
    for key, value in full_state(ts).items():
        assert torch.equal(full_state(again)[key], value), key


def test_the_last_nameable_generation_is_one_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(run, _code(1, seed=0), 1, 2)
    (run / GENERATION_NAME).write_text(json.dumps({"generation": MAX_GENERATION}))
    snap = _snapshotter(run, _code(1, seed=1))
    with pytest.raises(ValueError) as info:
        snap.restore()
    text = str(info.value)
    assert "\n" not in text and "new run directory" in text and "--from" in text, text
    assert read_generation(SnapshotStore(str(run))) == MAX_GENERATION  # nothing written
    assert (run / "snapshots" / step_dirname(2) / "manifest.json").exists()


# ---------------------------------------------------------------- the same on s3://


def test_rewind_and_restore_quarantined_on_s3(s3_bucket: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The refusal, the rewind and the way back through a real S3 API: the set-aside
    snapshots are copied back manifest last and verify; huge or deeply nested run files
    there are read within bounds (one line, no traceback)."""
    run = f"s3://{s3_bucket}/runs/r"

    def train(ts: TrainState, first: int, last: int) -> None:
        snap = Snapshotter(run, ts.registry,
                           settings=SnapshotSettings(snapshot_every=2, keep_last=5, ram=False,
                                                     block_bytes=256, split_min_bytes=64))
        assert snap.restore() == first - 1
        for step in range(first, last + 1):
            train_step(ts, step)
            snap.after_step(step)
            snap.persister.wait()
        snap.close()

    train(_code(1, seed=0), 1, 4)
    v2 = _code(2, seed=1)
    train(v2, 5, 8)
    final = full_state(v2)
    with pytest.raises(SnapshotMismatchError, match="--to 4 sets \\[6, 8\\] aside"):
        Snapshotter(run, _code(1, seed=3).registry, settings=SnapshotSettings(ram=False)).restore()
    store = SnapshotStore(run)
    assert store.committed_steps() == [2, 4, 6, 8] and store.quarantined() == []
    assert main(["snapshots", "rewind", run, "--to", "4"]) == 0
    assert store.committed_steps() == [2, 4] and len(store.quarantined()) == 2
    assert main(["snapshots", "restore-quarantined", run]) == 0
    assert store.committed_steps() == [2, 4, 6, 8] and store.quarantined() == []
    assert main(["snapshots", "verify", run, "8"]) == 0
    capsys.readouterr()
    again = _code(2, seed=9)
    assert Snapshotter(run, again.registry, settings=SnapshotSettings(ram=False)).restore() == 8
    for key, value in final.items():
        assert torch.equal(full_state(again)[key], value), key
    store.write_file(store.path("sessions.json"), b"[" * 100_000 + b"]" * 100_000)
    store.write_file(store.path("run.json"), b" " * 4096 + b"{}")
    with pytest.raises(JSONBoundsError, match="4098 bytes, more than the 1000"):
        store.read_json(store.path("run.json"), max_bytes=1000)  # refused before the body
    assert main(["runs", "ls", f"s3://{s3_bucket}/runs"]) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and out.out.splitlines()[1].split()[0] == "r"
    source = tmp_path / "a.txt"  # a dataset is never prepared into a run's snapshot
    source.write_text("a document of a few words. " * 100)
    assert main(["data", "prepare", "--out", f"{run}/snapshots/{step_dirname(8)}", "--quiet",
                 "--seq-len", "8", "--val-fraction", "0", str(source)]) == 2
    err = capsys.readouterr().err
    assert "inside the run directory" in err and len(err.strip().splitlines()) == 1, err
    assert main(["snapshots", "verify", run, "8"]) == 0


def test_a_sessions_rollback_is_the_runs_one_line_fatal_error(tmp_path: Path) -> None:
    """In a training loop (`trainer.Session`, what `baton fit` and a Ray Train loop run):
    the refusal is a `FatalRunError` (the run fails once, with this line), nothing moves."""
    from elastic.errors import FatalRunError
    from trainer.train.session import Session

    run = str(tmp_path / "run")

    def session(version: int) -> tuple[Session, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return Session(model, optimizer, extras={"mode": Mode(version)}, run_uri=run,
                       snapshot_every=2), optimizer

    for version, steps in ((1, 4), (2, 8)):
        s, optimizer = session(version)
        with s:
            for _ in s.steps(steps):
                optimizer.zero_grad()
                s.model(torch.ones(1, 4)).sum().backward()
                optimizer.step()
    store = SnapshotStore(run)
    committed = store.committed_steps()
    assert committed[-1] == 8
    with pytest.raises(FatalRunError) as info:
        session(1)
    text = str(info.value)
    assert "\n" not in text and "snapshot 8" in text and "--to 4" in text, text
    assert store.committed_steps() == committed and store.quarantined() == []
    s, _ = session(2)
    assert s.step == 8
    s.close(commit=False)
