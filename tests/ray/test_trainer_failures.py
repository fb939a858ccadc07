"""No endless restart loops, no version skew (issue 13, point 7).

- The failure policy (`trainer.on_ray.failures.FatalAwareFailurePolicy`) decides on constructed
  Ray Train errors, no cluster: a worker's `FatalRunError` RAISEs at once; other errors are
  retried up to `max_failures`, then RAISEd with the count; a stop on a preemption notice is
  not charged to `max_failures`; the verdict survives the trip to the driver.
- The driver's pre-flight (`check_run_dir`) refuses a continuation with another seed,
  seq_len, model shape or dataset, naming the field, both values and the fix; the worker
  (`run_worker`, in-process) refuses the same recipe with the same words, as `FatalRunError`.
- `code_version()` changes when a source file changes; a worker on other code is refused.
- A worker group that cannot start is charged to `max_failures` (Ray Train would retry it
  forever) and logged with the count; before each start the controller says what it waits
  for and how long.
- Two slow tests on a real Ray cluster: a dataset corrupted after pre-flight fails the fit once
  (one worker-group start, no restart) with the worker's message on the driver; a group asking
  for a resource no node has ends the fit after `max_failures`, in one line, with both starts
  and both failures in the controller's log.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
from ray.train import FailureConfig
from ray.train.v2._internal.execution.failure_handling import (
    DefaultFailurePolicy,
    FailureDecision,
)
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
from ray.train.v2.api.exceptions import WorkerGroupError

from elastic.errors import FatalRunError, StorageUnavailableError
from elastic.store.snapshot_store import SnapshotStore
from elastic.version import code_version, package_dirs, package_version, source_digest
from trainer.config import FitConfig, ScalingSettings, load_recipe
from trainer.on_ray.failures import FatalAwareFailurePolicy, RunFailedError, run_failed_error
from trainer.on_ray.scaling import BatonTorchTrainer
from trainer.run.preflight import dataset_fingerprint
from trainer.run.run_dir import RunDirError, check_run_dir
from trainer.train.loop import WorkerEnv, dataset_errors_are_fatal, run_worker
from trainer.train.session import PreemptedError

ROOT = Path(__file__).resolve().parents[2]


def _group_error(failures: dict[int, Exception], text: str | None = None) -> WorkerGroupError:
    return WorkerGroupError(text or "\n".join(str(e) for e in failures.values()), failures)


def _as_the_driver_gets_it(error: WorkerGroupError) -> WorkerGroupError:
    """Ray ships the controller's error to the driver through the error's `__reduce__`."""
    rebuild, args = error.__reduce__()
    return rebuild(*args)


# -------------------------------------------------------------------- the failure policy

def test_a_fatal_worker_error_raises_at_once() -> None:
    policy = FatalAwareFailurePolicy(FailureConfig(max_failures=-1))
    error = _group_error({0: FatalRunError("dataset 'd' cannot be used: shard x is corrupt"),
                          1: RuntimeError("gloo: connection reset by peer")})
    assert policy.make_decision(error) == FailureDecision.RAISE
    failed = run_failed_error(_as_the_driver_gets_it(error))
    assert failed.fatal and failed.restarts == 0
    assert str(failed) == "dataset 'd' cannot be used: shard x is corrupt (after 0 restarts)"


def test_a_fatal_error_known_only_by_its_traceback_text_raises_too() -> None:
    """If the controller could not rebuild the worker's exception, its traceback text is
    what survives (Ray Train's error message holds it)."""
    text = ("[Rank 0 Error Snippet]:\nTraceback (most recent call last):\n  ...\n"
            "elastic.errors.FatalRunError: seed: the run in r was made with seed = 0\n")
    error = _group_error({0: RuntimeError("could not deserialize")}, text)
    assert FatalAwareFailurePolicy(FailureConfig()).make_decision(error) == FailureDecision.RAISE
    assert run_failed_error(error).message == "seed: the run in r was made with seed = 0"


def test_transient_errors_are_retried_until_max_failures_then_raised_with_the_count() -> None:
    policy = FatalAwareFailurePolicy(FailureConfig(max_failures=2))
    decisions = [policy.make_decision(_group_error({0: OSError(f"S3 timeout {i}")}))
                 for i in range(2)]
    assert decisions == [FailureDecision.RETRY] * 2
    last = _group_error({1: RuntimeError("NCCL watchdog\ntimeout")})
    assert policy.make_decision(last) == FailureDecision.RAISE
    failed = run_failed_error(_as_the_driver_gets_it(last))
    assert not failed.fatal and failed.restarts == 2
    assert str(failed) == ("gave up after 2 restarts (scaling.max_failures = 2); last error: "
                           "RuntimeError: NCCL watchdog timeout")


def test_a_stop_on_a_preemption_notice_is_not_charged_to_max_failures() -> None:
    policy = FatalAwareFailurePolicy(FailureConfig(max_failures=0, max_preemption_failures=-1))
    for _ in range(3):
        notice = _group_error({0: PreemptedError("preempted at step 8 (signal)")})
        assert policy.make_decision(notice) == FailureDecision.RETRY
    assert policy.make_decision(_group_error({0: ValueError("x")})) == FailureDecision.RAISE


def test_a_group_that_cannot_start_is_charged_to_max_failures_and_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Ray Train retries a start that times out forever by default (a controller error):
    here it shares `max_failures` with the worker errors, and every failed start is logged
    with the count; before each start the controller says what it waits for, how long."""
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    from ray.train.v2._internal.execution.scaling_policy import ResizeDecision
    from ray.train.v2.api.exceptions import ControllerError

    from trainer.on_ray.failures import StartReport

    policy = FatalAwareFailurePolicy(FailureConfig(max_failures=2))
    logger = logging.getLogger("ray.train.baton_scaling")  # Ray's loggers do not propagate
    logger.addHandler(caplog.handler)
    with caplog.at_level("INFO", logger="ray.train.baton_scaling"):
        StartReport().before_controller_execute_resize_decision(
            ResizeDecision(num_workers=2, resources_per_worker={"CPU": 1.0}))
        assert policy.make_decision(_group_error({0: OSError("reset")})) == FailureDecision.RETRY
        start = ControllerError(WorkerGroupStartupTimeoutError(num_workers=2))
        assert policy.make_decision(start) == FailureDecision.RETRY
        assert policy.make_decision(start) == FailureDecision.RAISE  # 3 failures > 2
    logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records]
    assert ("Baton: starting a worker group of 2 worker(s) ({CPU: 1} each); waiting up to 60 s "
            "for Ray to place and start them (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S)") in lines
    assert any(line.startswith("Baton: the worker group did not start (The worker group "
                               "startup timed out after 60.0 seconds waiting for 2 workers); "
                               "failure 2 of max_failures=2: retrying") for line in lines), lines
    assert lines[-1].endswith("failure 3 of max_failures=2: giving up")
    failed = run_failed_error(start)
    assert "\n" not in str(failed) and "timed out after 60.0 seconds" in str(failed)


def test_an_error_without_a_verdict_is_still_one_line() -> None:
    error = _group_error({0: FatalRunError("bad\ndataset")})
    failed = run_failed_error(error)
    assert failed.fatal and failed.restarts is None and "\n" not in str(failed)


def test_the_trainer_installs_the_policy(monkeypatch: Any) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(DataParallelTrainer, "_initialize_and_run_controller",
                        lambda self, **kw: seen.append(kw["failure_policy"]))
    trainer = BatonTorchTrainer(lambda: None)
    trainer._initialize_and_run_controller(
        failure_policy=DefaultFailurePolicy(FailureConfig(max_failures=3))
    )
    assert type(seen[0]) is FatalAwareFailurePolicy
    assert seen[0].failure_config.max_failures == 3


def test_ray_train_internals_it_relies_on_are_there() -> None:
    """Ray Train hands `fit`'s failure policy to the controller as `failure_policy`, made by
    `create_failure_policy` (a DefaultFailurePolicy), and unwraps worker exceptions into
    `WorkerGroupError.worker_failures`; a Ray upgrade that moves these fails here."""
    import inspect

    from ray.train.v2._internal.execution.failure_handling import create_failure_policy
    from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus

    assert "failure_policy=create_failure_policy(" in inspect.getsource(DataParallelTrainer.fit)
    assert type(create_failure_policy(FailureConfig())) is DefaultFailurePolicy
    assert "_base_exc" in inspect.getsource(WorkerGroupPollStatus.errors.fget)
    # A start failure is charged with Ray Train's count of worker-group failures; the start
    # report runs in the controller hook before every worker-group start.
    assert DefaultFailurePolicy(FailureConfig())._worker_group_failures == 0
    from ray.train.v2._internal.execution.controller.controller import TrainController

    assert '"before_controller_execute_resize_decision", decision' in inspect.getsource(
        TrainController._execute_resize_decision)


def test_max_failures_is_finite_by_default() -> None:
    assert ScalingSettings().max_failures == 10


# -------------------------------------------------------------------- pre-flight and worker

@pytest.fixture(scope="module")
def committed_run(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: str) -> FitConfig:
    """A run directory with one committed snapshot (step 2), made in-process without Ray."""
    run = tmp_path_factory.mktemp("failures") / "run"
    cfg = _recipe(run, tiny_dataset)
    run_worker(cfg, WorkerEnv())
    assert SnapshotStore(str(run)).committed_steps() == [2]
    return cfg


def _recipe(run: Path, dataset: str, *overrides: str) -> FitConfig:
    return load_recipe(ROOT / "recipes" / "tiny.toml", [
        f'snapshots.run_uri="{run}"', f'data.uri="{dataset}"', "steps=2",
        "snapshots.snapshot_every=2", "eval.every=0", *overrides,
    ])


def _continue_with(cfg: FitConfig, *overrides: str) -> FitConfig:
    return _recipe(Path(cfg.snapshots.run_uri), cfg.data.uri, *overrides)


@pytest.fixture(scope="module")
def seq16_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A dataset of 16-token sequences: a recipe with data.seq_len = 16 is consistent with
    it, so what refuses that recipe for the run is the continuation check alone."""
    from data_state import prepare_corpus

    out = str(tmp_path_factory.mktemp("seq16") / "corpus")
    prepare_corpus(None, out, seq_len=16, max_bytes=300_000, progress=False)
    return out


@pytest.mark.parametrize(("override", "field", "saved", "new"), [
    ("seed=1", "seed", "0", "1"),
    ("data.seq_len=16", "data.seq_len", "32", "16"),
    ("model.d_model=64", "model.d_model", "32", "64"),
])
def test_preflight_refuses_a_changed_trajectory_field(
    committed_run: FitConfig, seq16_dataset: str, override: str, field: str, saved: str,
    new: str,
) -> None:
    cfg = _continue_with(committed_run, override)
    if field == "data.seq_len":
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, uri=seq16_dataset))
    with pytest.raises(RunDirError) as info:
        check_run_dir(cfg)
    message = str(info.value)
    assert message.startswith(f"{field}: ")
    assert f"made with {field} = {saved}" in message and f"asks for {new}" in message
    assert f"--set {field}={saved}" in message
    assert "original value" in message and "another --run-dir" in message


