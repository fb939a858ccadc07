"""`tests/ray/migration_standard.py` (the loop of Ray's "Saving and Loading Checkpoints" guide)
converted to Baton: a `Session` registers model, optimizer and LR schedule and makes the
elastic `DataLoader` (`session.data_loader`, whose `batch_size` is the global batch), restores
them (optimizer warm, mid-epoch, at any world size) and snapshots every `snapshot_every`
steps; `ElasticTorchTrainer` replaces `TorchTrainer`. Nothing else changes:
docs/ray-train-loop.md shows the diff, tests/ray/test_ray_train_migration.py runs this loop
through a stop at 3 workers continued at 2, a node loss and a failure after the loop.
"""

import json
import math
import os
import time

import ray.train
import ray.train.torch
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from trainer import ElasticTorchTrainer, Session


def train_func(config):
    rank = ray.train.get_context().get_world_rank()
    world_size = ray.train.get_context().get_world_size()
    model = ray.train.torch.prepare_model(make_model(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.01)
    steps = config["epochs"] * math.ceil(config["items"] / config["batch_size"])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(config["warmup"], steps))
    dataset = make_dataset(config)
    session = Session(model, optimizer, schedule, snapshot_every=config["snapshot_every"])
    loader = session.data_loader(dataset, batch_size=config["batch_size"], seed=config["seed"])
    for epoch in range(loader.epoch, config["epochs"]):
        loader.set_epoch(epoch)
        for ids, x, y in loader:
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            record(config, rank, world_size, epoch, schedule.last_epoch, ids)
        metrics = {"epoch": epoch, "loss": loss.item()}
        ray.train.report(metrics)
    fail_once(config, rank)
    record(config, rank, world_size, epoch, schedule.last_epoch, [], loss=loss.item())


def make_trainer(config, run_uri, scaling_config, run_config):
    return ElasticTorchTrainer(train_func, run_uri=run_uri, train_loop_config=config,
                        scaling_config=scaling_config, run_config=run_config)


def make_model(config):
    torch.manual_seed(config["seed"])
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def make_dataset(config):
    generator = torch.Generator().manual_seed(config["seed"])
    x = torch.randn(config["items"], 8, generator=generator)
    return TensorDataset(torch.arange(config["items"]), x, x[:, :4].sum(1, keepdim=True).sin())


def warmup_cosine(warmup, total):
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return factor


def record(config, rank, world_size, epoch, step, ids, **extra):
    """One JSON line per rank and step (the test's audit), then the test's pace. Rank and
    world size are read now: under in-process recovery the group's change as it shrinks."""
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    line = {"pid": os.getpid(), "rank": rank, "world_size": world_size, "epoch": epoch,
            "step": step, "ids": [int(i) for i in ids], "time": time.time(), **extra}
    with open(config["log"], "a") as out:
        out.write(json.dumps(line) + "\n")
    time.sleep(config["pace_s"] if ids != [] else 0)


def fail_once(config, rank):
    """The code after the loop fails once (the test's fault), on rank 0 (as it is now)."""
    rank_now = ray.train.get_context().get_world_rank()
    if rank_now == 0 and config.get("fail_after_loop") and not os.path.exists(config["marker"]):
        open(config["marker"], "w").close()
        raise RuntimeError("injected failure in the code after the training loop")
