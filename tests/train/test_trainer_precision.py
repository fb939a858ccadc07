"""Mixed precision (`[precision] dtype`, `trainer.train.precision`): fp32 state in every
snapshot, runs that change dtype when they continue, bf16 world-size invariance, fp16's loss
scaler.

Single-worker runs go in-process (`run_worker` without a process group); runs at 2 workers
use `elastic.testing.run_group` (gloo). What is compared is read back through the public
snapshot format (`snapshot_compare.final_state`).

Tolerances, measured on the tiny recipe (8 steps): a bf16 run at 1 and at 2 workers differ by
~4e-6 (relative, whole model), the same bf16 run and an fp32 run by ~1.3e-3. So `BF16_P1`
(1e-4) is 25x the float-order noise yet 10x below what bf16 itself changes: a continuation
that lost state, ran in fp32 or trained another microbatch would fail it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from snapshot_compare import final_state, relative_difference

import trainer.train.loop
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import run_group
from trainer.config import PRECISIONS, ConfigError, load_recipe
from trainer.train.loop import WorkerEnv, run_worker
from trainer.train.precision import COMPUTE_DTYPES, autocast, loss_scaler

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
BF16_P1 = 1e-4


def _train(rank: int, world_size: int, overrides: list[str], stop_after: int | None,
           init_scale: float | None = None) -> None:
    torch.set_num_threads(1)
    made: list[torch.amp.GradScaler] = []
    if init_scale is not None:  # a spawned worker: its own module, patched for this run only
        def scaler(name: str, device: torch.device) -> torch.amp.GradScaler:
            made.append(torch.amp.GradScaler(device.type, init_scale=init_scale,
                                             enabled=name == "fp16"))
            return made[-1]
        trainer.train.loop.loss_scaler = scaler
    cfg = load_recipe(ROOT / "recipes" / "tiny.toml", overrides)
    run_worker(cfg, WorkerEnv(rank=rank, world_size=world_size, stop_after=stop_after))
    for scaler_made in made:  # each rank's own end state, beside the run directory
        run_dir = Path(cfg.snapshots.run_uri)
        (run_dir.parent / f"scaler-{rank}.json").write_text(json.dumps(scaler_made.state_dict()))


def _run(run: Path, dataset: str, dtype: str, *, world_size: int = 1, steps: int = STEPS,
         stop_after: int | None = None, parallelism: str = "ddp",
         init_scale: float | None = None) -> Path:
    overrides = [f'snapshots.run_uri="{run}"', f'data.uri="{dataset}"', f"steps={steps}",
                 f'parallelism="{parallelism}"', "eval.every=0", f'precision.dtype="{dtype}"']
    if world_size == 1 and init_scale is None:
        _train(0, 1, overrides, stop_after)
    else:
        run_group(_train, world_size, overrides, stop_after, init_scale,
                  tmp_dir=str(run.parent))
    return run


def _saved(run: Path, step: int) -> tuple[dict[str, str], dict]:
    """(dtype of each floating tensor, JSON state) of committed snapshot `step`."""
    manifest = SnapshotStore(str(run)).load_manifest(step)
    assert manifest is not None, f"{run}: no committed snapshot {step}"
    dtypes = {k: r.dtype for k, r in manifest.tensors.items()
              if r.dtype in ("F32", "BF16", "F16", "F64")}  # safetensors' names
    return dtypes, manifest.state


def test_dtype_is_validated_and_recorded(tmp_path: Path) -> None:
    recipe = ROOT / "recipes" / "tiny.toml"
    run = f'snapshots.run_uri="{tmp_path / "r"}"'
    with pytest.raises(ConfigError) as err:
        load_recipe(recipe, [run, 'precision.dtype="fp8"'])
    message = str(err.value)
    assert message.startswith("precision.dtype: must be one of fp32, bf16, fp16")
    assert "\n" not in message
    cfg = load_recipe(recipe, [run, 'precision.dtype="bf16"'])
    assert cfg.to_dict()["precision"] == {"dtype": "bf16"}  # run.json records it
    assert load_recipe(recipe, [run]).precision.dtype == "fp32"  # the default


def test_precision_helpers() -> None:
    assert tuple(COMPUTE_DTYPES) == PRECISIONS
    assert [loss_scaler(n, torch.device("cpu")).is_enabled() for n in PRECISIONS] == [
        False, False, True]
    layer = torch.nn.Linear(4, 4)
    for name, dtype in COMPUTE_DTYPES.items():
        with autocast(layer, name, torch.device("cpu")):
            out = layer(torch.randn(2, 4))
        assert out.dtype == dtype
        assert layer.weight.dtype == torch.float32  # master weights are never cast


def test_a_run_changes_precision_when_it_continues(tmp_path: Path, tiny_dataset: str) -> None:
    """bf16 -> fp32 -> bf16 -> fp16 -> fp16 -> bf16, two steps each: every session restores
    the one before it, every snapshot holds fp32 state, and fp16's loss scale is carried
    from one fp16 session to the next (a fresh one where the run was not fp16 before)."""
    run = tmp_path / "run"
    chain = ["bf16", "fp32", "bf16", "fp16", "fp16", "bf16"]
    for i, dtype in enumerate(chain):
        _run(run, tiny_dataset, dtype, steps=2 * len(chain), stop_after=2 * (i + 1))
        step = max(SnapshotStore(str(run)).committed_steps())
        assert step == 2 * (i + 1), f"session {i} ({dtype}) did not continue the run"
        dtypes, state = _saved(run, step)
        assert dtypes and set(dtypes.values()) == {"F32"}, f"{dtype} session saved {dtypes}"
        assert any(k.startswith("optim.") for k in dtypes)
        assert ("scaler" in state) == (dtype == "fp16")
    # No step of this tiny model overflows at the default scale, so the growth tracker counts
    # fp16 steps: 4 means the second fp16 session restored the first one's 2.
    _, state = _saved(run, 10)
    assert state["scaler"]["_growth_tracker"] == 4
    assert state["scaler"]["scale"] == 65536.0


@pytest.mark.slow
def test_bf16_continues_at_another_world_size(tmp_path: Path, tiny_dataset: str) -> None:
    """A bf16 run stopped at step 4 on 1 worker and continued on 2 ends where the
    uninterrupted bf16 run does, to `BF16_P1` (module docstring), model and optimizer."""
    fp32 = final_state(_run(tmp_path / "fp32", tiny_dataset, "fp32"), tmp_path, STEPS)
    whole = final_state(_run(tmp_path / "whole", tiny_dataset, "bf16"), tmp_path, STEPS)
    moved = _run(tmp_path / "moved", tiny_dataset, "bf16", stop_after=4)
    _run(moved, tiny_dataset, "bf16", world_size=2)
    resumed = final_state(moved, tmp_path, STEPS)
    assert relative_difference(whole, fp32, "model.") > 10 * BF16_P1, \
        "bf16 changed nothing: was it on?"
    for component in ("model.", "optim."):
        assert relative_difference(whole, resumed, component) <= BF16_P1, component
    assert all(t.dtype == torch.float32 for t in resumed.values() if t.is_floating_point())


@pytest.mark.slow
def test_fp16_under_fsdp_ranks_skip_the_same_steps(tmp_path: Path, tiny_dataset: str) -> None:
    """fp16 under FSDP2 (MixedPrecisionPolicy) on 2 workers, with a loss scale so large that
    the first steps overflow: each rank holds only its shard's gradients, yet both skip the
    same steps (torch max-reduces the overflow flag), so their scalers end equal; the run
    commits every step with fp32 state and the scale that rank 0 ended with."""
    init_scale = 2.0**18
    run = _run(tmp_path / "sharded", tiny_dataset, "fp16", world_size=2, parallelism="fsdp",
               init_scale=init_scale)
    ends = [json.loads((tmp_path / f"scaler-{rank}.json").read_text()) for rank in (0, 1)]
    assert ends[0] == ends[1], "the ranks skipped different steps"
    assert ends[0]["scale"] < init_scale, "no step overflowed: the test is void"
    dtypes, state = _saved(run, STEPS)
    assert state["scaler"] == ends[0]
    assert set(dtypes.values()) == {"F32"}
