"""Forks (issue 17, point 5): `baton fit RECIPE --from RUN[@STEP] --run-dir NEW` and
`baton runs ls DIR`.

The CLI runs in-process through `trainer.cli.main`, with `trainer.on_ray.ray_fit.fit` replaced by
`tests/inprocess_fit.InProcessFit` (the real worker loop in this process, no Ray): the
fork's copy, checks, lineage and the warm restore are all the real code.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
from inprocess_fit import InProcessFit
from inprocess_fit import baton as _baton
from safetensors.torch import load_file
from snapshot_compare import assert_same_state, final_state

from elastic.catalog import export_model
from elastic.lease.run_lease import RunLease
from elastic.store.snapshot_store import SnapshotStore
from trainer.cli import main
from trainer.cli.runs import list_runs
from trainer.config import load_recipe
from trainer.run.metrics import read_records
from trainer.train.optim import lr_at

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny.toml")


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _sets(dataset: str, steps: int, *more: str) -> list[str]:
    out = ["--set", f'data.uri="{dataset}"', "--set", f"steps={steps}", "--set", "eval.every=0"]
    for assignment in more:
        out += ["--set", assignment]
    return out


@pytest.fixture
def parent(capsys: pytest.CaptureFixture[str], fake_fit: InProcessFit, tmp_path: Path,
           tiny_dataset: str) -> Path:
    """A run of 16 steps stopped at step 8 (snapshots 4 and 8)."""
    run = tmp_path / "runs" / "base"
    code, text = _baton(capsys, ["fit", TINY, "--run-dir", str(run), *_sets(tiny_dataset, 16),
                                 "--until", "8"])
    assert code == 0, text
    return run


def _component(run: Path, step: int, component: str, tmp: Path) -> dict[str, torch.Tensor]:
    out = tmp / f"{run.name}-{step}-{component}.safetensors"
    export_model(SnapshotStore(str(run)), step, str(out), component=component)
    return load_file(out)


def _holds_no_run(run: Path) -> bool:
    return not (run / "run.json").exists() and not SnapshotStore(str(run)).all_steps()


def test_fork_on_another_world_size_and_layout_trains_on_exactly_like_its_parent(
    capsys: pytest.CaptureFixture[str], fake_fit: InProcessFit, parent: Path, tmp_path: Path,
    tiny_dataset: str,
) -> None:
    """Optimizer warm and data cursor kept: the fork's steps 9..16, on 2 FSDP2 workers, are
    the parent's (continued on 1 DDP worker) up to float summation order."""
    fork = tmp_path / "runs" / "same"
    fake_fit.world_size = 2
    code, text = _baton(capsys, ["fit", TINY, "--from", str(parent), "--run-dir", str(fork),
                                 *_sets(tiny_dataset, 16, 'parallelism="fsdp"')])
    fake_fit.world_size = 1
    assert code == 0, text
    assert f"forked {parent} at step 8 into {fork}" in text, text
    assert "optimizer warm, data cursor kept" in text, text
    code, text = _baton(capsys, ["fit", TINY, "--run-dir", str(parent), *_sets(tiny_dataset, 16)])
    assert code == 0, text
    assert_same_state(final_state(parent, tmp_path, 16), final_state(fork, tmp_path, 16))

    lineage = json.loads((fork / "run.json").read_text())["parent"]
    parent_loss = [r["loss"] for r in read_records(str(parent))
                   if r["kind"] == "step" and r["step"] == 8][-1]
    assert (lineage["uri"], lineage["step"], lineage["data_cursor"]) == (str(parent), 8, "kept")
    assert lineage["loss"] == parent_loss
    assert json.loads((fork / "generation.json").read_text())["generation"] >= 1
    assert [(r["step"], r["world_size"]) for r in read_records(str(fork))
            if r["kind"] == "start"] == [(8, 2)]
    assert SnapshotStore(str(fork)).load_manifest(16).layout == "fsdp"


