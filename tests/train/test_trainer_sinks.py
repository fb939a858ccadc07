"""Metrics sinks and [logging]: TensorBoard and MLflow files read back with their own readers,
each step logged once across restarts and driver sessions; a disabled sink imports nothing;
[logging] is validated like every section (no Ray)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import ConfigError, LoggingConfig, load_recipe
from trainer.run.sinks import SinkSet, open_sinks

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny.toml"


def _records(first: int, last: int, *, world_size: int = 2, shift: float = 0.0) -> list[dict]:
    """Step records whose loss identifies the step (and `shift` a redo of it)."""
    return [{"kind": "step", "attempt": 0, "step": s, "loss": 10.0 - s / 10 + shift,
             "val_loss": 9.0 if s % 4 == 0 else None, "lr": 1e-3, "tokens_per_s": 100.0 * s,
             "world_size": world_size, "snapshot_stall_s": 0.001, "time": float(s)}
            for s in range(first, last + 1)]


def _sinks(tmp_path: Path, **enabled: bool) -> SinkSet:
    return open_sinks(LoggingConfig(**enabled), str(tmp_path), "test-run")


def _tensorboard_scalars(directory: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_sink_logs_each_step_once_across_a_restart_and_a_new_session(
        tmp_path: Path) -> None:
    sinks = _sinks(tmp_path, tensorboard=True)
    sinks.log([{"kind": "start", "attempt": 0, "step": 0, "world_size": 2, "time": 0.0}])
    sinks.log(_records(1, 6))
    # A restart from committed step 4 redoes 5 and 6 (here with a visible difference).
    sinks.log([{"kind": "start", "attempt": 1, "step": 4, "world_size": 1, "time": 7.0}])
    sinks.log(_records(5, 9, world_size=1, shift=0.5))
    sinks.close()
    # The next driver session continues from committed step 8: step 9 is not logged again.
    again = _sinks(tmp_path, tensorboard=True)
    again.log(_records(9, 12, world_size=1, shift=0.5))
    again.close()

    directory = tmp_path / "logs" / "tensorboard"
    loss = _tensorboard_scalars(directory, "baton/loss")
    assert [step for step, _ in loss] == list(range(1, 13))
    by_step = dict(loss)
    assert by_step[6] == pytest.approx(10.0 - 0.6)  # the first completion of step 6 kept
    assert by_step[7] == pytest.approx(10.0 - 0.7 + 0.5)
    assert [s for s, _ in _tensorboard_scalars(directory, "baton/val_loss")] == [4, 8, 12]
    assert dict(_tensorboard_scalars(directory, "baton/world_size"))[9] == 1.0
    assert len(list(directory.glob("events.out.tfevents.*"))) == 2  # one file per session


def test_mlflow_sink_logs_to_a_file_store_readable_with_the_mlflow_client(
        tmp_path: Path) -> None:
    sinks = _sinks(tmp_path, mlflow=True)
    sinks.log(_records(1, 6))
    sinks.log(_records(5, 8, shift=0.5))  # redone after a restart: 5 and 6 skipped
    sinks.close()
    again = _sinks(tmp_path, mlflow=True)  # a new driver session: same MLflow run
    again.log(_records(8, 10, shift=0.5))
    again.close()

    from mlflow.tracking import MlflowClient

    store = tmp_path / "logs" / "mlflow"
    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    experiment = client.get_experiment_by_name("baton")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name == "test-run"
    assert runs[0].info.status == "FINISHED"
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 11))
    assert {m.step: m.value for m in history}[6] == pytest.approx(9.4)
    lr = client.get_metric_history(runs[0].info.run_id, "lr")
    assert len(lr) == 10 and all(m.value == pytest.approx(1e-3) for m in lr)


def test_the_monitor_feeds_the_sinks_and_numbers_its_records(tmp_path: Path) -> None:
    """The monitor actor's logic (no Ray): every record to the metrics files and the sinks,
    each step once across a restart; `since` hands the driver only what is new."""
    from trainer.on_ray.monitor import MonitorState
    from trainer.run.metrics import read_records

    monitor = MonitorState(str(tmp_path), LoggingConfig(tensorboard=True), keep=8)
    assert monitor.start_attempt(0, 2, 0.0) == 0
    for record in _records(1, 6):
        monitor.add({k: v for k, v in record.items() if k not in ("kind", "attempt")})
    first, cursor = monitor.since(0)
    assert [r["kind"] for r in first] == ["start"] + ["step"] * 6
    assert monitor.start_attempt(4, 1, 7.0, optimizer_state=True) == 1
    for record in _records(5, 8, world_size=1, shift=0.5):
        monitor.add({k: v for k, v in record.items() if k not in ("kind", "attempt")})
    new, cursor = monitor.since(cursor)
    assert new[0] == {"kind": "start", "attempt": 1, "step": 4, "world_size": 1, "time": 7.0,
                      "optimizer_state": True}
    assert [r["step"] for r in new[1:]] == [5, 6, 7, 8] and new[1]["attempt"] == 1
    assert monitor.since(cursor) == ([], cursor)
    assert len(monitor.since(0)[0]) == 8  # only the newest `keep` are held
    monitor.flush()  # the end of a fit: metrics written, sinks closed

    loss = _tensorboard_scalars(tmp_path / "logs" / "tensorboard", "baton/loss")
    assert [s for s, _ in loss] == list(range(1, 9))
    assert dict(loss)[6] == pytest.approx(9.4)  # the first completion of step 6
    assert len([r for r in read_records(str(tmp_path)) if r["kind"] == "step"]) == 10


def test_a_disabled_sink_imports_nothing(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from trainer.config import LoggingConfig\n"
        "from trainer.run.sinks import open_sinks\n"
        f"sinks = open_sinks(LoggingConfig(), {str(tmp_path)!r}, 'r')\n"
        "sinks.log([{'kind': 'step', 'step': 1, 'loss': 1.0}]); sinks.close()\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('tensorboard', 'mlflow')\n"
        "          or m.startswith('torch.utils.tensorboard')]\n"
        "assert not loaded, loaded\n"
        "assert not bool(sinks)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
    assert not (tmp_path / "logs").exists()


RUN = ["snapshots.run_uri=runs/test"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ('logging.tensorboard="yes"', r"logging\.tensorboard: must be true or false"),
        ("logging.mlflow=1", r"logging\.mlflow: must be true or false"),
        ('logging.dir="../elsewhere"', r"logging\.dir: must be a relative path inside the run"),
        ('logging.dir="/tmp/logs"', r"logging\.dir: must be a relative path"),
        ('logging.dir=""', r"logging\.dir: must be a relative path"),
        ("logging.wandb=true", r"unknown key\(s\) \['wandb'\] in \[logging\]; valid keys"),
    ],
)
def test_bad_logging_settings_name_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_recipe(RECIPE, RUN + [override])


def test_sinks_need_a_local_run_directory() -> None:
    with pytest.raises(ConfigError, match=r"logging\.mlflow: .*s3://bucket/run"):
        load_recipe(RECIPE, ["snapshots.run_uri=s3://bucket/run", "logging.mlflow=true"])
    cfg = load_recipe(RECIPE, ["snapshots.run_uri=s3://bucket/run"])  # sinks off: fine
    assert not cfg.logging.any_sink


def test_a_missing_extra_is_one_line_naming_the_pip_command(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        load_recipe(RECIPE, RUN + ["logging.tensorboard=true"])
    assert str(err.value) == ("logging.tensorboard: needs the tensorboard extra: pip install "
                              "baton-train[tensorboard] (or set logging.tensorboard = false)")
    load_recipe(RECIPE, RUN + ["logging.mlflow=true"])  # the other extra is there


def test_logging_settings_round_trip_into_run_json() -> None:
    cfg = load_recipe(RECIPE, RUN + ["logging.tensorboard=true", 'logging.dir="tb/x"'])
    assert cfg.to_dict()["logging"] == {"tensorboard": True, "mlflow": False, "dir": "tb/x"}
