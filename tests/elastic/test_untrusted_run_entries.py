"""What a run or dataset directory holds is untrusted, entries included (issue 29).

Links, FIFOs and deeply nested JSON where Baton expects its own files: a symlinked step
directory pointing into another run, an ``--out`` that is a link into a committed snapshot,
``run.json`` / ``sessions.json`` / ``manifest.json`` as FIFOs, a 100,000-deep JSON value in
a metrics line or a run file. Each test ends on storage: the other run's snapshots intact
and verifying, the manifest's bytes unchanged, no reader left blocked on a FIFO (a watcher
thread opens each FIFO for writing whenever a reader holds it: that both unblocks a hung
open and records it, so a hang fails the test instead of the suite), no traceback.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from inprocess_fit import InProcessFit

from elastic.format.records import MANIFEST_NAME, step_dirname
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.storage import RefusedEntryError
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import TrainState, build, full_state, train_step
from trainer.cli import main
from trainer.run.metrics import MetricsWriter, read_records

DEEP = b"[" * 100_000 + b"]" * 100_000
TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny.toml")


def _train(snap: Snapshotter, ts: TrainState, first: int, last: int) -> None:
    """Train steps ``first..last``, snapshots when due (in process, no Ray)."""
    for step in range(first, last + 1):
        train_step(ts, step)
        snap.after_step(step)
        snap.persister.wait()


def _run(run: Path, last: int, *, keep_last: int, seed: int = 0
         ) -> tuple[Snapshotter, TrainState]:
    """A run trained to ``last`` with a snapshot every 2 steps; its snapshotter still open."""
    ts = build(seed=seed)
    snap = Snapshotter(str(run), ts.registry,
                       settings=SnapshotSettings(snapshot_every=2, keep_last=keep_last,
                                                 durable=False, block_bytes=256,
                                                 split_min_bytes=64))
    _train(snap, ts, 1, last)
    return snap, ts


def _files(step_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(step_dir.iterdir())}


def _verifies(capsys: pytest.CaptureFixture[str], run: Path, steps: list[int]) -> None:
    """`baton snapshots verify` passes for every step of ``run`` listed."""
    for step in steps:
        assert main(["snapshots", "verify", str(run), str(step)]) == 0, capsys.readouterr()
    capsys.readouterr()


@contextlib.contextmanager
def fifo_watch(*fifos: Path) -> Iterator[list[str]]:
    """Yield a list that records each FIFO a reader held open: a writer's non-blocking open
    succeeds only then, and it ends a reader's blocked open (the reader then sees EOF)."""
    blocked: list[str] = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            for fifo in fifos:
                try:
                    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
                except OSError:  # ENXIO: no reader has it open (or it is gone)
                    continue
                if stat.S_ISFIFO(os.fstat(fd).st_mode):  # not a file written there since
                    blocked.append(str(fifo))
                os.close(fd)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield blocked
    finally:
        done.set()
        thread.join(timeout=5)


# ---------------------------------------------------------------- a symlinked step directory


