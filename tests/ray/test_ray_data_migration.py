"""A Ray Data pipeline, resumed exactly once: the guide's loop converted, through a node loss
that takes the group from 3 workers to 2.

`tests/ray/migration_data_standard.py` is a Ray Train loop fed by Ray Data as Ray's guide
writes one (`read_parquet(...).map_batches(preprocess)`, `TorchTrainer(datasets=...)`,
`get_dataset_shard("train").iter_torch_batches(...)`); `tests/ray/migration_data_baton.py` is
its conversion.

- docs/ray-data.md shows exactly `diff -u` of the two (code, not docstrings), and the
  conversion adds or changes at most 12 lines.
- One slow test runs the converted loop with `ElasticTorchTrainer` on a local multi-node
  cluster: 3 workers lose a node mid-epoch after LOSE_AT; the two survivors train on in their
  processes (3 -> 2). Checked on the loop's records and the snapshots: every row of the
  parquet files (of uneven sizes) trained exactly once per epoch over the steps that count
  (P5), the node loss redid at most the interrupted step (P6), and the final model and AdamW
  moments equal the uninterrupted run's (the same loop in one process, one rank, reading the
  pipeline through a feeder actor) (P1, P2), the step counters STEPS (never a cold start).
  A resume from a snapshot at another world size with a new feeder (a new session, another
  cluster) is tests/ray/test_ray_data_units.py's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import migration_data_baton
import migration_data_standard
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
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
)

ROOT = Path(__file__).resolve().parents[2]
FILE_ROWS = [50, 14, 36, 7, 53]  # 160 rows in parquet files of uneven sizes
ROWS, BATCH, EPOCHS, SNAPSHOT_EVERY = sum(FILE_ROWS), 16, 1, 4
STEPS = EPOCHS * (ROWS // BATCH)  # 10 steps an epoch
LOSE_AT = 4


def test_the_docs_show_the_real_diff_and_it_is_small() -> None:
    assert_docs_show_the_diff(migration_data_standard, migration_data_baton,
                              ROOT / "docs" / "ray-data.md")


def test_the_audit_leaves_out_what_applied_nothing_and_fills_in_only_the_lost_rank() -> None:
    """The audit's allowances (tests/ray/migration_checks.py): the iteration the loss
    interrupted records the step before it again, with the batch it then trains again; a rank
    lost after a step's all-reduce, before its record line, or whose all-reduce failed where
    a peer's went through, leaves no record of a step that counted."""
    planned = {1: [0, 1, 2], 2: [3, 4, 5], 3: [6, 7, 8]}

    def rec(step: int, rank: int, world: int, pid: int, ids: list[int], t: float) -> dict:
        return {"step": step, "rank": rank, "world_size": world, "pid": pid, "ids": ids,
                "time": t}

    records = [rec(1, 0, 3, 10, [0], 1), rec(1, 1, 3, 11, [1], 1), rec(1, 2, 3, 12, [2], 1),
               rec(2, 0, 3, 10, [3], 2), rec(2, 2, 3, 12, [5], 2),  # pid 11 lost
               # The interrupted iteration: its optimizer step applied nothing (the count
               # stays 2), its batch is handed out again at 2 workers.
               rec(2, 0, 3, 10, [6], 2.5), rec(2, 2, 3, 12, [8], 2.5),
               rec(3, 0, 2, 10, [6, 7], 3), rec(3, 1, 2, 12, [8], 3)]
    by_step = steps_as_last_trained(records, planned)
    assert sorted(by_step[2]) == [3, 4, 5]
    assert_each_step_trains_the_planned_rows(by_step, planned)
    # A step that trained another row is caught, the plan or not.
    wrong = records[:-1] + [rec(3, 1, 2, 12, [5], 3)]
    with pytest.raises(AssertionError, match="other rows than planned"):
        assert_each_step_trains_the_planned_rows(steps_as_last_trained(wrong, planned), planned)
    # A rank whose process recorded again was not lost: its missing record is not filled.
    alive = records + [rec(3, 2, 3, 11, [9], 4)]
    with pytest.raises(AssertionError, match="recorded later"):
        steps_as_last_trained(alive, planned)
    # Unless its iteration of the step applied nothing where a peer's all-reduce went through
    # (pid 12: it received pid 10's state, then trained on).
    half = [*records[:3], rec(2, 0, 3, 10, [3], 2), rec(1, 2, 3, 12, [5], 2),
            rec(3, 0, 2, 10, [6, 7], 3), rec(3, 1, 2, 12, [8], 3)]
    assert_each_step_trains_the_planned_rows(steps_as_last_trained(half, planned), planned)


