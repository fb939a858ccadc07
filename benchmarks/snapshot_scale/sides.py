"""The sides `benchmarks/snapshot_scale/run.py` compares, on one GPT + AdamW state: its shapes,
one training step, and each side's save and restore (Baton's data path, torch.save /
torch.load, DCP's async_save).

Contract: `build(size)` returns the model, optimizer and a registry holding both, for a size of
`SHAPES` (GB of state); `baton_restore` is Snapshotter.restore's data path without its
coordinator bookkeeping (in place into the live model and optimizer tensors); `torch_save`
fsyncs; `dcp_save` records the time until `dcp.async_save` returns and until its future is
done.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from elastic.read.restore import (
    ByteSource,
    check_compatible,
    collector_paused,
    plan_targets,
    read_tensors,
)
from elastic.state.registry import StateRegistry
from elastic.store.snapshot_store import SnapshotStore
from trainer.config import ModelConfig
from trainer.train.model import GPT

# GPT shapes whose fp32 parameters + AdamW moments come to about the named size.
SHAPES = {0.3: (512, 7), 1.2: (1024, 8), 3.0: (1536, 9)}
VOCAB, SEQ = 8192, 32


def build(size: float) -> tuple[GPT, torch.optim.Optimizer, StateRegistry]:
    d_model, n_layers = SHAPES[size]
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=VOCAB, d_model=d_model, n_layers=n_layers,
                            n_heads=8), seq_len=SEQ)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    registry = StateRegistry()
    registry.register("model", model)
    registry.register("optim", optim)
    return model, optim, registry


def train_step(model: GPT, optim: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    optim.zero_grad(set_to_none=True)
    model.loss(torch.randint(0, VOCAB, (1, SEQ), generator=gen)).backward()
    optim.step()


def state_bytes(registry: StateRegistry) -> int:
    return sum(t.numel() * t.element_size() for t in registry.flatten().tensors.values())


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save(model: GPT, optim: torch.optim.Optimizer, path: str) -> None:
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, path)
    fsync_file(path)


def torch_restore(model: GPT, optim: torch.optim.Optimizer, source: Any) -> None:
    saved = torch.load(source, weights_only=True)
    model.load_state_dict(saved["model"])
    optim.load_state_dict(saved["optim"])


def dcp_save(model: GPT, optim: torch.optim.Optimizer, directory: str,
             rows: dict[str, list[float]]) -> None:
    """``dcp.async_save`` as a DCP user calls it: the time until it returns (the stall) and
    until its future is done (written and fsynced)."""
    start = time.perf_counter()
    msd, osd = get_state_dict(model, optim)
    future = cast("Future[Any]", dcp.async_save({"model": msd, "optim": osd},
                                               checkpoint_id=directory))
    rows["dcp_return"].append(time.perf_counter() - start)
    future.result()
    rows["dcp_done"].append(time.perf_counter() - start)


def baton_restore(registry: StateRegistry, store: SnapshotStore, step: int,
                  ram: Any = None) -> bool:
    """Snapshotter.restore's data path, without its coordinator bookkeeping; True if every
    byte came from RAM."""
    with collector_paused():
        manifest = store.load_manifest(step)
        live = registry.flatten()
        check_compatible(registry, manifest, live.tensors, live.skeletons)
        source = ByteSource(store, step, ram=ram)
        targets = plan_targets(manifest, live.tensors, in_place=registry.model_keys())
        tensors = read_tensors(manifest, targets, source)
        registry.load(tensors, manifest.state, checked=True)
    return source.used_ram and not source.used_storage
