"""Ray Train's conventions kept (issue 30, point 3), without a cluster:

- `fit()`'s `Result.checkpoint` is a `ray.train.Checkpoint` of the newest committed snapshot's
  directory (`snapshot_checkpoint`): `Checkpoint.as_directory()` opens it (manifest and
  safetensors shards), `baton snapshots export|show` read it, `baton fit --from` forks from
  it, and a `Session` (or `ElasticTorchTrainer`) given it continues the run, while an older
  snapshot's directory is refused in one line that names the fork command;
- inside a Baton worker, `ray.train.get_checkpoint()` is the run's newest committed snapshot
  (None before the first), in a continuation too, and `ray.train.report(metrics)` reaches the
  run's coordinator, whose last metrics `ElasticTorchTrainer.fit()` returns as
  `Result.metrics`;
- `session.unwrapped_model` is the model inside DDP, the model itself without a wrapper;
- a fixed `ScalingConfig(num_workers=N)` becomes `(1, N)` with a warning that says so.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from elastic.store.snapshot_store import SnapshotStore
from trainer.cli import main as baton_main
from trainer.run.fork import parse_source
from trainer.train.session import Session, UsageError


def _trained_run(run: Path, steps: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Session(model, optimizer, run_uri=str(run), snapshot_every=2) as session:
        assert session.unwrapped_model is model  # no wrapper: the model itself
        for _ in session.steps(steps):
            model(torch.ones(2, 3)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    return model


def test_the_result_checkpoint_is_the_newest_snapshot_and_everything_takes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    from trainer.on_ray.train_fn import snapshot_checkpoint

    run = tmp_path / "run"
    model = _trained_run(run, 5)
    checkpoint = snapshot_checkpoint(str(run))
    assert checkpoint is not None
    assert checkpoint.path == SnapshotStore(str(run)).step_path(5)
    with checkpoint.as_directory() as directory:  # a Ray user's way in
        files = sorted(p.name for p in Path(directory).iterdir())
    assert "manifest.json" in files and any(f.endswith(".safetensors") for f in files)

    out = tmp_path / "model.safetensors"
    assert baton_main(["snapshots", "export", checkpoint.path, "--out", str(out)]) == 0
    exported = load_file(out)
    for key, value in model.state_dict().items():
        assert torch.equal(exported[key], value), key
    assert baton_main(["snapshots", "show", checkpoint.path]) == 0
    assert "5" in capsys.readouterr().out
    assert baton_main(["snapshots", "show", checkpoint.path, "4"]) == 2
    assert "is snapshot 5 but step 4 was given" in capsys.readouterr().err

    assert parse_source(checkpoint.path) == (str(run), 5)  # baton fit --from CHECKPOINT
    again = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    with Session(again, run_uri=checkpoint) as session:  # Baton's restore takes it too
        assert session.start_step == 5
        assert torch.equal(again[0].weight, model[0].weight)
    older = SnapshotStore(str(run)).step_path(4)
    with pytest.raises(UsageError, match=rf"is snapshot 4 of {run}, whose newest committed "
                                         rf"snapshot is 5: .*baton fit RECIPE --from {run}@4"):
        Session(again, run_uri=older)
    assert snapshot_checkpoint(str(tmp_path / "empty")) is None


def test_ray_trains_own_calls_in_a_worker_read_the_run_it_continues(tmp_path: Path) -> None:
    import ray.train
    from ray.train.v2._internal.execution import train_fn_utils

    from elastic.coord.local_coordinator import LocalCoordinator
    from elastic.format.records import DEFAULT_BLOCK_BYTES
    from trainer.on_ray.train_fn import install

    run = tmp_path / "run"
    coordinator = LocalCoordinator(SnapshotStore(str(run)), keep_last=3,
                                   block_bytes=DEFAULT_BLOCK_BYTES)
    previous = train_fn_utils._train_fn_utils
    install(str(run), coordinator, replica_groups=True)  # what ElasticTorchTrainer's wrapper does
    try:
        assert ray.train.get_checkpoint() is None  # nothing committed yet
        _trained_run(run, 4)
        first = ray.train.get_checkpoint()
        assert first is not None and first.path == SnapshotStore(str(run)).step_path(4)
        _trained_run(run, 6)  # a continuation: restores 4, commits 6
        latest = ray.train.get_checkpoint()
        assert latest is not None and latest.path == SnapshotStore(str(run)).step_path(6)
        ray.train.report({"epoch": 1, "loss": 0.25})
        ray.train.report({"epoch": 2, "loss": 0.125})
        # What fit() returns as Result.metrics: the last report of the group's first worker.
        assert coordinator.last_metrics() == {"epoch": 2, "loss": 0.125}
    finally:
        train_fn_utils.set_train_fn_utils(previous)


def test_a_fixed_worker_count_becomes_elastic_with_a_warning_that_says_so() -> None:
    from ray.train import ScalingConfig

    from trainer.on_ray.elastic_trainer import ElasticTorchTrainer, elastic_scaling

    with pytest.warns(UserWarning, match=r"ScalingConfig\(num_workers=2\) is a fixed size.*"
                                         r"num_workers=\(1, 2\) instead.*num_workers=\(2, 2\) "
                                         r"to keep the size fixed: a start then waits without "
                                         r"bound for room for 2 workers"):
        assert elastic_scaling(ScalingConfig(num_workers=2)).num_workers == (1, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert elastic_scaling(ScalingConfig(num_workers=(2, 2))).num_workers == (2, 2)
        assert elastic_scaling(ScalingConfig(num_workers=1)).num_workers == 1
    with pytest.warns(UserWarning, match="num_workers=3"):
        trainer = ElasticTorchTrainer(lambda: None, run_uri="unused",
                                      scaling_config=ScalingConfig(num_workers=3))
    assert trainer.scaling_config.num_workers == (1, 3)
