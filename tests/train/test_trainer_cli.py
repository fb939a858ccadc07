"""`baton fit` refuses bad input before Ray starts, naming the field or the run, exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic.store.snapshot_store import SnapshotStore
from trainer.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny.toml")


def _fit(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["fit", TINY, *args]) == 2
    return capsys.readouterr().err


def test_bad_config_values_fail_fast(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = _fit(capsys, "--run-dir", str(tmp_path), "--set", "data.global_batch=7")
    assert "data.global_batch" in err and "multiple of data.microbatch_size" in err
    err = _fit(capsys, "--run-dir", str(tmp_path), "--set", "optim.lrr=1")
    assert "unknown key(s) ['lrr'] in [optim]" in err
    assert _fit(capsys, "--set", "steps=3").count("snapshots.run_uri") == 1  # no --run-dir


def test_missing_recipe(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["fit", str(tmp_path / "nope.toml"), "--run-dir", str(tmp_path)]) == 2
    assert "no such file" in capsys.readouterr().err


def test_unreachable_run_uri(
    capsys: pytest.CaptureFixture[str], s3_endpoint: object, tmp_path: Path
) -> None:
    err = _fit(capsys, "--run-dir", "s3://no-such-bucket-baton/runs/x")
    assert "not reachable or not writable" in err and "no-such-bucket-baton" in err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    err = _fit(capsys, "--run-dir", str(blocker / "run"))
    assert "not reachable or not writable" in err


def test_run_dir_of_another_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    # A run directory whose committed snapshot came from a wider model.
    store.ensure_run_json({"config": {"model": {"d_model": 999}, "data": {"seq_len": 32}}})
    step_dir = Path(store.step_path(5))
    step_dir.mkdir(parents=True)
    (step_dir / "manifest.json").write_text("{}")
    err = _fit(capsys, "--run-dir", str(tmp_path))
    assert "holds a run of a different model" in err and "999" in err


@pytest.mark.parametrize("text", ["[1, 2]", '"x"', "{not json", "[" * 50_000])
def test_an_unreadable_run_json_is_absent_not_a_traceback(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str) -> None:
    # run.json is what a run says of itself: untrusted. Not an object (or not JSON) reads as
    # none; the run's own snapshots still decide what it holds.
    store = SnapshotStore(str(tmp_path))
    Path(store.path("run.json")).write_text(text)
    assert store.read_run_json() is None
    step_dir = Path(store.step_path(5))
    step_dir.mkdir(parents=True)
    (step_dir / "manifest.json").write_text("{}")
    from trainer.config import load_recipe
    from trainer.run.run_dir import check_continuation

    cfg = load_recipe(TINY, [f'snapshots.run_uri="{tmp_path}"'])
    check_continuation(cfg, fingerprint=None, store=store)  # nothing to compare: no refusal


def test_a_run_json_of_sessions_that_never_committed_is_replaced(tmp_path: Path) -> None:
    # A session that died before its first commit left its recipe's run.json: the next
    # session's recipe replaces it (else, once that one commits, its own recipe would be
    # refused). Once a snapshot is committed, the first writer's stays.
    store = SnapshotStore(str(tmp_path))
    store.ensure_run_json({"config": {"seed": 1}})
    store.ensure_run_json({"config": {"seed": 2}})
    assert store.read_run_json() == {"config": {"seed": 2}}
    step_dir = Path(store.step_path(5))
    step_dir.mkdir(parents=True)
    (step_dir / "manifest.json").write_text("{}")
    store.ensure_run_json({"config": {"seed": 3}})
    assert store.read_run_json() == {"config": {"seed": 2}}
