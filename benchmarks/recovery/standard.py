"""The standard recipe `benchmarks/recovery/run.py` measures Baton against: Ray Train's documented
checkpoint recipe, as a typical Ray Train user writes it, on Baton's model, optimizer, schedule
and data order (only what is saved and restored differs).

`prepare_model` (DDP); every k = snapshot_every steps rank 0 `torch.save`s {model state_dict,
optimizer state_dict, step} into a temp dir and every rank calls `ray.train.report(metrics,
checkpoint=Checkpoint.from_directory(dir) on rank 0)`; on start it restores those three from
`ray.train.get_checkpoint()`. It does NOT save the LR schedule (a fresh scheduler restarts its
warmup) nor the data position (a fresh iterator starts the epoch again), as most user loops do
not. With `config["model_only"]` it saves just the model's state_dict (the classic loop: after
a restart AdamW starts cold). Per-step records go to a JSON-lines file from rank 0 (reporting
every step would cap the loop at one step per Ray health-check interval).

Ray imports this module by name in its workers (the driver runs from the repository root).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any


def _restore(plain: Any, optimizer: Any) -> tuple[int, float]:
    """(step, AdamW step counter) restored from Ray's latest checkpoint; (0, 0.0) if none."""
    import ray.train
    import torch

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0, 0.0
    restored_opt_step = 0.0
    with checkpoint.as_directory() as directory:
        state = torch.load(Path(directory) / "state.pt", weights_only=True)  # no pickle code
    plain.load_state_dict(state["model"])
    if "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
        restored_opt_step = float(next(iter(optimizer.state.values()))["step"])
    return int(state["step"]), restored_opt_step


def _checkpoint(rank: int, plain: Any, optimizer: Any, step: int, metrics: dict[str, Any],
                model_only: bool) -> None:
    """Rank 0 saves and reports with a checkpoint; the other ranks report the metrics."""
    import ray.train
    import torch
    from ray.train import Checkpoint

    if rank != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as directory:
        state = {"model": plain.state_dict(), "step": step}
        if not model_only:
            state["optimizer"] = optimizer.state_dict()
        torch.save(state, Path(directory) / "state.pt")
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))


def standard_train_fn(config: dict[str, Any]) -> None:
    """The loop: config holds `cfg` (a Baton recipe), `log` (the JSON-lines file), `pace_s`
    (sleep per step) and `model_only`."""
    import ray.train
    import ray.train.torch
    import torch

    from data_state import ResumableLoader, TokenDataset
    from sketch_ops import sketch_seed
    from trainer.train.model_build import build_model, next_token_loss
    from trainer.train.optim import WarmupCosine, build_optimizer
    from trainer.train.parallel import all_reduce_sum, loss_weight

    cfg, log_path, pace_s = config["cfg"], Path(config["log"]), config["pace_s"]
    model_only = bool(config.get("model_only", False))
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    model = ray.train.torch.prepare_model(build_model(cfg))
    plain = model.module if hasattr(model, "module") else model
    optimizer = build_optimizer(model, cfg.optim)
    start, restored_opt_step = _restore(plain, optimizer)
    # Created after the restore and not saved: it restarts its warmup, as a user's does.
    schedule = WarmupCosine(optimizer, cfg.optim, cfg.steps)
    train_set = TokenDataset(cfg.data.uri, split="train")
    loader = ResumableLoader(  # a fresh iterator: the epoch starts again after a restart
        train_set, global_batch=cfg.data.global_batch, microbatch_size=cfg.data.microbatch_size,
        seed=cfg.seed, rank=rank, world_size=world_size,
    )

    def log(record: dict[str, Any]) -> None:
        if rank == 0:
            with log_path.open("a") as out:
                out.write(json.dumps(record) + "\n")

    attempt = sum(1 for line in log_path.open() if '"start"' in line) if log_path.exists() else 0
    log({"kind": "start", "attempt": attempt, "step": start, "world_size": world_size,
         "time": time.time(), "restored_opt_step": restored_opt_step})
    weight = loss_weight(world_size, cfg.data.num_microbatches)
    for step in range(start, cfg.steps):
        microbatches = loader.next_step()
        step_loss = 0.0
        for i, mb in enumerate(microbatches):
            last = i == len(microbatches) - 1
            # prepare_model wraps in DDP only for world_size > 1: sync on the last microbatch.
            with contextlib.nullcontext() if last or not hasattr(model, "no_sync") else (
                model.no_sync()
            ):
                with sketch_seed(cfg.seed, step, mb.index):
                    loss = next_token_loss(model, mb.tokens)
                (loss * weight).backward()
            step_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        lr = schedule.lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        loader.advance()
        (loss_sum,) = all_reduce_sum([step_loss], torch.device("cpu"))
        metrics = {"step": step + 1, "loss": loss_sum / cfg.data.num_microbatches}
        log({"kind": "step", "attempt": attempt, **metrics, "lr": lr,
             "world_size": world_size, "time": time.time()})
        if (step + 1) % cfg.snapshots.snapshot_every == 0 or step + 1 == cfg.steps:
            _checkpoint(rank, plain, optimizer, step + 1, metrics, model_only)
        time.sleep(pace_s)
    loader.close()
    train_set.close()