def test_preflight_allows_what_a_continued_run_may_change(committed_run: FitConfig) -> None:
    cfg = _continue_with(committed_run, "model.checkpoint_blocks=true", "data.global_batch=16")
    assert check_run_dir(cfg) == 2
    # The learning-rate schedule only when asked (issue 17: --reschedule).
    cfg = _continue_with(committed_run, "optim.lr=1e-3", "steps=4")
    with pytest.raises(RunDirError,
                       match="^steps: .*steps = 2, this recipe asks for 4.*--reschedule"):
        check_run_dir(cfg)
    assert check_run_dir(cfg, reschedule=True) == 2


def test_preflight_refuses_another_dataset(
    committed_run: FitConfig, tmp_path: Path
) -> None:
    from data_state import prepare_corpus

    other = str(tmp_path / "other")
    prepare_corpus(None, other, seq_len=32, max_bytes=300_000, progress=False)
    cfg = dataclasses.replace(committed_run,
                              data=dataclasses.replace(committed_run.data, uri=other))
    with pytest.raises(RunDirError) as info:
        check_run_dir(cfg)
    message = str(info.value)
    assert message.startswith("data.uri: ")
    assert dataset_fingerprint(committed_run.data.uri) in message
    assert dataset_fingerprint(other) in message
    assert "another --run-dir" in message


