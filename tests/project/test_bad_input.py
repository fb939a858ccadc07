"""Bad input gives one clear line on stderr and a non-zero exit, never a traceback (issue 13).

Every case runs `baton ...` in-process through `trainer.cli.main` and checks the exit code,
that stderr is exactly one line naming the field or argument, and that no traceback was
printed. No Ray cluster is started: each case must fail before Ray would.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from trainer.cli import main
from trainer.config import FitConfig, ScalingSettings, SnapshotConfig
from trainer.run.metrics import MetricsWriter, read_records
from trainer.run.preflight import check_worker_fits

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny.toml")


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], code: int,
                    *needles: str) -> str:
    """Run `baton argv`; assert the exit code and one stderr line containing `needles`."""
    assert main(argv) == code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# --------------------------------------------------------------------------- recipe types


def test_string_where_a_recipe_wants_an_integer(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    recipe = tmp_path / "quoted.toml"
    recipe.write_text('steps = "10"\n')
    line = _one_line_error(capsys, ["fit", str(recipe), "--run-dir", str(tmp_path / "r")], 2,
                           "steps", "must be an integer")
    assert "remove the quotes" in line


@pytest.mark.parametrize(
    ("override", "field", "wanted"),
    [
        ("optim.lr=abc", "optim.lr", "must be a number"),
        ("steps=true", "steps", "must be an integer"),  # a bool is not an integer
        ("model.d_model=32.0", "model.d_model", "must be an integer"),
        ("scaling.use_gpu=1", "scaling.use_gpu", "true or false"),
        ("sketch.include='blocks.*'", "sketch.include", "list of strings"),
        ("sketch.include=['a', 1]", "sketch.include", "list of strings"),
        ("sketch.min_saving='0.1'", "sketch.min_saving", "remove the quotes"),
        ("sketch.keep_gate=1", "sketch.keep_gate", "true or false"),
        ("optim.lr=nan", "optim.lr", "finite"),
        ("model.mlp_recompute=3", "model.mlp_recompute", "must be a string"),
        # Integers beyond 64 bits (torch and the workers take int64): refused, never an
        # OverflowError or a worker's failure.
        ("steps=" + "1" + "0" * 30, "steps", "[-2**63, 2**63)"),
        ("model.d_model=" + "1" + "0" * 30, "model.d_model", "[-2**63, 2**63)"),
        ("optim.lr=" + "1" + "0" * 400, "optim.lr", "finite"),
        ('logging.dir="a\\u0000b"', "logging.dir", "control characters"),
        ('name="x/../../escaped"', "name", "plain name"),
        ('name=".."', "name", "plain name"),
        ("name=1.0", "name", "must be a string"),
    ],
)
def test_overrides_of_the_wrong_type(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, override: str, field: str, wanted: str
) -> None:
    _one_line_error(
        capsys, ["fit", TINY, "--run-dir", str(tmp_path / "r"), "--set", override], 2,
        f"{field}:", wanted,
    )


def test_recipes_that_are_not_toml_text_are_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    deep = tmp_path / "deep.toml"
    deep.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    _one_line_error(capsys, ["fit", str(deep), "--run-dir", str(tmp_path / "r")], 2,
                    f"recipe {deep}", "nested too deeply")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"steps = 1\n\xff\xfe\x00")
    _one_line_error(capsys, ["fit", str(binary), "--run-dir", str(tmp_path / "r")], 2,
                    f"recipe {binary}", "not UTF-8")
    _one_line_error(capsys, ["fit", TINY, "--run-dir", str(tmp_path / "r"), "--set",
                             "steps=" + "[" * 3000 + "]" * 3000], 2, "--set steps",
                    "nested too deeply")
    _one_line_error(capsys, ["sketch-plan", TINY, "--rows", str(1 << 40)], 2, "--rows")
    for pace in ("nan", "-1", "inf"):
        _one_line_error(capsys, ["fit", TINY, "--run-dir", str(tmp_path / "r"), "--pace",
                                 pace], 2, "--pace")
    assert not (tmp_path / "r").exists()


def test_integers_are_fine_where_a_float_is_expected() -> None:
    cfg = FitConfig(snapshots=SnapshotConfig(run_uri="runs/x"),
                    scaling=ScalingSettings(cpus_per_worker=2))
    assert cfg.scaling.cpus_per_worker == 2.0 and type(cfg.scaling.cpus_per_worker) is float


# --------------------------------------------------------------------------- fit: data, CPUs


def test_data_uri_that_holds_no_dataset(capsys: pytest.CaptureFixture[str],
                                        tmp_path: Path) -> None:
    run = str(tmp_path / "r")
    missing = tmp_path / "no-such-dataset"
    _one_line_error(capsys, ["fit", TINY, "--run-dir", run, "--set",
                             f"data.uri={json.dumps(str(missing))}"], 2, "data.uri")
    missing.mkdir()  # a directory without dataset.json is the same error
    _one_line_error(capsys, ["fit", TINY, "--run-dir", run, "--set",
                             f"data.uri={json.dumps(str(missing))}"], 2, "data.uri",
                    "not a prepared dataset")


def test_data_uri_on_s3_that_does_not_exist(
    capsys: pytest.CaptureFixture[str], s3_bucket: str, tmp_path: Path
) -> None:
    uri = f"s3://{s3_bucket}/no-such-dataset"
    _one_line_error(capsys, ["fit", TINY, "--run-dir", str(tmp_path / "r"), "--set",
                             f"data.uri={json.dumps(uri)}"], 2, "data.uri", "not a prepared")


def test_data_uri_with_other_sequence_length(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_dataset: str
) -> None:
    _one_line_error(capsys, ["fit", TINY, "--run-dir", str(tmp_path / "r"), "--set",
                             f"data.uri={json.dumps(tiny_dataset)}", "--set", "data.seq_len=64"],
                    2, "data.seq_len", "32")


def test_more_cpus_per_worker_than_this_machine_has(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    _one_line_error(capsys, ["fit", TINY, "--run-dir", str(tmp_path / "r"), "--set",
                             "scaling.cpus_per_worker=1000"], 2,
                    "scaling.cpus_per_worker", f"<= {os.cpu_count()}")
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_cluster_nodes_too_small_for_a_worker() -> None:
    """The check `trainer.on_ray.ray_fit` runs after `ray.init` on a cluster without autoscaler."""
    cfg = FitConfig(snapshots=SnapshotConfig(run_uri="runs/x"),
                    scaling=ScalingSettings(cpus_per_worker=4))
    check_worker_fits(cfg, [{"CPU": 2.0}, {"CPU": 4.0}], "the Ray cluster")  # one node fits
    with pytest.raises(ValueError, match=r"scaling\.cpus_per_worker.*more than 2"):
        check_worker_fits(cfg, [{"CPU": 2.0}], "the Ray cluster")
    gpu = FitConfig(snapshots=SnapshotConfig(run_uri="runs/x"),
                    scaling=ScalingSettings(use_gpu=True))
    with pytest.raises(ValueError, match=r"scaling\.use_gpu"):
        check_worker_fits(gpu, [{"CPU": 64.0}], "the Ray cluster")
    with pytest.raises(ValueError, match="GPU node"):  # the CPUs must be on the GPU node
        check_worker_fits(gpu, [{"CPU": 64.0}, {"CPU": 0.5, "GPU": 1.0}], "the Ray cluster")


# --------------------------------------------------------------------------- baton data


def test_data_prepare_into_an_unwritable_place(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    _one_line_error(capsys, ["data", "prepare", "--out", "/proc/x", "--quiet"], 2, "--out",
                    "not writable")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _one_line_error(capsys, ["data", "prepare", "--out", str(blocker), "--quiet"], 2, "--out")
    _one_line_error(capsys, ["data", "prepare", "--out", "gs://b/x", "--quiet"], 2,
                    "--out", "s3://")


def test_failed_prepare_leaves_no_directories(capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    out = tmp_path / "a" / "b"
    _one_line_error(capsys, ["data", "prepare", "--out", str(out), "--max-bytes", "1",
                             "--quiet"], 2, "no source files")
    assert list(tmp_path.iterdir()) == []


def test_data_inspect_of_something_else(capsys: pytest.CaptureFixture[str],
                                        tmp_path: Path) -> None:
    _one_line_error(capsys, ["data", "inspect", str(ROOT / "README.md")], 2, "README.md",
                    "not a prepared dataset")
    _one_line_error(capsys, ["data", "inspect", str(tmp_path)], 2, "not a prepared dataset")
    _one_line_error(capsys, ["data", "inspect", ""], 2, "empty")
    _one_line_error(capsys, ["data", "inspect", "gs://b/x"], 2, "s3://")


def test_data_inspect_of_an_unknown_split(capsys: pytest.CaptureFixture[str],
                                          tiny_dataset: str) -> None:
    _one_line_error(capsys, ["data", "inspect", tiny_dataset, "--split", "test"], 2,
                    "--split", "train")


# --------------------------------------------------------------------------- snapshots, report


@pytest.mark.parametrize("action", ["ls", "show", "verify", "export"])
def test_every_snapshots_command_refuses_bad_run_uris(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, action: str
) -> None:
    out = tmp_path.parent / f"{tmp_path.name}-m.safetensors"  # outside the run below
    extra = ["--out", str(out)] if action == "export" else []
    _one_line_error(capsys, ["snapshots", action, "", *extra], 2, "empty")
    _one_line_error(capsys, ["snapshots", action, "gs://bucket/run", *extra], 2,
                    "gs://", "local paths and s3:// only")
    _one_line_error(capsys, ["snapshots", action, str(tmp_path / "nope"), *extra], 2,
                    "does not exist")
    _one_line_error(capsys, ["snapshots", action, str(ROOT / "README.md"), *extra], 2,
                    "not a run directory")
    if action != "ls":  # an existing run without snapshots: exit 1, as for a missing step
        _one_line_error(capsys, ["snapshots", action, str(tmp_path), *extra], 1,
                        "no committed snapshot")


def test_snapshots_export_out_must_be_a_file_outside_the_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from elastic.settings import SnapshotSettings
    from elastic.snapshotter import Snapshotter
    from elastic.testing import build, train_step

    run = tmp_path / "run"
    ts = build(seed=1)
    snap = Snapshotter(str(run), ts.registry, settings=SnapshotSettings(snapshot_every=1))
    train_step(ts, 1)
    snap.after_step(1)
    snap.close()
    manifest = next(run.glob("snapshots/*/manifest.json"))
    before = manifest.read_bytes()
    export = ["snapshots", "export", str(run), "--out"]
    _one_line_error(capsys, [*export, str(tmp_path)], 2, "is a directory")
    _one_line_error(capsys, [*export, ""], 2, "--out is empty")
    _one_line_error(capsys, [*export, str(manifest)], 2, "inside the run directory")
    assert manifest.read_bytes() == before  # the committed snapshot is untouched
    assert main([*export, str(tmp_path / "m.safetensors")]) == 0


def test_snapshots_export_to_an_unwritable_file(capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    _one_line_error(capsys, ["snapshots", "export", str(tmp_path), "--out", "/proc/x/m.st"], 2,
                    "--out")


def test_report_of_bad_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out, run = str(tmp_path / "r.png"), tmp_path / "run"
    run.mkdir()
    _one_line_error(capsys, ["report", "", "--out", out], 2, "empty")
    _one_line_error(capsys, ["report", "gs://b/run", "--out", out], 2, "gs://", "s3://")
    _one_line_error(capsys, ["report", str(tmp_path / "nope"), "--out", out], 2,
                    "does not exist")
    _one_line_error(capsys, ["report", str(run), "--out", out], 2, "no metrics")
    (run / "metrics").mkdir()
    (run / "metrics" / "part-x-000000.jsonl").write_text('{"kind": "step", "st')
    _one_line_error(capsys, ["report", str(run), "--out", out], 2, "no metrics")


def test_report_to_an_unwritable_file(capsys: pytest.CaptureFixture[str],
                                      tmp_path: Path) -> None:
    _fake_run(str(tmp_path))
    _one_line_error(capsys, ["report", str(tmp_path), "--out", "/proc/x/r.png"], 2,
                    "/proc/x/r.png", "--out")


# --------------------------------------------------------------------------- safety net


def _raising(exc: BaseException) -> Callable[[object], int]:
    """A stand-in command that raises `exc`."""

    def command(_args: object) -> int:
        raise exc
    return command


def test_safety_net_turns_escaping_errors_into_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainer.cli.report

    monkeypatch.delenv("BATON_DEBUG", raising=False)
    monkeypatch.setattr(trainer.cli.report, "_cmd_demo", _raising(ValueError("bad\nthing")))
    assert _one_line_error(capsys, ["demo"], 2) == "error: bad thing"
    monkeypatch.setattr(trainer.cli.report, "_cmd_demo",
                        _raising(PermissionError(13, "Permission denied", "/x")))
    _one_line_error(capsys, ["demo"], 1, "error:", "Permission denied")
    monkeypatch.setenv("BATON_DEBUG", "1")  # the traceback, for debugging
    with pytest.raises(PermissionError):
        main(["demo"])
    monkeypatch.setattr(trainer.cli.report, "_cmd_demo", _raising(KeyboardInterrupt()))
    monkeypatch.delenv("BATON_DEBUG")
    with pytest.raises(KeyboardInterrupt):
        main(["demo"])


def test_no_traceback_from_the_installed_command(tmp_path: Path) -> None:
    """The same through the real entry point (a subprocess), for one case per group."""
    baton = str(Path(sys.executable).with_name("baton"))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "BATON_DEBUG")}
    for argv in (["fit", TINY, "--run-dir", str(tmp_path / "r"), "--set", "steps=true"],
                 ["data", "inspect", str(ROOT / "README.md")],
                 ["snapshots", "verify", "gs://b/x"]):
        done = subprocess.run([baton, *argv], capture_output=True, text=True, env=env,
                              timeout=120)
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


# --------------------------------------------------------------------------- metrics


def _fake_run(run: str) -> None:
    writer = MetricsWriter(run, flush_every=2)
    writer.add({"kind": "start", "attempt": 0, "step": 0, "world_size": 1, "time": 1.0})
    for step in (1, 2, 3):
        writer.add({"kind": "step", "attempt": 0, "step": step, "loss": 5.0, "val_loss": None,
                    "lr": 1e-3, "tokens_per_s": 10.0, "world_size": 1, "peak_rss_mb": 1.0,
                    "time": 1.0 + step})
    writer.flush()


def test_metrics_writes_leave_no_partial_final_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import elastic.storage.storage_io

    _fake_run(str(tmp_path))
    parts = sorted((tmp_path / "metrics").iterdir())
    assert [p.suffix for p in parts] == [".jsonl", ".jsonl"]  # no temporary names left

    def crash(*_args: object) -> None:  # the rename never happens: a crash mid-flush
        raise OSError("disk gone")

    monkeypatch.setattr(elastic.storage.storage_io.os, "replace", crash)
    writer = MetricsWriter(str(tmp_path))
    writer.add({"kind": "start", "attempt": 1, "step": 3, "world_size": 1, "time": 9.0})
    with pytest.raises(OSError, match="disk gone"):
        writer.flush()
    assert sorted(p.name for p in (tmp_path / "metrics").glob("part-*.jsonl")) == [
        p.name for p in parts
    ]
    assert len(read_records(str(tmp_path))) == 4


def test_crafted_metrics_and_run_files_never_break_report_or_runs_ls(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Edited metrics records (unknown kinds, strings where numbers go, numbers beyond 64
    bits) and a lease or session log with such a number: `report` and `runs ls` still work,
    the bad records skipped."""
    run = tmp_path / "runs" / "r"
    _fake_run(str(run))
    big = int("1" + "0" * 400)
    (run / "metrics" / "part-z-000000.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"kind": "note", "time": 3},
        {"kind": "step", "attempt": 0, "step": 9, "loss": 1.0, "tokens_per_s": 1.0,
         "world_size": 1, "time": 5.0, "snapshot_stall_s": "x"},
        {"kind": "step", "attempt": 0, "step": 9, "loss": 1.0, "tokens_per_s": 1.0,
         "world_size": 1, "time": 5.0, "val_loss": "x"},
        {"kind": "step", "attempt": 0, "step": 9, "loss": big, "tokens_per_s": 1.0,
         "world_size": 1, "time": 5.0},
    ]) + "\n")
    records = read_records(str(run))
    assert [r for r in records if r["kind"] == "step" and r["step"] == 9] == []
    assert main(["report", str(run), "--out", str(tmp_path / "r.png")]) == 0
    (run / "lease.json").write_text('{"token": "t", "holder": {}, "epoch": 1, '
                                    f'"expires_at": {big}}}')
    (run / "sessions.json").write_text('{"sessions": [{"from_step": ' + str(big) +
                                       ', "schedule": {}}]}')
    capsys.readouterr()
    assert main(["runs", "ls", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "Traceback" not in out and out.splitlines()[1].split()[0] == "r"


def test_truncated_part_file_is_skipped_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _fake_run(str(tmp_path))
    metrics = tmp_path / "metrics"
    (metrics / "part-z-000000.jsonl").write_text('{"kind": "step", "attempt": 0, "ste')
    (metrics / "part-z-000001.jsonl").write_bytes(b"\xff\xfe not utf-8")
    (metrics / "part-z-000002.jsonl").write_text(
        '{"kind": "step", "step": "x"}\n[1, 2]\n{"kind": "note", "text": "kept"}\n'
    )
    with caplog.at_level(logging.WARNING, logger="trainer.run.metrics"):
        records = read_records(str(tmp_path))
    assert [r["kind"] for r in records].count("step") == 3  # the good parts are all read
    assert {"kind": "note", "text": "kept"} in records  # unknown kinds pass through
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "part-z-000000.jsonl" in message and "part-z-000001.jsonl" in message
