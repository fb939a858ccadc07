"""`tests/migration_standard.py` converted to Baton: a `Session` registers model, optimizer,
LR schedule and data loader, restores them (warm, resharded) and snapshots them every
`snapshot_every` steps; `ElasticTorchTrainer` replaces `TorchTrainer`. Nothing else changes
(docs/ray-train-loop.md shows the diff; tests/test_ray_train_migration.py
runs it through a node loss and a scale-up).
"""

import contextlib
import json
import time

import ray.train
import ray.train.torch
import torch

from data_state import ResumableLoader, TokenDataset
from sketch_ops import sketch_seed
from trainer import ElasticTorchTrainer, Session
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
    session = Session(model, optimizer, schedule, loader,
                      snapshot_every=cfg.snapshots.snapshot_every)
    log(config, rank, {"kind": "start", "step": session.step, "world_size": world_size})
    for step in session.steps(cfg.steps):
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
            ray.train.report(metrics)
        time.sleep(config["pace_s"])


def log(config, rank, record):
    """Rank 0's records, one JSON line each (the test reads them)."""
    if rank == 0:
        with open(config["log"], "a") as out:
            out.write(json.dumps({**record, "time": time.time()}) + "\n")


def make_trainer(config, run_uri, scaling_config, run_config):
    return ElasticTorchTrainer(train_func, run_uri=run_uri, train_loop_config=config,
                        scaling_config=scaling_config, run_config=run_config)