def test_the_worker_refuses_what_the_preflight_refuses(committed_run: FitConfig) -> None:
    cfg = _continue_with(committed_run, "seed=1", "steps=4")
    with pytest.raises(RunDirError) as preflight:
        check_run_dir(cfg)
    with pytest.raises(FatalRunError) as worker:
        run_worker(cfg, WorkerEnv())
    assert str(worker.value) == str(preflight.value)
    assert SnapshotStore(cfg.snapshots.run_uri).committed_steps() == [2]  # nothing written


def test_every_snapshot_unusable_is_fatal_not_a_fresh_start(tmp_path: Path,
                                                             tiny_dataset: str) -> None:
    """When every committed snapshot is definitely corrupt, a restart would quietly train
    from step 0: the worker fails the run once instead, the snapshot kept in quarantine."""
    cfg = _recipe(tmp_path / "run", tiny_dataset)
    run_worker(cfg, WorkerEnv())
    store = SnapshotStore(cfg.snapshots.run_uri)
    (shard,) = [n for n in store.step_files(2) if n.endswith(".safetensors")]
    path = Path(store.step_path(2, shard))
    data = bytearray(path.read_bytes())
    data[-8:] = b"\xff" * 8
    path.write_bytes(bytes(data))
    with pytest.raises(FatalRunError, match="quarantine"):
        run_worker(cfg, WorkerEnv())  # the same recipe: a schedule change would be refused first
    assert store.committed_steps() == []
    assert [row["step"] for row in store.quarantined()] == [2]
    with pytest.raises(RunDirError, match="no committed snapshot, but 1 quarantined"):
        check_run_dir(_continue_with(cfg, "steps=4"))  # and the driver says so next time


