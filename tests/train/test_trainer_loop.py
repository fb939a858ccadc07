"""The worker loop without Ray: world-size invariance (P1) and exact continuation (P2, P5, P6).

Each case runs `trainer.train.loop.run_worker` on W gloo processes over the tiny recipe and reads
the final committed snapshot back through the public format (`elastic.catalog.export_model`),
so what is compared is exactly what a later session would load.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from snapshot_compare import assert_same_state, final_state

from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import run_group
from trainer.config import load_recipe
from trainer.train.loop import WorkerEnv, run_worker

ROOT = Path(__file__).resolve().parents[2]
STEPS = 16


def _train(rank: int, world_size: int, overrides: list[str], stop_after: int | None) -> None:
    torch.set_num_threads(1)
    cfg = load_recipe(ROOT / "recipes" / "tiny.toml", overrides)
    run_worker(cfg, WorkerEnv(rank=rank, world_size=world_size, stop_after=stop_after))


def _run(tmp: Path, name: str, dataset: str, world_size: int, *, parallelism: str = "ddp",
         stop_after: int | None = None, run: Path | None = None) -> Path:
    run = run or tmp / name
    overrides = [
        f'snapshots.run_uri="{run}"', f'data.uri="{dataset}"', f"steps={STEPS}",
        f'parallelism="{parallelism}"', "eval.every=0",
    ]
    run_group(_train, world_size, overrides, stop_after, tmp_dir=str(tmp))
    return run


def test_world_size_does_not_change_the_trajectory(tmp_path: Path, tiny_dataset: str) -> None:
    one = final_state(_run(tmp_path, "w1", tiny_dataset, 1), tmp_path, STEPS)
    # 4 microbatches on 3 workers: an uneven share still gives the same update.
    for world_size in (2, 3):
        run = _run(tmp_path, f"w{world_size}", tiny_dataset, world_size)
        other = final_state(run, tmp_path, STEPS)
        assert_same_state(one, other)
    assert any(k.endswith("exp_avg_sq") for k in one), "optimizer moments are in the snapshot"


def test_fsdp_matches_ddp(tmp_path: Path, tiny_dataset: str) -> None:
    ddp = final_state(_run(tmp_path, "ddp", tiny_dataset, 1), tmp_path, STEPS)
    fsdp = final_state(_run(tmp_path, "fsdp", tiny_dataset, 2, parallelism="fsdp"), tmp_path, STEPS)
    assert_same_state(ddp, fsdp)


def test_continue_on_another_world_size_and_layout(tmp_path: Path, tiny_dataset: str) -> None:
    """Stop after step 6 at 2 DDP workers, continue at 3 FSDP2 workers: the same end state as
    an uninterrupted single-worker run, with the optimizer and data cursor carried over."""
    reference = final_state(_run(tmp_path, "ref", tiny_dataset, 1), tmp_path, STEPS)
    run = _run(tmp_path, "moved", tiny_dataset, 2, stop_after=6)
    assert max(SnapshotStore(str(run)).committed_steps()) == 6  # the planned stop committed
    _run(tmp_path, "moved", tiny_dataset, 3, parallelism="fsdp", run=run)
    assert_same_state(reference, final_state(run, tmp_path, STEPS))
    manifest = SnapshotStore(str(run)).load_manifest(STEPS)
    assert manifest is not None


def test_checkpointed_blocks_recompute_the_sketch_derived_for_the_step(
    tmp_path: Path, tiny_dataset: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With `model.checkpoint_blocks`, backward recomputes each block: every sketched layer
    call, forward and recompute, takes the seed derived from (seed, step, microbatch, layer)
    (before, the recompute ran outside it and every block, step and microbatch drew the same
    seed from the generator checkpointing restores)."""
    import sketch_ops.blocked
    import sketch_ops.layer
    import sketch_ops.seeds as seeds

    calls: list[tuple[str, bool]] = []

    def recording(layer_name: str) -> int:
        calls.append((layer_name, seeds.active_seed_state() is not None))
        return seeds.layer_seed(layer_name)

    for module in (sketch_ops.layer, sketch_ops.blocked):  # where layers draw their seeds
        monkeypatch.setattr(module, "layer_seed", recording)
    cfg = load_recipe(ROOT / "recipes" / "tiny.toml", [
        f'snapshots.run_uri="{tmp_path / "run"}"', f'data.uri="{tiny_dataset}"', "steps=2",
        "eval.every=0", "model.checkpoint_blocks=true"])
    run_worker(cfg, WorkerEnv())
    assert calls and all(inside for _, inside in calls), calls
    layers = {name for name, _ in calls}
    assert len(calls) >= 2 * len(layers) * 2  # forward and recompute, both steps
