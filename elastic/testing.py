"""Helpers for tests of elastic snapshots: a tiny model, deterministic steps, process groups.

Contract: everything here is deterministic given ``seed``; ``run_group`` runs a picklable
function on ``world_size`` spawned processes (gloo, or NCCL with one GPU per rank) and
re-raises the first child's error; a rank that succeeded leaves through
``leave_spawned_rank`` (no interpreter teardown).
Every rank trains on the same batch, so DDP/FSDP2 gradients equal the single-process ones
up to the averaging's rounding (exact for world sizes that are powers of two).
Not used by production code; lives in the package so spawned processes can import it.
"""

from __future__ import annotations

import gc
import os
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from elastic.state import StateRegistry, encode_tree


class TinyNet(nn.Module):
    """Uneven row counts on purpose: 2-row layers give empty FSDP2 shards at 3-4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 24)
        self.mid = nn.Linear(24, 10)
        self.out = nn.Linear(10, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.nn.functional.gelu(self.mid(torch.nn.functional.gelu(self.inp(x)))))


@dataclass
class Cursor:
    """A stand-in for the data cursor: plain JSON state."""

    samples: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.samples = int(sd["samples"])


@dataclass
class TrainState:
    model: nn.Module
    optim: torch.optim.Optimizer
    sched: Any
    cursor: Cursor
    registry: StateRegistry


def build(seed: int, layout: str = "plain", world_size: int = 1,
          device: str = "cpu") -> TrainState:
    torch.manual_seed(seed)
    net = TinyNet().to(device)
    model: nn.Module = net
    if layout == "ddp" and world_size > 1:
        model = nn.parallel.DistributedDataParallel(model)
    elif layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for sub in (net.inp, net.mid, net.out):
            fully_shard(sub, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    cursor = Cursor()
    registry = StateRegistry()
    registry.register("model", model)
    registry.register("optim", optim)
    registry.register("sched", sched)
    registry.register("data", cursor)
    return TrainState(model, optim, sched, cursor, registry)


def train_step(ts: TrainState, step: int, batch: int = 6,
               before_update: Callable[[], None] | None = None) -> None:
    """Step ``step`` (1-based): the batch depends only on ``step``. ``before_update`` runs
    between backward and the optimizer step (where a pipelined capture must be waited for)."""
    gen = torch.Generator().manual_seed(1000 + step)
    device = next(ts.model.parameters()).device
    x = torch.randn(batch, 8, generator=gen).to(device)
    y = torch.randn(batch, 2, generator=gen).to(device)
    loss = (ts.model(x) - y).pow(2).mean()
    ts.optim.zero_grad(set_to_none=True)
    loss.backward()
    if before_update is not None:
        before_update()
    ts.optim.step()
    ts.sched.step()
    ts.cursor.samples += batch


def full_state(ts: TrainState) -> dict[str, torch.Tensor]:
    """Every logical tensor (model, moments, step counters), gathered; all ranks call it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    tensors: dict[str, torch.Tensor] = {}
    encode_tree(get_model_state_dict(ts.model, options=opts), "model", tensors)
    encode_tree(get_optimizer_state_dict(ts.model, ts.optim, options=opts), "optim", tensors)
    return {k: v.detach().cpu().clone() for k, v in tensors.items()}


def restore_fresh(run_uri: str, seed: int = 21) -> tuple[int, dict[str, torch.Tensor]]:
    """A new incarnation at world size 1 restores ``run_uri``: a model and optimizer built
    from ``seed`` (so nothing of the saved state is there before), a coordinator rebuilt from
    the store. Returns the step it restored and its full state."""
    from elastic.snapshotter import Snapshotter

    ts = build(seed=seed)
    step = Snapshotter(run_uri, ts.registry).restore()
    return step, full_state(ts)


def _crashing_child(run_uri: str, phase: str, step: int, durable: bool) -> None:
    from elastic.faults import FaultInjector
    from elastic.settings import SnapshotSettings
    from elastic.snapshotter import Snapshotter

    faults = FaultInjector().arm(phase, step=step, action="exit")
    ts = build(seed=5)
    snap = Snapshotter(run_uri, ts.registry,
                       settings=SnapshotSettings(snapshot_every=2, durable=durable), faults=faults)
    for s in range(1, step + 1):
        train_step(ts, s)
        snap.after_step(s)
        snap.persister.wait()
        snap.coordinator.flush(0)  # retention done (spares retired) before the next step
    snap.close()


