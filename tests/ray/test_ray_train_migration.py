"""The proof is the docs' own loop (issue 30, point 4).

`tests/ray/migration_standard.py` is a Ray Train loop as Ray's "Saving and Loading Checkpoints"
guide writes one (`DataLoader` + `DistributedSampler`, an epoch loop, AdamW, `LambdaLR`
warmup-cosine, `prepare_model`, rank 0 `torch.save` into `ray.train.report(checkpoint=...)`,
`get_checkpoint()` to resume); `tests/ray/migration_baton.py` is its Baton conversion.

- The diff in docs/ray-train-loop.md is exactly `diff -u` of the two files (code, not
  docstrings), and the conversion adds or changes at most 12 lines (the rest is the
  checkpoint code it deletes).
- One slow test runs the converted loop with `ElasticTorchTrainer` on a local multi-node
  cluster (`trainer.on_ray.local_cluster`): a driver given `ScalingConfig(num_workers=3)`
  (made `(1, 3)`, with the warning) stops at UNTIL; a node goes; a new driver continues at 2
  workers; a node is lost after LOSE_AT (the survivor trains on alone in its own process:
  in-process recovery); the code after the loop fails once (a restart: the loop runs its last
  steps again, so that code finds its loop variables).
  Checked on the snapshots and the loop's own records: the final model and AdamW moments
  equal an uninterrupted run's (the same loop in one process, no Ray) to 1e-5 (P1, P2), the
  AdamW step counters equal STEPS (never a cold start), every sample trained exactly once per
  epoch over the steps that count (P5), the stop redid nothing, the node loss at most the
  interrupted step and the restart at most the steps since the last commit (P6), and
  `Result.checkpoint` is the final snapshot and `Result.metrics` the last report.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import migration_baton
import migration_standard
import pytest
from migration_checks import (
    assert_docs_show_the_diff,
    assert_each_step_trains_the_planned_rows,
    assert_ends_where_uninterrupted,
    assert_every_sample_once_per_epoch,
    fit_losing_a_node,
    one_rank_ray_train,
    planned_steps,
    read_records,
    steps_as_last_trained,
    wait,
)

ROOT = Path(__file__).resolve().parents[2]
ITEMS, BATCH, EPOCHS, SNAPSHOT_EVERY = 250, 24, 5, 4
STEPS = EPOCHS * math.ceil(ITEMS / BATCH)  # 11 steps an epoch, the last of 10 samples
UNTIL, LOSE_AT = 17, 30


def test_the_docs_show_the_real_diff_and_it_is_small() -> None:
    assert_docs_show_the_diff(migration_standard, migration_baton,
                              ROOT / "docs" / "ray-train-loop.md")


def _config(tmp: Path, **changes: Any) -> dict[str, Any]:
    return {"seed": 3, "items": ITEMS, "batch_size": BATCH, "epochs": EPOCHS, "lr": 3e-3,
            "warmup": 5, "snapshot_every": SNAPSHOT_EVERY, "log": str(tmp / "steps.jsonl"),
            "pace_s": 0.0, "marker": str(tmp / "failed-once"), **changes}


def _reference(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The converted loop, uninterrupted, in this process (world size 1, no Ray)."""
    from trainer.config import SnapshotConfig
    from trainer.train.session import WorkerContext, open_session, worker_context

    run = tmp / "reference"
    with one_rank_ray_train(monkeypatch):
        with worker_context(WorkerContext(snapshots=SnapshotConfig(run_uri=str(run)))):
            migration_baton.train_func(_config(tmp))
            session = open_session()
            assert session is not None
            session.close()
    return run


