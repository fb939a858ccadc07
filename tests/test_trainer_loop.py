"""The worker loop without Ray: world-size invariance (P1) and exact continuation (P2, P5, P6).

Each case runs `trainer.loop.run_worker` on W gloo processes over the tiny recipe and reads
the final committed snapshot back through the public format (`elastic.catalog.export_model`),
so what is compared is exactly what a later session would load.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from elastic.catalog import export_model
from elastic.store import SnapshotStore
from elastic.testing import run_group
from trainer.config import load_recipe
from trainer.loop import WorkerEnv, run_worker

ROOT = Path(__file__).resolve().parents[1]
STEPS = 16


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    from data_state import prepare_corpus

    out = str(tmp_path_factory.mktemp("data") / "corpus")
    prepare_corpus(None, out, seq_len=32, max_bytes=1_000_000, progress=False)
    return out


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


def _final_state(run: Path, tmp: Path) -> dict[str, torch.Tensor]:
    store = SnapshotStore(str(run))
    step = max(store.committed_steps())
    assert step == STEPS, f"{run}: newest committed step is {step}, expected {STEPS}"
    state = {}
    for component in ("model", "optim"):
        out = tmp / f"{run.name}-{component}.safetensors"
        export_model(store, step, str(out), component=component)
        state.update({f"{component}.{k}": v for k, v in load_file(out).items()})
    return state


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Equal up to float summation order (P1): relative difference <= 1e-5 over the model and
    over the optimizer moments, and no single element off by more than 1e-4.

    Why not per tensor: the attention key bias has an exactly zero gradient (softmax ignores
    a per-query constant), so AdamW turns summation-order noise (~1e-9) in it into updates
    of full size; that tensor alone differs by ~1e-6 in absolute value. The bounds above
    still catch any real divergence (a wrong microbatch, a cold optimizer, a skipped step).
    """
    assert a.keys() == b.keys()
    for component in ("model.", "optim."):
        keys = [k for k in a if k.startswith(component) and a[k].is_floating_point()]
        x = torch.cat([a[k].double().flatten() for k in keys])
        y = torch.cat([b[k].double().flatten() for k in keys])
        rel = ((x - y).norm() / x.norm()).item()
        assert rel <= 1e-5, f"{component}*: relative difference {rel:.2e}"
    for key in a:
        worst = (a[key].double() - b[key].double()).abs().max().item()
        assert worst <= 1e-4, f"{key}: an element differs by {worst:.2e}"


def test_world_size_does_not_change_the_trajectory(tmp_path: Path, dataset: str) -> None:
    one = _final_state(_run(tmp_path, "w1", dataset, 1), tmp_path)
    # 4 microbatches on 3 workers: an uneven share still gives the same update.
    for world_size in (2, 3):
        other = _final_state(_run(tmp_path, f"w{world_size}", dataset, world_size), tmp_path)
        _assert_same(one, other)
    assert any(k.endswith("exp_avg_sq") for k in one), "optimizer moments are in the snapshot"


def test_fsdp_matches_ddp(tmp_path: Path, dataset: str) -> None:
    ddp = _final_state(_run(tmp_path, "ddp", dataset, 1), tmp_path)
    fsdp = _final_state(_run(tmp_path, "fsdp", dataset, 2, parallelism="fsdp"), tmp_path)
    _assert_same(ddp, fsdp)


def test_continue_on_another_world_size_and_layout(tmp_path: Path, dataset: str) -> None:
    """Stop after step 6 at 2 DDP workers, continue at 3 FSDP2 workers: the same end state as
    an uninterrupted single-worker run, with the optimizer and data cursor carried over."""
    reference = _final_state(_run(tmp_path, "ref", dataset, 1), tmp_path)
    run = _run(tmp_path, "moved", dataset, 2, stop_after=6)
    assert max(SnapshotStore(str(run)).committed_steps()) == 6  # the planned stop committed
    _run(tmp_path, "moved", dataset, 3, parallelism="fsdp", run=run)
    _assert_same(reference, _final_state(run, tmp_path))
    manifest = SnapshotStore(str(run)).load_manifest(STEPS)
    assert manifest is not None
