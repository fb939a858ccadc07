"""BASIS layers under DDP and FSDP2 (`fully_shard`): 2 processes on gloo, the tiny GPT.

Each rank sketches its own microbatch (`sketch_seed(seed, step, microbatch=rank)`); the
data-parallel wrapper averages the per-rank estimates. Gradients must be finite, every rank must
hold the same parameters afterwards, and the training loss must fall.
"""

from __future__ import annotations

import faulthandler
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from elastic.testing import run_group

STEPS = 25


def _worker(rank: int, world_size: int, mode: str, out_dir: str) -> None:
    # A crash of a spawned rank leaves its Python stack in the test's captured stderr.
    faulthandler.enable()
    torch.set_num_threads(1)
    os.environ.pop("BATON_SKETCH_BACKEND", None)
    from sketch_ops import sketch_model, sketch_seed
    from trainer.config import ModelConfig
    from trainer.train.model import GPT

    torch.manual_seed(0)  # same init on every rank
    model = GPT(ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=2), seq_len=16)
    sketch_model(model, rank=8)
    if mode == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    # A fixed, learnable batch per rank: the loss must fall when fitted repeatedly.
    tokens = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(rank))
    losses, finite = [], True
    for step in range(STEPS):
        with sketch_seed(7, step, microbatch=rank):
            # Through the wrapper's forward (DDP syncs gradients only for its own forward).
            logits = wrapped(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))
            loss.backward()
        finite &= all(
            p.grad is not None
            and bool(
                torch.isfinite(
                    p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                ).all()
            )
            for p in wrapped.parameters()
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double().sum().item()
        for p in wrapped.parameters()
    ]
    Path(out_dir, f"{rank}.json").write_text(
        json.dumps({"losses": losses, "finite": finite, "params": params})
    )


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_training_under_data_parallel_wrappers(mode: str, tmp_path: Path) -> None:
    run_group(_worker, 2, mode, str(tmp_path), tmp_dir=str(tmp_path))
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["finite"]
        first, last = result["losses"][:3], result["losses"][-3:]
        assert sum(last) / 3 < sum(first) / 3 - 0.5, result["losses"]
    torch.testing.assert_close(
        torch.tensor(results[0]["params"]), torch.tensor(results[1]["params"]), rtol=1e-6, atol=1e-6
    )