def test_a_missing_dataset_is_fatal_in_the_worker(tmp_path: Path) -> None:
    cfg = _recipe(tmp_path / "run", str(tmp_path / "no-such-dataset"))
    with pytest.raises(FatalRunError, match="no-such-dataset.*cannot be used"):
        run_worker(cfg, WorkerEnv())


def test_storage_that_does_not_answer_stays_retryable() -> None:
    for transient in (StorageUnavailableError("s3 did not answer in 30 s"),
                      OSError("connection reset")):
        with pytest.raises(type(transient)) as info, dataset_errors_are_fatal("s3://b/d"):
            raise transient
        assert not isinstance(info.value, FatalRunError)
    with pytest.raises(FatalRunError), dataset_errors_are_fatal("d"):
        raise FileNotFoundError("d/dataset.json")


# -------------------------------------------------------------------- code version

def test_code_version_changes_when_a_source_file_changes(tmp_path: Path) -> None:
    copies = []
    for src in package_dirs():
        dst = tmp_path / src.name
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        copies.append(dst)
    before = source_digest(copies)
    assert before == source_digest(package_dirs())  # a copy of the same code: same digest
    target = tmp_path / "trainer" / "train" / "loop.py"
    target.write_text(target.read_text() + "\n# one more line\n")
    edited = source_digest(copies)
    assert edited != before
    (tmp_path / "elastic" / "extra.py").write_text("")
    assert source_digest(copies) not in (before, edited)
    assert code_version() == f"{package_version()}+{before}"


def test_a_worker_on_other_code_is_refused() -> None:
    from trainer.on_ray.elastic_trainer import check_code_version

    check_code_version(code_version())  # the same code: no error
    check_code_version(None)  # the driver turned the check off
    with pytest.raises(FatalRunError) as info:
        check_code_version("0.0.9+000000000000")
    message = str(info.value)
    assert f"runs Baton {code_version()}, the driver 0.0.9+000000000000" in message
    assert "cluster.yaml pins it" in message


# -------------------------------------------------------------------- on a Ray cluster