def _write_data(root: Path) -> str:
    root.mkdir()
    rng = np.random.default_rng(0)
    start = 0
    for i, n in enumerate(FILE_ROWS):
        x = rng.normal(size=(n, 4)).astype(np.float32)
        columns = {"id": np.arange(start, start + n), **{f"x{j}": x[:, j] for j in range(4)}}
        pq.write_table(pa.table(columns), root / f"part-{i:02d}.parquet")
        start += n
    return str(root)


def _config(tmp: Path, **changes: Any) -> dict[str, Any]:
    return {"seed": 3, "batch_size": BATCH, "epochs": EPOCHS, "lr": 3e-3,
            "snapshot_every": SNAPSHOT_EVERY, "log": str(tmp / "steps.jsonl"), "pace_s": 0.0,
            **changes}


def _reference(tmp: Path, data: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The converted loop, uninterrupted, in this process (one rank, no Ray Train), reading
    the pipeline through a feeder actor as the trainer's workers do."""
    import ray
    import ray.data

    from data_state import create_feeder
    from elastic.coord import NAMESPACE
    from trainer.config import SnapshotConfig
    from trainer.train.session import WorkerContext, open_session, worker_context

    run = tmp / "reference"
    ds = ray.data.read_parquet(data, num_cpus=0.5).map_batches(
        migration_data_baton.preprocess, num_cpus=0.5)
    feeder = create_feeder(ds, "baton-test-reference-data", options={"namespace": NAMESPACE})
    try:
        with one_rank_ray_train(monkeypatch):
            context = WorkerContext(snapshots=SnapshotConfig(run_uri=str(run)),
                                    datasets={"train": "baton-test-reference-data"})
            with worker_context(context):
                migration_data_baton.train_func(_config(tmp))
                session = open_session()
                assert session is not None
                session.close()
    finally:
        ray.kill(feeder)
    return run


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_converted_loop_trains_every_row_once_through_a_node_loss(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray
    import ray.cloudpickle
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    from trainer.on_ray.elastic_trainer import SKIP_CODE_CHECK_ENV
    from trainer.on_ray.local_cluster import LocalCluster
    from trainer.on_ray.monitor import NAMESPACE

    monkeypatch.setenv(SKIP_CODE_CHECK_ENV, "1")  # others may edit the checkout meanwhile
    data = _write_data(tmp_path / "data")
    run, log = tmp_path / "run", tmp_path / "steps.jsonl"
    config = _config(tmp_path, pace_s=0.25)

    def run_config(name: str) -> RunConfig:
        return RunConfig(name=f"{name}-{int(time.time())}", storage_path=str(tmp_path / "ray"),
                         failure_config=FailureConfig(max_failures=4))

    # The workers cannot import tests/: ship the loop's code with the function.
    ray.cloudpickle.register_pickle_by_value(migration_data_baton)
    # A trainer per node (1.5 of its 2 CPUs), the rest for Ray Data's tasks (0.5 CPU each).
    cluster = LocalCluster(worker_nodes=3, cpus_per_node=2)
    scaling = ScalingConfig(num_workers=(1, 3), resources_per_worker={"CPU": 1.5})
    out: dict[str, Any] = {}
    try:
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        (tmp_path / "ref").mkdir()
        reference = _reference(tmp_path / "ref", data, monkeypatch)
        trainer = migration_data_baton.make_trainer(config, data, str(run), scaling,
                                                    run_config("fit"))
        out = fit_losing_a_node(trainer.fit, cluster, log, at_step=LOSE_AT, world_size=3)
    finally:
        ray.shutdown()
        cluster.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(migration_data_baton)
    assert "result" in out, "the fit did not finish"

    records = read_records(log)
    worlds = [r["world_size"] for r in sorted(records, key=lambda r: r["time"])]
    assert worlds[0] == 3 and worlds[-1] == 2, sorted(set(worlds))
    # The node loss: the survivors are processes that trained at 3 (in-process recovery, no
    # restart), redoing at most the interrupted step.
    at_3 = {r["pid"] for r in records if r["world_size"] == 3}
    at_2 = {r["pid"] for r in records if r["world_size"] == 2}
    assert len(at_3) == 3 and len(at_2) == 2 and at_2 < at_3, (at_3, at_2)
    redone = {r["step"] for r in records if r["world_size"] == 3} & \
        {r["step"] for r in records if r["world_size"] == 2}
    assert len(redone) <= 1, redone

    # Each step's ids as the last attempt that trained it trained them (a redone step replaces
    # what it redoes) are the uninterrupted run's ids of that step, which hold every sample
    # once per epoch.
    planned = planned_steps(read_records(tmp_path / "ref" / "steps.jsonl"))
    assert_every_sample_once_per_epoch(planned, STEPS, EPOCHS, ROWS)
    assert_each_step_trains_the_planned_rows(steps_as_last_trained(records, planned), planned)
    assert_ends_where_uninterrupted(run, reference, tmp_path, STEPS)
