"""A command's ``--out`` never destroys another run's snapshot or dataset (issue 36, point 7).

``baton snapshots export`` (safetensors, npz, orbax, hf), ``baton report`` and ``baton data
prepare`` with an ``--out`` that resolves into *another* run or a dataset directory (directly,
through a link to its manifest, a shard or a step directory, or through a linked directory on
the way) are refused in one line (exit 2) naming ``--out``; a link at ``--out`` that leads
elsewhere is replaced by the output, its target untouched; an ``--out`` that is a FIFO, a
character device or a directory is never replaced by a file; an Orbax export on a full disk
is one line and leaves nothing, so the retry succeeds. Each test ends on storage: the other
run still verifies, its files byte for byte, links and their targets as they were.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.format.records import MANIFEST_NAME, step_dirname
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import build, train_step
from trainer.cli import main
from trainer.run.metrics import MetricsWriter

ROOT = Path(__file__).resolve().parents[2]


def _run(run: Path, last: int, seed: int) -> None:
    """A run committed at every even step up to ``last`` (in process, no Ray)."""
    ts = build(seed=seed)
    snap = Snapshotter(str(run), ts.registry,
                       settings=SnapshotSettings(snapshot_every=2, keep_last=5, durable=False))
    for step in range(1, last + 1):
        train_step(ts, step)
        snap.after_step(step)
        snap.persister.wait()
    snap.close()
    writer = MetricsWriter(str(run), flush_every=1)  # for `baton report`
    writer.add({"kind": "start", "attempt": 0, "step": 0, "world_size": 1, "time": 1.0})
    writer.add({"kind": "step", "attempt": 0, "step": 1, "loss": 2.0, "tokens_per_s": 3.0,
                "world_size": 1, "time": 2.0})


def _tree(root: Path) -> dict[str, bytes | str]:
    """Every entry below ``root``: a file's bytes, a link's target, a directory's kind."""
    out: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        out[key] = (f"link:{os.readlink(path)}" if path.is_symlink() else "dir"
                    if path.is_dir() else path.read_bytes())
    return out


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str], code: int,
              *needles: str) -> str:
    assert main(argv) == code, (argv, capsys.readouterr())
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def _verifies(capsys: pytest.CaptureFixture[str], run: Path, steps: list[int]) -> None:
    for step in steps:
        assert main(["snapshots", "verify", str(run), str(step)]) == 0, capsys.readouterr()
    capsys.readouterr()


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path]:
    """The run a command exports (committed 2, 4) and another one (committed 2, 4, 6)."""
    run, other = tmp_path / "run", tmp_path / "other"
    _run(run, 4, seed=1)
    _run(other, 6, seed=5)
    return run, other


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    from data_state import prepare_corpus

    source = tmp_path / "texts"
    source.mkdir()
    (source / "a.txt").write_text("hello world, a document of some words. " * 50)
    out = tmp_path / "dataset"
    prepare_corpus([str(source)], str(out), seq_len=8, val_fraction=0.0, progress=False)
    return out