def _corrupt_every_row_group(dataset: str) -> None:
    """Flip a byte inside every row group of the train split; footers stay readable, so the
    dataset opens (and passes pre-flight) and fails at the first read."""
    from data_state import storage
    from data_state.dataset import read_manifest
    from data_state.shards import ShardReader

    manifest = read_manifest(dataset)
    io, root = storage.resolve(dataset)
    for info in manifest.split("train").shards:
        path = storage.join(root, info.path)
        reader = ShardReader(io, path, info, seq_len=manifest.seq_len,
                             dtype=manifest.token_dtype).open()
        blob = bytearray(Path(path).read_bytes())
        for group in range(reader.num_row_groups):
            start, end = reader.byte_range(group)
            blob[(start + end) // 2] ^= 0xFF
        Path(path).write_bytes(bytes(blob))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_fatal_worker_error_fails_baton_fit_once_in_one_line(
    tmp_path: Path, tiny_dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`baton fit` as a user runs it: relative paths, and a Ray of its own. The workers' working
    directory is Ray Train's, not the driver's, so the driver hands them absolute paths; Ray's
    local processes end with the thread that started them, so the driver starts Ray in its
    main thread (a fit thread that started it took GCS down with it when the fit failed: the
    driver waited 60 s on a dead GCS and exited without the worker's message)."""
    import subprocess
    import sys

    from trainer.on_ray.elastic_trainer import SKIP_CODE_CHECK_ENV
    from trainer.run.metrics import read_records

    shutil.copytree(tiny_dataset, tmp_path / "data")
    _corrupt_every_row_group(str(tmp_path / "data"))  # passes pre-flight, fails at first read
    # The checkout this runs from may be edited by others meanwhile: not what is tested here.
    monkeypatch.setenv(SKIP_CODE_CHECK_ENV, "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "fit", str(ROOT / "recipes" / "tiny.toml"),
         "--run-dir", "run", "--set", 'data.uri="data"', "--set", "steps=8",
         "--set", "eval.every=0", "--set", "scaling.min_workers=1",
         "--set", "scaling.max_workers=1", "--set", "scaling.max_failures=3"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 1 and len(errors) == 1, (out.stdout, out.stderr)
    dataset = str(tmp_path / "data")
    assert errors[0].startswith(f"error: dataset {dataset!r} cannot be used: shard "), errors
    assert "corrupt" in errors[0] and errors[0].endswith("(after 0 restarts)"), errors
    assert "GCS" not in out.stdout + out.stderr
    starts = [r for r in read_records(str(tmp_path / "run")) if r["kind"] == "start"]
    assert len(starts) == 1, f"Ray Train restarted the worker group: {starts}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_group_that_cannot_start_ends_the_fit_at_max_failures_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker group Ray cannot place (a resource no node has) is not retried forever: each
    failed start counts against `max_failures`, the fit fails in one line, and the
    controller's log said before each start what it waited for and how long."""
    import ray
    from ray.train import RunConfig, ScalingConfig

    from trainer.on_ray.elastic_trainer import SKIP_CODE_CHECK_ENV, ElasticTorchTrainer
    from trainer.on_ray.local_cluster import LocalCluster
    from trainer.on_ray.monitor import NAMESPACE

    monkeypatch.setenv(SKIP_CODE_CHECK_ENV, "1")
    local = LocalCluster(worker_nodes=1)
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "3")  # to the controller
    try:
        ray.init(address=local.address, namespace=NAMESPACE, log_to_driver=False)
        logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
        trainer = ElasticTorchTrainer(
            lambda: None, run_uri=str(tmp_path / "run"),
            scaling_config=ScalingConfig(num_workers=1,
                                         resources_per_worker={"CPU": 1, "not_here": 1}),
            run_config=RunConfig(name="no-start", storage_path=str(tmp_path / "ray"),
                                 failure_config=FailureConfig(max_failures=1)))
        with pytest.raises(RunFailedError) as info:
            trainer.fit()
    finally:
        ray.shutdown()
        local.shutdown()
    assert "\n" not in str(info.value)
    assert "timed out after 3.0 seconds waiting for 1 workers" in str(info.value)
    said = "".join(p.read_text(errors="replace") for p in logs.rglob("*app-controller*.log"))
    assert said.count("Baton: starting a worker group of 1 worker(s) ({CPU: 1, not_here: 1} "
                      "each); waiting up to 3 s") == 2, said[-2000:]
    assert "failure 1 of max_failures=1: retrying" in said
    assert "failure 2 of max_failures=1: giving up" in said