def test_fork_changes_lr_and_data_with_the_optimizer_moments_carried_bitwise(
    capsys: pytest.CaptureFixture[str], parent: Path, tmp_path: Path, tiny_dataset: str,
) -> None:
    fork = tmp_path / "runs" / "lr"
    code, text = _baton(capsys, [
        "fit", TINY, "--from", f"{parent}@8", "--run-dir", str(fork),
        *_sets(tiny_dataset, 12, "optim.lr=0.001"), "--data-cursor", "reset", "--until", "10"])
    assert code == 0, text
    assert "data cursor reset to epoch 0" in text and "schedule from here: lr" in text, text
    assert "stopped at step 10; continue with:" in text, text

    # The copied snapshot holds the parent's model and optimizer moments, bit for bit.
    for component in ("model", "optim"):
        mine, theirs = (_component(r, 8, component, tmp_path) for r in (fork, parent))
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), component
    assert any(k.endswith("exp_avg_sq") for k in theirs)
    # ... restored warm: AdamW's step counter went on from 8 to 10.
    steps = {k: v for k, v in _component(fork, 10, "optim", tmp_path).items()
             if k.endswith(".step")}
    assert steps and all(float(v) == 10.0 for v in steps.values())
    # The data cursor was reset; the new lr drives the schedule from step 9.
    cursor = SnapshotStore(str(fork)).load_manifest(8).state["data"]
    assert (cursor["epoch"], cursor["samples_consumed"]) == (0, 0)
    new = load_recipe(TINY, ["snapshots.run_uri=x", "steps=12", "optim.lr=0.001"]).optim
    lrs = {r["step"]: r["lr"] for r in read_records(str(fork)) if r["kind"] == "step"}
    assert lrs == pytest.approx({s: lr_at(new, 12, s - 1) for s in (9, 10)})
    assert json.loads((fork / "run.json").read_text())["parent"]["data_cursor"] == "reset"

    # The printed command continues the fork (no --from), with no --reschedule needed.
    argv = shlex.split(text.split("continue with: ", 1)[1].split(" ┏")[0])[1:]
    assert "--from" not in argv and argv[argv.index("--run-dir") + 1] == str(fork)
    code, text = _baton(capsys, argv)
    assert code == 0, text
    assert max(SnapshotStore(str(fork)).committed_steps()) == 12
    # The parent was never written to.
    assert max(SnapshotStore(str(parent)).committed_steps()) == 8

    rows = {r["run"]: r for r in list_runs(str(tmp_path / "runs"))}
    assert (rows["base"]["state"], rows["base"]["step"], rows["base"]["parent"]) == \
        ("stopped", 8, None)
    assert (rows["lr"]["state"], rows["lr"]["step"], rows["lr"]["steps"]) == ("finished", 12, 12)
    assert rows["lr"]["parent"] == f"{parent}@8"
    assert rows["lr"]["loss"] == [r["loss"] for r in read_records(str(fork))
                                  if r["kind"] == "step"][-1]


@pytest.mark.parametrize(("change", "field"), [
    ("model.d_model=64", "model.d_model"), ("model.n_layers=2", "model.n_layers"),
    ("data.seq_len=16", "data.seq_len"),
])
def test_a_fork_that_changes_a_tensor_shape_is_refused_naming_the_field(
    capsys: pytest.CaptureFixture[str], parent: Path, tmp_path: Path, tiny_dataset: str,
    change: str, field: str,
) -> None:
    fork = tmp_path / "runs" / "shape"
    line = _one_line(capsys, ["fit", TINY, "--from", str(parent), "--run-dir", str(fork),
                              *_sets(tiny_dataset, 16, change)], field)
    assert line.startswith(f"error: {field}:") and "shape" in line, line
    assert _holds_no_run(fork)


def test_fork_refusals_are_one_line_before_anything_is_written(
    capsys: pytest.CaptureFixture[str], parent: Path, tmp_path: Path, tiny_dataset: str,
) -> None:
    fork = str(tmp_path / "runs" / "x")
    base = ["fit", TINY, "--run-dir", fork, *_sets(tiny_dataset, 16)]
    _one_line(capsys, [*base, "--from", f"{parent}@5"], "step 5 is not a committed snapshot",
              "[4, 8]")
    _one_line(capsys, [*base, "--from", f"{parent}@abc"], "--from", "RUN@STEP")
    _one_line(capsys, [*base, "--from", str(tmp_path / "nowhere")], "does not exist")
    _one_line(capsys, [*base, "--from", str(parent), "--data-cursor", "maybe"],
              "--data-cursor 'maybe'", "auto, keep, reset")
    _one_line(capsys, [*base, "--from", str(parent), "--data-cursor", "keep", "--set", "seed=3"],
              "seed", "--data-cursor reset")
    _one_line(capsys, ["fit", TINY, "--run-dir", fork, *_sets(tiny_dataset, 8),
                       "--from", str(parent)], "steps", "above 8")
    _one_line(capsys, ["fit", TINY, "--run-dir", str(parent / "inner"), *_sets(tiny_dataset, 16),
                       "--from", str(parent)], "outside the run it forks")
    _one_line(capsys, ["fit", TINY, "--run-dir", str(parent), *_sets(tiny_dataset, 16),
                       "--from", str(parent)], "outside the run it forks")
    assert _holds_no_run(Path(fork))
    # A directory that already holds a run is never a fork's target.
    other = tmp_path / "runs" / "other"
    assert main(["fit", TINY, "--run-dir", str(other), *_sets(tiny_dataset, 8), "--until",
                 "4"]) == 0
    capsys.readouterr()
    _one_line(capsys, ["fit", TINY, "--run-dir", str(other), *_sets(tiny_dataset, 16),
                       "--from", str(parent)], "already holds a run", "drop --from")