def test_no_output_lands_in_another_run_or_a_dataset(
        tmp_path: Path, runs: tuple[Path, Path], dataset: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    run, other = runs
    step_6 = other / "snapshots" / step_dirname(6)
    shard = next(p for p in step_6.iterdir() if p.name.endswith(".safetensors"))
    links = tmp_path / "links"
    links.mkdir()
    for name, target in (("manifest", step_6 / MANIFEST_NAME), ("shard", shard),
                         ("step", step_6), ("dataset.json", dataset / "dataset.json"),
                         ("data", dataset)):
        (links / name).symlink_to(target, target_is_directory=target.is_dir())
    before = {p: _tree(p) for p in (other, dataset, links)}
    export = ["snapshots", "export", str(run)]
    cases = [
        *([*export, "--format", fmt, "--out", str(out)]
          for fmt in ("safetensors", "npz")
          for out in (links / "manifest", links / "shard", links / "step" / f"x.{fmt}",
                      step_6 / f"x.{fmt}", other / f"x.{fmt}", links / "dataset.json",
                      links / "data" / f"x.{fmt}", dataset / f"x.{fmt}")),
        [*export, "--format", "orbax", "--out", str(links / "step" / "x.orbax")],
        [*export, "--format", "orbax", "--out", str(dataset / "x.orbax")],
        [*export, "--format", "hf", "--out", str(links / "step")],
        [*export, "--format", "hf", "--out", str(other / "hf")],
        ["report", str(run), "--out", str(links / "manifest")],
        ["report", str(run), "--out", str(links / "step" / "r.png")],
        ["report", str(run), "--out", str(links / "data" / "r.png")],
        ["data", "prepare", "--out", str(links / "step" / "d"), "--quiet",
         str(tmp_path / "texts")],
        ["data", "prepare", "--out", str(other / "snapshots" / "d"), "--quiet",
         str(tmp_path / "texts")],
        ["data", "prepare", "--out", str(dataset / "inner"), "--quiet", str(tmp_path / "texts")],
    ]
    for argv in cases:
        err = _one_line(capsys, argv, 2, "--out")
        assert "inside the run directory" in err or "inside the dataset directory" in err, err
        assert "write it elsewhere" in err, err
    assert {p: _tree(p) for p in (other, dataset, links)} == before
    _verifies(capsys, other, [2, 4, 6])
    _verifies(capsys, run, [2, 4])


def test_a_link_at_out_is_replaced_never_written_through(
        tmp_path: Path, runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    run, _ = runs
    target = tmp_path / "precious.txt"
    target.write_bytes(b"not to be overwritten")
    for argv, out in ((["snapshots", "export", str(run)], tmp_path / "w.safetensors"),
                      (["snapshots", "export", str(run), "--format", "npz"], tmp_path / "w.npz"),
                      (["report", str(run)], tmp_path / "r.png")):
        out.symlink_to(target)
        assert main([*argv, "--out", str(out)]) == 0, capsys.readouterr()
        assert not out.is_symlink() and out.stat().st_size > 0  # the link itself replaced
        assert target.read_bytes() == b"not to be overwritten"
        assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    capsys.readouterr()


@contextlib.contextmanager
def fifo_reader(fifo: Path) -> Iterator[list[bytes]]:
    """Yield what anything wrote into ``fifo``: a reader holds it open (so a writer's open
    never blocks, and the old code's write is seen instead of hanging the test)."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    got: list[bytes] = []
    done = threading.Event()

    def drain() -> None:
        while not done.wait(0.02):
            with contextlib.suppress(BlockingIOError):
                while chunk := os.read(fd, 1 << 16):
                    got.append(chunk)

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    try:
        yield got
    finally:
        done.set()
        thread.join(timeout=5)
        os.close(fd)


def _special_entries(tmp_path: Path) -> dict[str, Path]:
    """A FIFO, a directory and (where this process may make one) a /dev/full device."""
    entries = {"fifo": tmp_path / "fifo", "directory": tmp_path / "folder"}
    os.mkfifo(entries["fifo"])
    entries["directory"].mkdir()
    device = tmp_path / "full"
    try:
        os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
        entries["device"] = device
    except PermissionError:
        pass
    return entries


def test_an_out_that_is_not_a_regular_file_is_never_replaced(
        tmp_path: Path, runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    run, _ = runs
    entries = _special_entries(tmp_path)
    kinds = {name: stat.S_IFMT(os.lstat(p).st_mode) for name, p in entries.items()}
    commands = (["snapshots", "export", str(run)],
                ["snapshots", "export", str(run), "--format", "npz"], ["report", str(run)])
    for name, path in entries.items():
        for argv in commands:
            with fifo_reader(entries["fifo"]) as written:
                _one_line(capsys, [*argv, "--out", str(path)], 2, "--out", str(path))
            assert written == [], (name, argv)
            assert stat.S_IFMT(os.lstat(path).st_mode) == kinds[name], (name, argv)
    assert list(entries["directory"].iterdir()) == []
    source = tmp_path / "texts"
    source.mkdir()
    (source / "a.txt").write_text("hello world, a document of some words. " * 50)
    _one_line(capsys, ["data", "prepare", "--out", str(entries["fifo"]), "--quiet",
                       str(source)], 2, "--out", "a FIFO")
    assert stat.S_ISFIFO(os.lstat(entries["fifo"]).st_mode)


def test_the_output_rule_knows_every_marker_of_a_run_and_a_dataset() -> None:
    from data_state.manifest import MANIFEST_NAME as DATASET_NAME
    from elastic.coord.generation import GENERATION_NAME
    from elastic.lease.lease_io import LEASE_NAME
    from elastic.storage import DATASET_MARKER, RUN_MARKERS
    from trainer.train.continuation import SESSIONS_NAME

    assert set(RUN_MARKERS) == {"run.json", LEASE_NAME, GENERATION_NAME, SESSIONS_NAME}
    assert DATASET_MARKER == DATASET_NAME


def test_orbax_export_on_a_full_disk_is_one_line_and_leaves_nothing(
        tmp_path: Path, tiny_dataset: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills mid-save: Orbax has written part of the checkpoint, logs the failure
    with its traceback and prints more from its threads, then raises. One line, exit 1, no
    directory left (nor a temporary one), and the same command then succeeds."""
    ocp = pytest.importorskip("orbax.checkpoint")
    import torch

    from trainer.config import load_recipe
    from trainer.train.loop import WorkerEnv, run_worker

    torch.set_num_threads(1)
    run = tmp_path / "gpt"
    run_worker(load_recipe(ROOT / "recipes" / "tiny.toml", [
        f'snapshots.run_uri="{run}"', f'data.uri="{tiny_dataset}"', "steps=2",
        "eval.every=0", "sketch.rank=0", "snapshots.snapshot_every=2"]), WorkerEnv())
    out = tmp_path / "exports" / "ckpt"
    out.parent.mkdir()
    save = ocp.StandardCheckpointer.save

    def full_disk(self: object, directory: str, *args: object, **kwargs: object) -> None:
        os.makedirs(os.path.join(directory, "d"))
        Path(directory, "d", "part").write_bytes(b"x" * 100)
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as err:  # as Orbax's threads report it, traceback and all
            logging.getLogger("absl").error("background save failed", exc_info=True)
            print("Traceback (most recent call last):\nRuntimeError: Event loop is closed",
                  file=sys.stderr)
            raise ValueError(f"RESOURCE_EXHAUSTED: Failed writing: {err} "
                             "[os_error_code='28']") from err

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", full_disk)
    argv = ["snapshots", "export", str(run), "--format", "orbax", "--out", str(out)]
    err = _one_line(capsys, argv, 1, "ENOSPC", str(out))
    assert list(out.parent.iterdir()) == []  # neither the checkpoint nor a temporary
    monkeypatch.setattr(ocp.StandardCheckpointer, "save", save)
    assert main(argv) == 0, capsys.readouterr()
    assert (out / "baton.json").is_file() and (out / "state").is_dir(), err
    assert [p.name for p in out.parent.iterdir()] == ["ckpt"]
    assert SnapshotStore(str(run)).committed_steps() == [2]
