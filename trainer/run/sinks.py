"""Optional metrics sinks: TensorBoard event files and an MLflow file store, under the run.

Contract:
- `open_sinks(logging, run_uri, run_name)` returns a `SinkSet` with the sinks `[logging]` enables
  (`tensorboard`, `mlflow`), writing under RUN/`logging.dir` (`tensorboard/`, `mlflow/`). A
  disabled sink imports nothing. An enabled sink whose extra is missing is refused when the
  config is validated (`trainer.config.LoggingConfig`: one line naming
  `pip install baton-train[tensorboard]`), so before Ray starts.
- Sinks run in the run's monitor actor on the head node (`trainer.on_ray.monitor`), next to the
  driver, and receive its records (`trainer.run.metrics` kinds), so training workers need no
  extra packages. From each `step` record they log `loss`, `val_loss`, `lr`,
  `tokens_per_s`, `world_size` and `snapshot_stall_s` (when present) at its `step`.
- Exactly once per step, also across restarts and driver sessions: a sink logs a step only
  if it is above the highest step it already holds (read back from its own files when it
  opens). A step redone after a restart is skipped: by Baton's resume promise (P1) it
  trains to the same values, and its throughput is kept in RUN/metrics. Steps lost in a
  crash before a sink flushed are simply logged when they are redone.
- Metrics never fail a fit: a sink that cannot open, write or close logs one warning
  (`baton.sinks`) and is dropped; the others go on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from elastic.storage import check_below
from trainer.config import LoggingConfig

log = logging.getLogger("baton.sinks")

# Step-record fields a sink logs (under the same names).
LOGGED_FIELDS = ("loss", "val_loss", "lr", "tokens_per_s", "world_size", "snapshot_stall_s")
MLFLOW_EXPERIMENT = "baton"


class MetricsSink(Protocol):
    last_step: int  # highest step this sink holds (-1: none)

    def write(self, step: int, values: dict[str, float]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def log_dir(settings: LoggingConfig, run_uri: str) -> Path:
    """RUN/<logging.dir> as a local path (config validation keeps sinks off s3:// runs)."""
    root = run_uri.removeprefix("file://")
    return Path(root) / settings.dir


def step_values(record: dict[str, Any]) -> dict[str, float]:
    """The numbers a sink logs from one step record (missing and None fields left out)."""
    out = {}
    for name in LOGGED_FIELDS:
        value = record.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)
    return out


class TensorBoardSink:
    """Scalars under `baton/<field>` in event files of RUN/<dir>/tensorboard."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        directory.mkdir(parents=True, exist_ok=True)
        self.last_step = _tensorboard_last_step(directory)
        self._writer = SummaryWriter(log_dir=str(directory))

    def write(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(f"baton/{name}", value, global_step=step)
        self.last_step = step

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _tensorboard_last_step(directory: Path) -> int:
    """The highest step of any scalar already in `directory`'s event files (-1: none)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    last = -1
    for path in sorted(directory.glob("events.out.tfevents.*")):
        try:
            for event in EventFileLoader(str(path)).Load():
                if event.summary.value:
                    last = max(last, event.step)
        except Exception as err:  # noqa: BLE001 - a torn file from a crash: use what was read
            log.warning("tensorboard sink: could not read all of %s (%s)", path.name, err)
    return last


class MLflowSink:
    """One MLflow run per Baton run (its id kept in RUN/<dir>/mlflow/baton_run_id), in a
    file store at RUN/<dir>/mlflow, experiment `baton`."""

    def __init__(self, directory: Path, run_name: str) -> None:
        # MLflow 3 keeps the file store in maintenance mode behind this opt-in; the sqlite
        # store it suggests needs SQLAlchemy, which mlflow-skinny does not bring.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        directory.mkdir(parents=True, exist_ok=True)
        self._client = MlflowClient(tracking_uri=directory.resolve().as_uri())
        id_file = directory / "baton_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if run_id and not _mlflow_run_exists(self._client, run_id):
            run_id = ""
        if not run_id:
            experiment = self._client.get_experiment_by_name(MLFLOW_EXPERIMENT)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self._client.create_experiment(MLFLOW_EXPERIMENT))
            run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
            id_file.write_text(run_id + "\n")
        else:
            self._client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        history = self._client.get_metric_history(run_id, "loss")
        self.last_step = max((m.step for m in history), default=-1)
        self._pending: list[Any] = []

    def write(self, step: int, values: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self._pending.extend(Metric(name, value, now_ms, step) for name, value in values.items())
        self.last_step = step
        if len(self._pending) >= 600:  # MLflow's batch limit is 1000 metrics
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self._client.log_batch(self.run_id, metrics=self._pending)
            self._pending = []

    def close(self) -> None:
        self.flush()
        self._client.set_terminated(self.run_id)


def _mlflow_run_exists(client: Any, run_id: str) -> bool:
    try:
        client.get_run(run_id)
    except Exception:  # noqa: BLE001 - MlflowException for a missing or deleted run
        return False
    return True


class SinkSet:
    """The enabled sinks; `log(records)` passes each step record on, exactly once a step;
    `flush()` writes out what the sinks buffer; `close()` flushes and closes them."""

    def __init__(self, sinks: dict[str, MetricsSink]) -> None:
        self.sinks = sinks

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def log(self, records: Iterable[dict[str, Any]]) -> None:
        for record in records:
            if record.get("kind", "step") != "step" or not isinstance(record.get("step"), int):
                continue
            values = step_values(record)
            for name, sink in list(self.sinks.items()):
                if record["step"] <= sink.last_step:
                    continue  # already logged (a step redone after a restart)
                self._guard(name, sink.write, record["step"], values)

    def flush(self) -> None:
        for name, sink in list(self.sinks.items()):
            self._guard(name, sink.flush)

    def close(self) -> None:
        for name, sink in list(self.sinks.items()):
            self._guard(name, sink.close)
        self.sinks.clear()

    def _guard(self, name: str, call: Any, *args: Any) -> None:
        try:
            call(*args)
        except Exception as err:  # noqa: BLE001 - a sink must never fail the fit
            log.warning("%s sink stopped after an error: %s: %s", name, type(err).__name__, err)
            self.sinks.pop(name, None)


def open_sinks(settings: LoggingConfig, run_uri: str, run_name: str) -> SinkSet:
    """The sinks `settings` enables, opened under RUN/<dir> (module docstring)."""
    root = log_dir(settings, run_uri)
    openers: dict[str, Callable[[], MetricsSink]] = {}
    if settings.tensorboard:
        openers["tensorboard"] = lambda: TensorBoardSink(root / "tensorboard")
    if settings.mlflow:
        openers["mlflow"] = lambda: MLflowSink(root / "mlflow", run_name)
    sinks: dict[str, MetricsSink] = {}
    for name, open_sink in openers.items():
        try:
            # Their libraries write there themselves: a link on the way inside the run would
            # send their files anywhere, so it is refused first (RefusedEntryError).
            check_below(run_uri.removeprefix("file://"), str(root / name), final=True)
            sinks[name] = open_sink()
        except Exception as err:  # noqa: BLE001 - an unwritable log dir never stops a fit
            log.warning("%s sink not opened (%s: %s); the fit continues without it",
                        name, type(err).__name__, err)
    return SinkSet(sinks)
