"""The two training loops `benchmarks/recovery/survivors.py` compares, on one model and data.

Both train the same 21k-parameter MLP (`make_model`) with AdamW on the same synthetic
regression set (`make_dataset`, `ITEMS` samples, `GLOBAL_BATCH` per step over all workers, one
epoch of `STEPS` steps), and every worker appends one JSON line per step it trained to
`config["log"]`: its process id, the step, the group's size, the wall time and the dataset
indices it trained (a step redone is there twice). At the end the first worker of the
group writes the model and optimizer state to `config["final"]` (safetensors).

- `baton_train_fn`: a Ray Train loop on Baton (`trainer.Session`, `session.data_loader` with the
  global batch, `ray.train.torch.prepare_model`), run by `trainer.ElasticTorchTrainer` with
  in-process recovery on or off.
- `torchft_train_fn`: the same loop on torchft as Ray 2.60 runs it (`TorchftConfig`, one replica
  group per worker): `torchft.Manager` with a reconfigurable gloo group and live-peer recovery,
  its `DistributedDataParallel` and `Optimizer` wrappers and its `DistributedSampler`, each
  worker a batch of GLOBAL_BATCH / workers samples per step; a batch is logged only when its
  step committed with this worker participating (what torchft drops is not).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

ITEMS = 4800
GLOBAL_BATCH = 48
STEPS = ITEMS // GLOBAL_BATCH  # one epoch
LR = 1e-3


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 1))


def make_dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(ITEMS, 32, generator=generator)
    y = (x[:, :8].sum(dim=1, keepdim=True) * 0.5).tanh() + 0.1 * torch.randn(
        ITEMS, 1, generator=generator)
    return TensorDataset(torch.arange(ITEMS), x, y)


def _log(config: dict[str, Any], step: int, world: int, ids: Any) -> None:
    line = {"pid": os.getpid(), "step": int(step), "world": int(world), "time": time.time(),
            "ids": [int(i) for i in ids]}
    with open(config["log"], "a") as out:
        out.write(json.dumps(line) + "\n")
    time.sleep(config["pace_s"])


def _save_final(config: dict[str, Any], model: nn.Module,
                optimizer: torch.optim.Optimizer) -> None:
    from safetensors.torch import save_file

    tensors = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    tensors[f"optim.{names[id(param)]}.{key}"] = value.detach().clone()
    save_file(tensors, config["final"])


def baton_train_fn(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    from trainer import Session

    model = ray.train.torch.prepare_model(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    session = Session(model, optimizer, snapshot_every=config["snapshot_every"])
    loader = session.data_loader(make_dataset(), batch_size=GLOBAL_BATCH, shuffle=True, seed=0)
    for epoch in range(loader.epoch, 1):  # one epoch: STEPS steps
        loader.set_epoch(epoch)
        for ids, x, y in loader:
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            _log(config, session.step + 1, session.world_size, ids)
    if ray.train.get_context().get_world_rank() == 0:  # the group's (in-process recovery)
        _save_final(config, session.unwrapped_model, optimizer)


def torchft_train_fn(config: dict[str, Any]) -> None:
    import ray.train
    from torchft import DistributedDataParallel, DistributedSampler, Manager, Optimizer
    from torchft import ProcessGroupGloo as FtGloo
    from torchft.checkpointing.pg_transport import PGTransport

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    group = FtGloo(timeout=timedelta(seconds=30))
    manager = Manager(
        pg=group, min_replica_size=1, world_size=1, rank=0,
        replica_id=f"bench_{rank}", timeout=timedelta(seconds=60),
        load_state_dict=lambda s: (model.load_state_dict(s["model"]),
                                   optimizer.load_state_dict(s["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        checkpoint_transport=PGTransport(group, timeout=timedelta(seconds=30),
                                         device=torch.device("cpu")),
    )
    wrapped = DistributedDataParallel(manager, model)
    ft_optimizer = Optimizer(manager, optimizer)
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, replica_rank=rank, num_replica_groups=world,
                                 group_rank=0, num_replicas=1, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=GLOBAL_BATCH // world,
                                         sampler=sampler)
    batches = iter(loader)
    while manager.current_step() < STEPS:
        try:
            ids, x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            ids, x, y = next(batches)
        ft_optimizer.zero_grad()
        loss = F.mse_loss(wrapped(x), y)
        loss.backward()
        before = manager.current_step()
        ft_optimizer.step()  # commits only with the quorum's agreement
        if manager.current_step() > before and manager.is_participating():
            _log(config, manager.current_step(), manager.num_participants(), ids)
        else:  # a batch that no committed step trained
            time.sleep(config["pace_s"])
    if manager.participating_rank() == 0:
        _save_final(config, model, optimizer)
    manager.shutdown()