def test_data_cursor_auto_resets_on_another_dataset_and_keep_refuses_it(
    capsys: pytest.CaptureFixture[str], parent: Path, tmp_path: Path, tiny_dataset: str,
) -> None:
    from data_state import prepare_corpus

    other = str(tmp_path / "other-data")
    prepare_corpus(None, other, seq_len=32, max_bytes=250_000, progress=False)
    fork = tmp_path / "runs" / "other"
    sets = ["--set", f'data.uri="{other}"', "--set", "steps=10", "--set", "eval.every=0"]
    _one_line(capsys, ["fit", TINY, "--from", str(parent), "--run-dir", str(fork), *sets,
                       "--data-cursor", "keep"], "data.uri", "--data-cursor reset")
    assert _holds_no_run(fork)
    code, text = _baton(capsys, ["fit", TINY, "--from", str(parent), "--run-dir", str(fork),
                                 *sets])
    assert code == 0, text
    assert "data cursor reset to epoch 0" in text, text
    cursor = SnapshotStore(str(fork)).load_manifest(10).state["data"]
    assert cursor["dataset"] != SnapshotStore(str(parent)).load_manifest(8).state["data"][
        "dataset"]
    assert (cursor["epoch"], cursor["samples_consumed"]) == (0, 2 * 8)  # 2 steps of 8


def test_fork_into_s3_copies_a_verified_snapshot(
    parent: Path, s3_bucket: str, tiny_dataset: str,
) -> None:
    """The same copy through the S3 store (moto): create-only writes, then the fork's
    snapshot verifies and `runs ls` reads the run."""
    from elastic.catalog import verify
    from trainer.run.fork import make_fork, plan_fork

    uri = f"s3://{s3_bucket}/runs/fork"
    cfg = load_recipe(TINY, [f'snapshots.run_uri="{uri}"', f'data.uri="{tiny_dataset}"',
                             "steps=16", "optim.lr=0.001"])
    result = make_fork(plan_fork(cfg, str(parent), None), cfg)
    assert (result.step, result.cursor_kept) == (8, True)
    store = SnapshotStore(uri)
    assert store.committed_steps() == [8]
    assert verify(store, 8)["tensors"] > 0
    assert store.read_run_json()["parent"]["uri"] == str(parent)
    (row,) = list_runs(f"s3://{s3_bucket}/runs")
    assert (row["run"], row["step"], row["steps"], row["parent"]) == \
        ("fork", 8, 16, f"{parent}@8")


def test_a_corrupt_parent_snapshot_is_refused_and_nothing_is_committed(
    capsys: pytest.CaptureFixture[str], parent: Path, tmp_path: Path, tiny_dataset: str,
) -> None:
    store = SnapshotStore(str(parent))
    shard = Path(store.step_path(8, store.load_manifest(8).files[0]))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # inside the last chunk's bytes
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))
    fork = tmp_path / "runs" / "bad"
    _one_line(capsys, ["fit", TINY, "--from", str(parent), "--run-dir", str(fork),
                       *_sets(tiny_dataset, 16)], "checksum mismatch", "fork an older step")
    assert _holds_no_run(fork)
    assert not list((fork / "snapshots").rglob("*.safetensors"))


