"""A step whose loss is NaN or Inf (issue 36, point 8): never committed.

Baton's own loop (`trainer.train.loop.run_worker`, in this process) on the tiny recipe, with
the loss of step 5 made NaN:

* by default the run stops in one line naming step 5, before its update: what is committed
  (snapshots 2 and 4) is finite, nothing of step 5 is; the same recipe without the fault
  then continues from the newest and ends where an uninterrupted run ends;
* with `optim.skip_nonfinite_loss = true` step 5's update is skipped (no optimizer step,
  the data and the schedule move on) and the run ends at step 8, every snapshot finite.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from snapshot_compare import assert_same_state, final_state
from torch import nn

import trainer.train.model_build as model_build
from elastic.errors import FatalRunError
from elastic.portable import PortableRun
from trainer.config import load_recipe
from trainer.train.loop import WorkerEnv, run_worker

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
MICROBATCHES = 4  # tiny.toml: global_batch 8 / microbatch_size 2, one worker


def _cfg(run: Path, dataset: str, *extra: str) -> Any:
    return load_recipe(ROOT / "recipes" / "tiny.toml", [
        f'snapshots.run_uri="{run}"', f'data.uri="{dataset}"', f"steps={STEPS}",
        "eval.every=0", "sketch.rank=0", "snapshots.snapshot_every=2",
        "snapshots.keep_last=10", *extra])


def _poison(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """The run's loss is NaN in every microbatch of (1-based) `step` of this session."""
    honest = model_build.next_token_loss
    calls = {"n": 0}

    def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        value = honest(model, tokens)
        return value * float("nan") if (calls["n"] - 1) // MICROBATCHES + 1 == step else value
    monkeypatch.setattr(model_build, "next_token_loss", loss)


def _finite_snapshots(run: Path) -> list[int]:
    portable = PortableRun(str(run))  # verifies every byte; refuses NaN or Inf
    for step in portable.committed_steps():
        assert all(np.isfinite(v).all() for v in portable.read(step).tensors.values()
                   if v.dtype.kind == "f")
    return portable.committed_steps()


def test_a_nan_loss_stops_the_run_before_the_step_commits(
        tmp_path: Path, tiny_dataset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    run = tmp_path / "run"
    _poison(monkeypatch, 5)
    with pytest.raises(FatalRunError) as stopped:
        run_worker(_cfg(run, tiny_dataset), WorkerEnv())
    message = str(stopped.value)
    assert "\n" not in message and message.startswith("step 5: the loss is nan"), message
    assert "optim.skip_nonfinite_loss" in message
    before = _finite_snapshots(run)  # 2 and 4 (one may be skipped while the other persists)
    assert before and set(before) <= {2, 4}

    monkeypatch.undo()  # the fault is gone: the run continues from its newest snapshot
    result = run_worker(_cfg(run, tiny_dataset), WorkerEnv())
    assert (result.start_step, result.step) == (max(before), STEPS)
    assert np.isfinite(result.loss)
    reference = tmp_path / "reference"
    run_worker(_cfg(reference, tiny_dataset), WorkerEnv())
    assert_same_state(final_state(reference, tmp_path, STEPS), final_state(run, tmp_path, STEPS))
    assert set(before) < set(_finite_snapshots(run)) and STEPS in _finite_snapshots(run)


def test_skip_nonfinite_loss_skips_the_update_and_trains_on(
        tmp_path: Path, tiny_dataset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    run = tmp_path / "run"
    _poison(monkeypatch, 5)
    losses: list[dict[str, Any]] = []
    result = run_worker(_cfg(run, tiny_dataset, "optim.skip_nonfinite_loss=true"),
                        WorkerEnv(on_metrics=losses.append))
    assert result.step == STEPS and np.isfinite(result.loss)
    assert [np.isfinite(r["loss"]) for r in losses] == [True] * 4 + [False] + [True] * 3
    assert STEPS in _finite_snapshots(run)
    snap = PortableRun(str(run)).read(STEPS)
    steps = {float(v) for k, v in snap.tensors.items() if k.endswith(".step")}
    assert steps == {STEPS - 1.0}  # one update skipped; the schedule and data moved on
    assert snap.state["sched"]["step"] == STEPS and snap.state["trainer"]["step"] == STEPS