def crash_in_child(run_uri: str, phase: str, step: int, *, durable: bool = False) -> None:
    """A hard crash: a spawned process trains ``build(seed=5)`` from step 1, snapshotting
    every 2 steps into ``run_uri``, and exits at once (``os._exit``, exit code 17) at fault
    point ``phase`` of step ``step``'s snapshot. Asserts that it did exit there."""
    import multiprocessing as mp

    child = mp.get_context("spawn").Process(target=_crashing_child,
                                            args=(run_uri, phase, step, durable))
    child.start()
    child.join(120)
    assert child.exitcode == 17, f"the injected os._exit did not happen ({child.exitcode})"


def json_state(ts: TrainState) -> dict[str, Any]:
    return {"sched": ts.sched.state_dict(), "data": ts.cursor.state_dict()}


def _entry(rank: int, world_size: int, init_file: str, backend: str,
           fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    if backend == "nccl":  # one GPU per rank
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise  # torch's spawn reports it to the parent
    leave_spawned_rank()


def leave_spawned_rank() -> NoReturn:
    """End a spawned rank whose work succeeded: collect, destroy the process group while
    the interpreter is whole, flush, and exit 0 without interpreter teardown.

    Why: an FSDP2 model on gloo leaves reference cycles holding its process group and the
    gloo work it ran; collected during interpreter teardown (module globals gone, C++ static
    destructors running) they crash a rank that has finished its work: one SIGABRT
    ("terminate called without an active exception") in test_elastic_reshard and one
    SIGSEGV in test_sketch_distributed's FSDP2 case, each once in many CI runs, at the end.
    Everything the rank wrote is closed by then; stdout and stderr are flushed here."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_group(fn: Callable[..., None], world_size: int, *args: Any, tmp_dir: str,
              backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes joined in a ``backend``
    group (gloo; "nccl": rank r on GPU r)."""
    import torch.multiprocessing as mp

    init_file = os.path.join(tmp_dir, f"pg-{uuid.uuid4().hex}")
    # The children inherit the environment; set one thread for them only and put the
    # caller's value back, so later tests in this process compute as they would alone.
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        mp.spawn(_entry, args=(world_size, init_file, backend, fn, args), nprocs=world_size,
                 join=True)
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = previous


class SnapshotWorker:
    """One training rank as a (Ray actor) object: ``ray.remote(SnapshotWorker)`` in tests.
    Ray is reached only through ``elastic.coord.ray_actors`` (the one Ray module of ``elastic``)."""

    def __init__(self, run_uri: str, rank: int, world_size: int, coordinator_name: str,
                 namespace: str, seed: int = 5, generation: int | None = None,
                 ballast: int = 0) -> None:
        from elastic.coord import RayCoordinatorClient, find_coordinator, ray_ram_tier
        from elastic.settings import SnapshotSettings
        from elastic.snapshotter import Snapshotter

        torch.set_num_threads(1)
        self.ts = build(seed=seed)
        if ballast:  # state of ``ballast`` more float32s, the same in every rank and seed
            self.ts.registry.register("ballast", nn.Linear(ballast, 1, bias=False))
        client = RayCoordinatorClient(find_coordinator(coordinator_name, namespace))
        settings = SnapshotSettings(snapshot_every=2, durable=False, split_min_bytes=64)
        self.snap = Snapshotter(run_uri, self.ts.registry, rank, world_size, settings,
                                coordinator=client, generation=generation,
                                ram_tier=ray_ram_tier(run_uri, cap_bytes=None))
        # Wait for RAM copies as long as a loaded CI machine may take: these tests assert
        # where the copies are, and a put slower than the default grace leaves a shard
        # storage-only (by design, in a real run).
        self.snap.persister.ram_grace_min_s = 20.0
        self.node = self.snap.ram_tier.node if self.snap.ram_tier else None

    def train(self, first: int, last: int) -> list[int]:
        for step in range(first, last + 1):
            train_step(self.ts, step)
            self.snap.after_step(step)
            self.snap.persister.wait()
        return list(self.snap.persister.persisted)

    def restore(self) -> dict[str, Any]:
        step = self.snap.restore()
        return {"step": step, "restored_from": self.snap.restored_from, "node": self.node,
                "storage_reads": self.snap.store.stats.range_reads,
                "state": full_state(self.ts)}

    def state(self) -> dict[str, torch.Tensor]:
        return full_state(self.ts)

    def node_id(self) -> str | None:
        """The Ray node this worker runs on (where its RAM tier's ring starts)."""
        return self.node