@pytest.fixture
def other(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """Another run, committed at steps 2, 4 and 6."""
    run = tmp_path / "other"
    snap, _ = _run(run, 6, keep_last=5, seed=5)
    snap.close()
    assert SnapshotStore(str(run)).committed_steps() == [2, 4, 6]
    return run


def test_retention_never_acts_through_a_linked_step_directory(
        tmp_path: Path, other: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """RUN/snapshots/000000006 replaced by a link to the other run's step 6 while the run
    trains on: when step 6 ages out, retention must leave it (and the other run) alone."""
    theirs = other / "snapshots" / step_dirname(6)
    before = _files(theirs)
    run = tmp_path / "run"
    snap, ts = _run(run, 6, keep_last=2)
    snap.coordinator.flush(10)  # the collection after 6 is done
    assert SnapshotStore(str(run)).committed_steps() == [4, 6]
    mine = run / "snapshots" / step_dirname(6)
    for path in mine.iterdir():
        path.unlink()
    mine.rmdir()
    mine.symlink_to(theirs, target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger="baton.elastic"):
        _train(snap, ts, 7, 12)  # step 6 ages out at the commit of 10
        snap.close()
    assert _files(theirs) == before  # their manifest and shard, byte for byte
    assert os.path.islink(mine) and os.readlink(mine) == str(theirs)  # left alone
    spare = run / "spare"
    their_inodes = {p.stat().st_ino for p in theirs.iterdir()}
    assert not spare.exists() or not {p.stat().st_ino for p in spare.iterdir()} & their_inodes
    store = SnapshotStore(str(run))
    assert store.committed_steps() == [10, 12] and 6 in store.refused_steps()
    refusals = [r.getMessage() for r in caplog.records if "symbolic link" in r.getMessage()]
    assert refusals and all("\n" not in m for m in refusals), refusals
    _verifies(capsys, other, [2, 4, 6])
    _verifies(capsys, run, [10, 12])
    assert main(["snapshots", "ls", str(run)]) == 0
    listing = capsys.readouterr().out
    assert "refused" in listing and "symbolic link" in listing


def test_a_linked_newest_step_is_no_snapshot_of_the_run(
        tmp_path: Path, other: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The link is the newest step when the run restarts: it restores its own step 4, never
    reads, quarantines or writes into the other run's step 6, and commits a real 6 of its
    own (the link is moved aside by nobody: the write into it is refused)."""
    theirs = other / "snapshots" / step_dirname(6)
    before = _files(theirs)
    run = tmp_path / "run"
    snap, ts = _run(run, 4, keep_last=5)
    snap.close()
    at_4 = full_state(ts)
    (run / "snapshots" / step_dirname(6)).symlink_to(theirs, target_is_directory=True)
    ts2 = build(seed=9)
    snap2 = Snapshotter(str(run), ts2.registry,
                        settings=SnapshotSettings(snapshot_every=2, keep_last=5, durable=False,
                                                  block_bytes=256, split_min_bytes=64))
    assert snap2.restore() == 4 and snap2.restore_errors == []
    for key, value in at_4.items():
        assert torch.equal(full_state(ts2)[key], value), key
    _train(snap2, ts2, 5, 8)
    snap2.close()
    assert _files(theirs) == before and not (run / "quarantine").exists()
    assert SnapshotStore(str(run)).committed_steps() == [2, 4, 8]  # 6: its write refused
    _verifies(capsys, other, [2, 4, 6])
    _verifies(capsys, run, [2, 4, 8])


def test_a_linked_snapshots_directory_is_refused_whole(
        tmp_path: Path, other: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """RUN/snapshots itself a link to the other run's: every command refuses the run in one
    line; nothing of the other run is read as this run's, moved or removed."""
    before = {s: _files(other / "snapshots" / step_dirname(s)) for s in (2, 4, 6)}
    run = tmp_path / "run"
    run.mkdir()
    (run / "snapshots").symlink_to(other / "snapshots", target_is_directory=True)
    assert main(["snapshots", "ls", str(run)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "symbolic link" in err, err
    with pytest.raises(RefusedEntryError, match="symbolic link"):
        Snapshotter(str(run), build(seed=1).registry).restore()
    assert main(["runs", "ls", str(tmp_path)]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert {s: _files(other / "snapshots" / step_dirname(s)) for s in (2, 4, 6)} == before
    _verifies(capsys, other, [2, 4, 6])


# ---------------------------------------------------------------- outputs through links


def test_report_and_export_never_write_through_a_link_into_the_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    snap, _ = _run(run, 4, keep_last=5)
    snap.close()
    writer = MetricsWriter(str(run), flush_every=1)
    writer.add({"kind": "start", "attempt": 0, "step": 0, "world_size": 1, "time": 1.0})
    writer.add({"kind": "step", "attempt": 0, "step": 1, "loss": 2.0, "tokens_per_s": 3.0,
                "world_size": 1, "time": 2.0})
    manifest = run / "snapshots" / step_dirname(4) / MANIFEST_NAME
    before = manifest.read_bytes()
    link = tmp_path / "out.png"
    link.symlink_to(manifest)
    into = tmp_path / "into"  # a linked directory on the way
    into.symlink_to(manifest.parent, target_is_directory=True)
    for argv in (["report", str(run), "--out", str(link)],
                 ["report", str(run), "--out", str(into / MANIFEST_NAME)],
                 ["snapshots", "export", str(run), "--out", str(link)],
                 ["snapshots", "export", str(run), "--out", str(into / "w.safetensors")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert "inside the run directory" in err and "--out" in err, err
    assert manifest.read_bytes() == before and not (into / "w.safetensors").exists()
    _verifies(capsys, run, [2, 4])
    out = tmp_path / "elsewhere.png"  # a link at --out is replaced, never written through
    target = tmp_path / "real.png"
    out.symlink_to(target)
    assert main(["report", str(run), "--out", str(out)]) == 0
    assert not out.is_symlink() and out.read_bytes()[:4] == b"\x89PNG"
    assert not target.exists()


# ---------------------------------------------------------------- FIFOs


def test_run_files_that_are_fifos_never_block_runs_ls(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    snap, _ = _run(runs / "a", 4, keep_last=5)
    snap.close()
    (runs / "a" / "sessions.json").write_text('{"sessions": []}')
    for name in ("run.json", "sessions.json"):
        (runs / "a" / name).unlink()
        os.mkfifo(runs / "a" / name)
    fifos = [runs / "a" / "run.json", runs / "a" / "sessions.json"]
    with fifo_watch(*fifos) as blocked:
        assert main(["runs", "ls", str(runs)]) == 0
        assert main(["runs", "ls", str(runs), "--json"]) == 0
    out = capsys.readouterr()
    assert blocked == [] and "Traceback" not in out.err
    rows = json.loads(out.out.split("\n", 2)[-1][out.out.split("\n", 2)[-1].index("["):])
    assert [(r["run"], r["step"]) for r in rows] == [("a", 4)]
    _verifies(capsys, runs / "a", [2, 4])


def test_a_manifest_that_is_a_fifo_never_blocks_ls_verify_or_restore(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    snap, _ = _run(run, 4, keep_last=5)
    snap.close()
    manifest = run / "snapshots" / step_dirname(4) / MANIFEST_NAME
    manifest.unlink()
    os.mkfifo(manifest)
    with fifo_watch(manifest) as blocked:
        assert main(["snapshots", "ls", str(run)]) == 0
        listing = capsys.readouterr().out
        assert main(["snapshots", "verify", str(run), "4"]) == 1
        err = capsys.readouterr().err.strip()
        ts = build(seed=2)
        restorer = Snapshotter(str(run), ts.registry)
        step = restorer.restore()  # a definite failure: set aside, the previous one used
        restorer.close()
    assert blocked == []
    assert "a FIFO" in listing and len(err.splitlines()) == 1 and "a FIFO" in err, err
    assert step == 2 and "a FIFO" in restorer.restore_errors[0]
    quarantined = SnapshotStore(str(run)).quarantined()
    assert [r["step"] for r in quarantined] == [4]  # moved inside the run, never deleted
    assert (Path(quarantined[0]["where"]) / MANIFEST_NAME).is_fifo()
    _verifies(capsys, run, [2])


# ---------------------------------------------------------------- deeply nested JSON


def test_deeply_nested_json_in_run_files_is_skipped_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    runs = tmp_path / "runs"
    run = runs / "a"
    snap, _ = _run(run, 4, keep_last=5)
    snap.close()
    writer = MetricsWriter(str(run), flush_every=1)
    writer.add({"kind": "start", "attempt": 0, "step": 0, "world_size": 1, "time": 1.0})
    writer.add({"kind": "step", "attempt": 0, "step": 1, "loss": 2.0, "tokens_per_s": 3.0,
                "world_size": 1, "time": 2.0})
    (run / "metrics" / "part-z-000000.jsonl").write_bytes(DEEP + b"\n")
    with caplog.at_level(logging.WARNING):
        assert [r["step"] for r in read_records(str(run)) if r["kind"] == "step"] == [1]
    assert any("part-z-000000.jsonl" in r.getMessage() for r in caplog.records)
    assert main(["report", str(run), "--out", str(tmp_path / "r.png")]) == 0
    assert "Traceback" not in capsys.readouterr().err
    for name in ("run.json", "sessions.json", "lease.json"):
        (run / name).write_bytes(DEEP)
    assert main(["runs", "ls", str(runs)]) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and out.out.splitlines()[1].split()[0] == "a"
    (run / "lease.json").unlink()
    (run / "generation.json").write_bytes(b'{"generation": ' + DEEP + b"}")
    ts = build(seed=2)
    with pytest.raises(ValueError) as info:  # the coordinator cannot start: one line
        Snapshotter(str(run), ts.registry).restore()
    assert "generation.json" in str(info.value) and "\n" not in str(info.value)
    _verifies(capsys, run, [2, 4])


def test_baton_fit_over_a_manifest_that_is_a_fifo(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_fit: InProcessFit,
        tiny_dataset: str) -> None:
    """`baton fit`'s pre-flight reads the newest manifest (its data cursor): a FIFO there
    neither blocks it nor the restore, which sets that snapshot aside and continues from the
    one before; the run ends committed and verifying."""
    run = tmp_path / "run"
    sets = ["--set", f'data.uri="{tiny_dataset}"', "--set", "steps=12", "--set",
            "eval.every=0", "--set", "snapshots.keep_last=3"]
    assert main(["fit", TINY, "--run-dir", str(run), *sets, "--until", "8"]) == 0
    assert SnapshotStore(str(run)).committed_steps() == [4, 8]
    manifest = run / "snapshots" / step_dirname(8) / MANIFEST_NAME
    manifest.unlink()
    os.mkfifo(manifest)
    capsys.readouterr()
    with fifo_watch(manifest) as blocked:
        code = main(["fit", TINY, "--run-dir", str(run), *sets])
    out = capsys.readouterr()
    assert blocked == [] and code == 0, out.err[-2000:]
    assert "Traceback" not in out.out + out.err
    store = SnapshotStore(str(run))
    assert store.committed_steps()[-1] == 12 and [r["step"] for r in store.quarantined()] == [8]
    _verifies(capsys, run, store.committed_steps())


# ---------------------------------------------------------------- datasets


def test_data_commands_refuse_outputs_into_runs_and_sources_and_bad_manifests(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    snap, _ = _run(run, 4, keep_last=5)
    snap.close()
    step_4 = run / "snapshots" / step_dirname(4)
    before = _files(step_4)
    source = tmp_path / "texts"
    source.mkdir()
    (source / "a.txt").write_text("hello world, a document of some words. " * 50)
    link = tmp_path / "out-link"
    link.symlink_to(step_4, target_is_directory=True)
    for out in (str(link), str(step_4), str(source / "prepared")):
        assert main(["data", "prepare", "--out", out, "--seq-len", "8", "--quiet",
                     str(source)]) == 2, out
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--out" in err and "inside" in err, err
    assert _files(step_4) == before and not (source / "prepared").exists()
    _verifies(capsys, run, [2, 4])
    data = run / "data"  # a run's own data/ is where baton fit prepares the default corpus
    assert main(["data", "prepare", "--out", str(data), "--seq-len", "8", "--quiet",
                 "--val-fraction", "0", str(source)]) == 0
    manifest = data / "dataset.json"
    for bad in ("deep", "fifo"):
        manifest.unlink()
        if bad == "deep":
            manifest.write_bytes(DEEP)
        else:
            os.mkfifo(manifest)
        with fifo_watch(manifest) as blocked:
            assert main(["data", "inspect", str(data)]) == 2
        err = capsys.readouterr().err.strip()
        assert blocked == [] and len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert ("nested more than" if bad == "deep" else "a FIFO") in err, err


def test_the_drivers_ray_log_never_blocks_on_a_fifo_nor_writes_through_a_link(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """RUN/logs/ray.log is appended to by the driver: a FIFO there would block it, a link
    would append Ray's messages to a manifest. Both are refused; the lines go to the
    terminal instead."""
    from trainer.on_ray.ray_messages import _FileSink

    run = tmp_path / "run"
    snap, _ = _run(run, 4, keep_last=5)
    snap.close()
    manifest = run / "snapshots" / step_dirname(4) / MANIFEST_NAME
    before = manifest.read_bytes()
    (run / "logs").mkdir()
    os.mkfifo(run / "logs" / "ray.log")
    told: list[str] = []
    with fifo_watch(run / "logs" / "ray.log") as blocked:
        _FileSink(run / "logs" / "ray.log", told.append, run).write("raylet", ["node lost"])
    assert blocked == [] and "node lost" in capsys.readouterr().err
    assert len(told) == 1 and "cannot go to" in told[0] and "a FIFO" in told[0], told
    (run / "logs" / "ray.log").unlink()
    (run / "logs" / "ray.log").symlink_to(manifest)
    _FileSink(run / "logs" / "ray.log", told.append, run).write("raylet", ["node lost"])
    (run / "logs" / "ray.log").unlink()
    (run / "logs").rmdir()
    (run / "logs").symlink_to(manifest.parent, target_is_directory=True)
    _FileSink(run / "logs" / "ray.log", told.append, run).write("raylet", ["node lost"])
    assert manifest.read_bytes() == before and not (manifest.parent / "ray.log").exists()
    assert all("symbolic link" in t for t in told[1:]), told
    _verifies(capsys, run, [2, 4])


def test_a_models_config_json_deep_or_a_fifo_is_one_config_error(tmp_path: Path) -> None:
    """A recipe's `model.hf_config` is a person's file (a link into a hub cache is fine),
    read through the same bounded reader: never a RecursionError, never a hang."""
    from trainer.config.checks import ConfigError
    from trainer.config.model import raw_hf_config

    config = tmp_path / "model" / "config.json"
    config.parent.mkdir()
    (tmp_path / "real.json").write_text('{"model_type": "llama"}')
    config.symlink_to(tmp_path / "real.json")
    assert raw_hf_config(str(config.parent), "model.hf_config") == {"model_type": "llama"}
    config.unlink()
    config.write_bytes(DEEP)
    with pytest.raises(ConfigError, match="nested more than"):
        raw_hf_config(str(config.parent), "model.hf_config")
    config.unlink()
    os.mkfifo(config)
    with fifo_watch(config) as blocked, pytest.raises(ConfigError, match="a FIFO") as info:
        raw_hf_config(str(config.parent), "model.hf_config")
    assert blocked == [] and "\n" not in str(info.value)


def test_a_source_row_nested_100000_deep_is_a_skipped_row(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "rows.jsonl"
    source.write_bytes(b'{"text": "a document of a few words"}\n' * 100 + DEEP + b"\n")
    assert main(["data", "prepare", "--out", str(tmp_path / "out"), "--seq-len", "8",
                 "--quiet", "--val-fraction", "0", str(source)]) == 0
    out = capsys.readouterr()
    assert "1 rows skipped: invalid JSON" in out.out and "Traceback" not in out.err


def test_baton_demo_removes_only_a_directory_an_earlier_demo_made(
        tmp_path: Path, other: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`baton demo --run-dir X` starts from an empty X: it removes X only when an earlier
    demo made it; a real run there, a link or a file is refused in one line, untouched."""
    from trainer.on_ray.demo import DEMO_MARK, fresh_demo_dir

    before = {s: _files(other / "snapshots" / step_dirname(s)) for s in (2, 4, 6)}
    link = tmp_path / "link"
    link.symlink_to(other, target_is_directory=True)
    for place in (other, link):
        with pytest.raises(ValueError, match="--run-dir") as info:
            fresh_demo_dir(place)
        assert "\n" not in str(info.value)
    assert main(["demo", "--run-dir", str(other)]) == 2  # refused before Ray starts
    assert "--run-dir" in capsys.readouterr().err
    assert {s: _files(other / "snapshots" / step_dirname(s)) for s in (2, 4, 6)} == before
    _verifies(capsys, other, [2, 4, 6])
    demo = tmp_path / "demo"
    fresh_demo_dir(demo)
    (demo / "snapshots").mkdir()
    fresh_demo_dir(demo)  # an earlier demo's: removed and made again
    assert sorted(p.name for p in demo.iterdir()) == [DEMO_MARK]