def _attempts(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each worker-group attempt, in order: its world size at the start, the processes that
    were its rank 0 (a survivor of in-process recovery takes rank 0 when rank 0 is the one
    lost: the same attempt), the steps they trained. A rank-0 record from a process never seen
    before starts an attempt."""
    attempts: list[dict[str, Any]] = []
    seen: set[int] = set()
    for r in sorted(records, key=lambda r: r["time"]):
        if not r["ids"]:
            continue
        if r["rank"] == 0:
            if r["pid"] not in seen:
                attempts.append({"pids": [], "world_size": r["world_size"], "time": r["time"],
                                 "steps": []})
            if r["pid"] not in attempts[-1]["pids"]:
                attempts[-1]["pids"].append(r["pid"])
            attempts[-1]["steps"].append(r["step"])
        seen.add(r["pid"])
    return attempts


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_converted_docs_loop_survives_a_stop_a_smaller_group_a_node_loss_and_a_late_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray
    import ray.cloudpickle
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    from trainer.on_ray.elastic_trainer import SKIP_CODE_CHECK_ENV
    from trainer.on_ray.local_cluster import LocalCluster
    from trainer.on_ray.monitor import NAMESPACE

    monkeypatch.setenv(SKIP_CODE_CHECK_ENV, "1")  # others may edit the checkout meanwhile
    (tmp_path / "ref").mkdir()
    reference = _reference(tmp_path / "ref", monkeypatch)
    run, log = tmp_path / "run", tmp_path / "steps.jsonl"
    config = _config(tmp_path, pace_s=0.25)

    def run_config(name: str) -> RunConfig:
        return RunConfig(name=f"{name}-{int(time.time())}", storage_path=str(tmp_path / "ray"),
                         failure_config=FailureConfig(max_failures=4))

    # The workers cannot import tests/: ship the loop's code with the function.
    ray.cloudpickle.register_pickle_by_value(migration_baton)
    cluster = LocalCluster(worker_nodes=3)
    out: dict[str, Any] = {}
    try:
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        with pytest.warns(UserWarning, match=r"num_workers=\(1, 3\) instead"):
            first = migration_baton.make_trainer(
                config, str(run), ScalingConfig(num_workers=3, resources_per_worker={"CPU": 1}),
                run_config("first"))
        first.until = UNTIL  # a stop: this driver ends, another continues
        first.fit()
        assert first.stopped_at == UNTIL
        cluster.remove_worker()
        wait(lambda: sum(n["Alive"] for n in ray.nodes()) == 3, 60, "a node to be gone")

        second = migration_baton.make_trainer(
            {**config, "fail_after_loop": True}, str(run),
            ScalingConfig(num_workers=(1, 3), resources_per_worker={"CPU": 1}),
            run_config("second"))
        out = fit_losing_a_node(second.fit, cluster, log, at_step=LOSE_AT, world_size=2)
    finally:
        ray.shutdown()
        cluster.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(migration_baton)
    assert "result" in out, "the second fit did not finish"

    records = read_records(log)
    attempts = _attempts(records)
    assert [a["world_size"] for a in attempts] == [3, 2, 1], attempts
    firsts = [min(a["steps"]) for a in attempts]
    reached = [max(a["steps"]) for a in attempts]
    assert reached[0] == UNTIL and firsts[1] == UNTIL + 1  # the stop redid nothing (P6)
    # The node loss: the survivor is the same process (in-process recovery, no new attempt);
    # it trained on alone, redoing at most the interrupted step.
    survivor = [r for r in records if r["pid"] == attempts[1]["pids"][-1] and r["ids"]]
    assert [r["world_size"] for r in survivor][-1] == 1 and survivor[0]["world_size"] == 2
    steps = [r["step"] for r in survivor]
    assert len(steps) - len(set(steps)) <= 1, steps
    # The late failure restarts the group inside the loop, never past it, redoing at most
    # the steps since the last commit (a snapshot due at an epoch's last step is taken one
    # step later).
    assert reached[1] == STEPS and 1 <= STEPS - firsts[2] + 1 <= SNAPSHOT_EVERY + 1, attempts
    # The code after the loop ran on every rank of the stopped driver, then once at the end
    # (the failing attempt raised before its record), with the loop's variables set.
    ends = [r for r in records if "loss" in r]
    assert sorted(r["step"] for r in ends) == [UNTIL] * 3 + [STEPS], ends
    assert ends[-1]["pid"] in attempts[2]["pids"] and ends[-1]["epoch"] == EPOCHS - 1, ends

    # Each step's ids as the last attempt that trained it trained them (a redone step replaces
    # what it redoes) are the uninterrupted run's ids of that step, which hold every sample
    # once per epoch.
    planned = planned_steps(read_records(tmp_path / "ref" / "steps.jsonl"))
    assert_every_sample_once_per_epoch(planned, STEPS, EPOCHS, ITEMS)
    assert_each_step_trains_the_planned_rows(steps_as_last_trained(records, planned), planned)
    assert_ends_where_uninterrupted(run, reference, tmp_path, STEPS)
    # Result.metrics: the last ray.train.report of the group's first worker (the last epoch's).
    assert out["result"].metrics == {"epoch": EPOCHS - 1, "loss": ends[-1]["loss"]}
    checkpoint = out["result"].checkpoint
    assert checkpoint.path == str(run / "snapshots" / f"{STEPS:09d}")
    with checkpoint.as_directory() as directory:
        assert (Path(directory) / "manifest.json").is_file()
