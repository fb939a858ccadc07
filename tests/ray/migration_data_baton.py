"""`tests/ray/migration_data_standard.py` (a Ray Train loop fed by Ray Data, as Ray's guide
writes one) converted to Baton: a `Session` registers model and optimizer, and its
`data_loader("train", ...)` reads the pipeline passed to `ElasticTorchTrainer(datasets=...)`
(`batch_size` is the global batch), restored mid-epoch at any world size, every row once per
epoch; `ElasticTorchTrainer` replaces `TorchTrainer`. docs/ray-data.md shows the diff;
tests/ray/test_ray_data_migration.py runs this loop through a stop at 3 workers continued at
2 and a node loss.
"""

import numpy as np
import ray.data
import ray.train
import ray.train.torch
import torch
import torch.nn.functional as F
from torch import nn

from trainer import ElasticTorchTrainer, Session


def train_func(config):
    model = ray.train.torch.prepare_model(make_model(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.01)
    session = Session(model, optimizer, snapshot_every=config["snapshot_every"])
    batches = session.data_loader("train", batch_size=config["batch_size"], dtypes=torch.float32)
    for epoch in range(batches.epoch, config["epochs"]):
        for batch in batches:
            loss = F.mse_loss(model(batch["x"]), batch["y"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            record(config, epoch, batch["id"], optimizer)
        ray.train.report({"epoch": epoch, "loss": loss.item()})


def make_trainer(config, data_path, run_uri, scaling_config, run_config):
    # Half a CPU per read and per preprocessing task: the trainers hold the rest.
    dataset = ray.data.read_parquet(data_path, num_cpus=0.5).map_batches(preprocess,
                                                                         num_cpus=0.5)
    return ElasticTorchTrainer(train_func, run_uri=run_uri, train_loop_config=config,
                               datasets={"train": dataset}, scaling_config=scaling_config,
                               run_config=run_config)


def preprocess(batch):
    """Features scaled, a target from them: the pipeline's own work, on Ray Data's workers."""
    x = np.stack([batch[f"x{i}"] for i in range(4)], axis=1) / 4.0
    return {"id": batch["id"], "x": x, "y": x[:, :2].sum(axis=1, keepdims=True) ** 2}


def make_model(config):
    torch.manual_seed(config["seed"])
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def record(config, epoch, ids, optimizer):
    """One JSON line per rank and step (the test's audit); the step is AdamW's count."""
    import json
    import os
    import time

    context = ray.train.get_context()
    line = {"pid": os.getpid(), "rank": context.get_world_rank(),
            "world_size": context.get_world_size(), "epoch": epoch,
            "step": int(next(iter(optimizer.state.values()))["step"]),
            "ids": [int(i) for i in ids], "time": time.time()}
    with open(config["log"], "a") as out:
        out.write(json.dumps(line) + "\n")
    time.sleep(config["pace_s"])