def test_a_fork_that_fails_at_its_commit_leaves_no_run_behind(
    parent: Path, tmp_path: Path, tiny_dataset: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainer.run.fork import make_fork, plan_fork

    fork = tmp_path / "runs" / "cut"
    cfg = load_recipe(TINY, [f'snapshots.run_uri="{fork}"', f'data.uri="{tiny_dataset}"',
                             "steps=16"])
    plan = plan_fork(cfg, str(parent), 8)

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(SnapshotStore, "write_manifest", refuse)
    with pytest.raises(OSError, match="disk full"):
        make_fork(plan, cfg)
    monkeypatch.undo()
    assert _holds_no_run(fork) and not (fork / "generation.json").exists()
    assert make_fork(plan_fork(cfg, str(parent), 8), cfg).step == 8  # and it can be retried
    assert SnapshotStore(str(fork)).committed_steps() == [8]


@pytest.mark.parametrize("cut", ["before the commit", "while copying shards"])
def test_a_fork_killed_before_its_commit_is_forked_again(
    capsys: pytest.CaptureFixture[str], parent: Path, tmp_path: Path, tiny_dataset: str,
    cut: str,
) -> None:
    """A kill leaves what the failure path would have removed (run.json, shards,
    generation.json, no manifest); retrying the same `--from` replaces it and commits the
    parent's snapshot bit for bit. A directory whose fork committed is still refused."""
    from trainer.run.fork import make_fork, plan_fork

    fork = tmp_path / "runs" / "killed"
    cfg = load_recipe(TINY, [f'snapshots.run_uri="{fork}"', f'data.uri="{tiny_dataset}"',
                             "steps=16"])
    make_fork(plan_fork(cfg, str(parent), 8), cfg)
    step_dir = fork / "snapshots" / f"{8:09d}"
    (step_dir / "manifest.json").unlink()  # the kill's point: nothing committed
    if cut == "while copying shards":
        (fork / "generation.json").unlink()
        shards = sorted(step_dir.glob("*.safetensors"))
        shards[-1].write_bytes(shards[-1].read_bytes()[:100])  # a half-written file
    store = SnapshotStore(str(fork))
    assert store.committed_steps() == [] and (fork / "run.json").exists()
    code, text = _baton(capsys, ["fit", TINY, "--from", f"{parent}@8", "--run-dir", str(fork),
                                 *_sets(tiny_dataset, 16), "--until", "10"])
    assert code == 0, text
    assert f"forked {parent} at step 8" in text, text
    assert store.committed_steps() == [8, 10]
    for component in ("model", "optim"):
        mine, theirs = (_component(r, 8, component, tmp_path) for r in (fork, parent))
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), component
    # Committed now (and a session ran): a further fork into it is refused.
    _one_line(capsys, ["fit", TINY, "--run-dir", str(fork), *_sets(tiny_dataset, 16),
                       "--from", str(parent)], "already holds a run", "drop --from")


def test_runs_ls_shows_running_and_failed_runs(
    capsys: pytest.CaptureFixture[str], parent: Path, tmp_path: Path,
) -> None:
    runs = tmp_path / "runs"
    lease = RunLease(SnapshotStore(str(parent)))
    lease.acquire()
    try:
        assert main(["runs", "ls", str(runs)]) == 0
        out = capsys.readouterr().out
    finally:
        lease.release()
    header, row = out.strip().splitlines()
    assert header.split() == ["run", "state", "step", "loss", "parent"]
    assert row.split()[:3] == ["base", "running", "8/16"]
    sessions = json.loads((parent / "sessions.json").read_text())
    sessions["sessions"][-1]["outcome"] = "failed"
    (parent / "sessions.json").write_text(json.dumps(sessions))
    (runs / "stray").mkdir()  # not a run: not listed
    (runs / "link").symlink_to(parent)  # could point anywhere: not followed
    assert main(["runs", "ls", str(runs), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["run"], r["state"]) for r in rows] == [("base", "failed")]
    assert main(["runs", "ls", str(tmp_path / "none")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_a_run_s_records_are_never_read_through_a_symbolic_link(
    parent: Path, tmp_path: Path,
) -> None:
    """run.json, sessions.json and metrics parts that are links to another run's files (or
    anywhere) read as absent: Baton never reads outside a run directory through them (P8)."""
    from trainer.run.session_log import read_sessions

    mirror = tmp_path / "runs" / "mirror"
    (mirror / "metrics").mkdir(parents=True)
    for name in ("run.json", "sessions.json"):
        (mirror / name).symlink_to(parent / name)
    for part in (parent / "metrics").glob("part-*.jsonl"):
        (mirror / "metrics" / part.name).symlink_to(part)
    store = SnapshotStore(str(mirror))
    assert store.read_run_json() is None and read_sessions(store) == []
    assert read_records(str(mirror)) == [] and read_records(str(parent)) != []
    rows = {r["run"]: r for r in list_runs(str(tmp_path / "runs"))}
    assert (rows["mirror"]["parent"], rows["mirror"]["steps"], rows["mirror"]["loss"]) == \
        (None, None, None)
    assert (rows["base"]["steps"], rows["base"]["step"]) == (16, 8)  # the real one reads
