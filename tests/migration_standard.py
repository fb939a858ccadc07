"""A Ray Train loop written the standard way (the checkpoint recipe `benchmarks/recovery.py`
measures): restore model, optimizer and step from `ray.train.get_checkpoint()`; every
`snapshot_every` steps rank 0 saves them with `torch.save` and every rank calls
`ray.train.report(..., checkpoint=...)`. It trains Baton's tiny GPT on Baton's data order,
so `tests/migration_baton.py` (the same loop converted to Baton) differs only in what is
saved and restored; the diff in docs/ray-train-loop.md is `diff` of the two files.
"""

import contextlib
import json
import tempfile
import time
from pathlib import Path

import ray.train
import ray.train.torch
import torch
from ray.train import Checkpoint
from ray.train.torch import TorchTrainer

from data_state import ResumableLoader, TokenDataset
from sketch_ops import sketch_seed
from trainer.loop import build_model, next_token_loss
from trainer.optim import WarmupCosine, build_optimizer
from trainer.parallel import all_reduce_sum, gather_samples, loss_weight


def train_func(config):
    cfg = config["cfg"]
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    model = ray.train.torch.prepare_model(build_model(cfg))
    optimizer = build_optimizer(model, cfg.optim)
    schedule = WarmupCosine(optimizer, cfg.optim, cfg.steps)
    loader = ResumableLoader(TokenDataset(cfg.data.uri, split="train"), seed=cfg.seed,
                             global_batch=cfg.data.global_batch,
                             microbatch_size=cfg.data.microbatch_size,
                             rank=rank, world_size=world_size)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = torch.load(Path(directory) / "state.pt", weights_only=True)
        getattr(model, "module", model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    log(config, rank, {"kind": "start", "step": start, "world_size": world_size})
    for step in range(start, cfg.steps):
        microbatches, step_loss = loader.next_step(), 0.0
        for i, mb in enumerate(microbatches):
            sync = i == len(microbatches) - 1 or not hasattr(model, "no_sync")
            with contextlib.nullcontext() if sync else model.no_sync():
                with sketch_seed(cfg.seed, step, mb.index):
                    loss = next_token_loss(model, mb.tokens)
                (loss * loss_weight(world_size, cfg.data.num_microbatches)).backward()
            step_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        loader.advance()
        samples = gather_samples([i for mb in microbatches for i in mb.sample_indices],
                                 cfg.data.global_batch, torch.device("cpu"))
        (loss_sum,) = all_reduce_sum([step_loss], torch.device("cpu"))
        metrics = {"step": step + 1, "loss": loss_sum / cfg.data.num_microbatches}
        log(config, rank, {"kind": "step", **metrics, "samples": samples})
        if (step + 1) % cfg.snapshots.snapshot_every == 0 or step + 1 == cfg.steps:
            with tempfile.TemporaryDirectory() as directory:
                if rank == 0:
                    torch.save({"model": getattr(model, "module", model).state_dict(),
                                "optimizer": optimizer.state_dict(), "step": step + 1},
                               Path(directory) / "state.pt")
                ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory)
                                 if rank == 0 else None)
        time.sleep(config["pace_s"])


def log(config, rank, record):
    """Rank 0's records, one JSON line each (the test reads them)."""
    if rank == 0:
        with open(config["log"], "a") as out:
            out.write(json.dumps({**record, "time": time.time()}) + "\n")


def make_trainer(config, run_uri, scaling_config, run_config):
    return TorchTrainer(train_func, train_loop_config=config,
                        scaling_config=scaling_config, run_config=run_config)
