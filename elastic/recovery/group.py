"""``ElasticGroup``: a process group whose members change while the processes live on.

Contract
--------
- ``ElasticGroup(device, timeout_s)`` holds one reconfigurable process group of torchft
  (``torchft.process_group.ProcessGroupGloo``, or ``ProcessGroupNCCL`` for a CUDA device):
  ``configure(rendezvous, rank, world_size, generation)`` tears down the previous group and
  forms the membership's (every member calls it with the same rendezvous, which is new per
  generation: ``elastic.coord.membership``); it raises if the group cannot form within
  ``timeout_s`` (a member gone again: the caller falls back). Alone (``world_size`` 1) it
  forms nothing.
- It is an ``elastic.collectives.Group``: ``all_reduce``, ``broadcast``, ``all_gather``,
  ``exchange``. Each waits at most ``timeout_s`` (never torch's 30 minutes). A collective
  that fails (a member lost, a timeout) or that is asked for once the membership has moved
  on (``superseded``, set by ``elastic.recovery.member``) does not raise: the group records
  the first failure (``failure``), aborts its process group at once — which closes its
  connections, so every other member's collective fails at once too instead of waiting
  out the timeout — and from then on every collective returns at once, leaving its tensors
  as they were. The step it happened in is redone on the next membership, so nothing a
  failed collective left behind is used. ``configure`` clears the failure.
- Why torchft's process groups and not torch.distributed's own: a DDP model and FSDP2 hold
  their process group for life, a replacement worker would have to form a group with
  members that are mid-training, and NCCL's watchdog ends the process on a collective
  timeout. torchft's groups reconfigure in place (new store prefix, rank and size), and its
  NCCL group aborts a timed-out communicator (``ncclCommAbort``) and lives on: what keeps a
  survivor at thousands of GPUs alive. docs/design.md §2 compares the two.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

log = logging.getLogger("baton.recovery")


class GroupUnavailableError(RuntimeError):
    """torchft is not installed (or not for this platform): no in-process recovery."""


def _torchft_group(device: torch.device, timeout: timedelta) -> object:
    try:
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
    except ImportError as err:
        raise GroupUnavailableError(
            f"torchft is not importable ({err}); in-process recovery needs it "
            "(pip install 'torchft>=0.2,<0.3' on Linux)") from err
    if device.type == "cuda":
        return ProcessGroupNCCL(timeout=timeout)
    return ProcessGroupGloo(timeout=timeout)


class ElasticGroup:
    """See the module docstring."""

    def __init__(self, device: torch.device, timeout_s: float) -> None:
        self.device = device
        self.timeout_s = timeout_s
        self._pg: object = _torchft_group(device, timedelta(seconds=timeout_s))
        self.rank, self.world_size, self.generation = 0, 1, -1
        self.failure: str | None = None  # the first failure since the last configure
        self.failed_at = 0.0  # time.monotonic() of that failure
        self._lock = threading.Lock()
        # Set by the member: True once the membership has moved past this generation.
        self.superseded: Callable[[], bool] = lambda: False

    @property
    def broken(self) -> bool:
        return self.failure is not None

    # ------------------------------------------------------------------ membership

    def configure(self, rendezvous: str, rank: int, world_size: int, generation: int) -> None:
        """Form this generation's group (every member calls it); raises if it cannot."""
        self._abort()
        if world_size > 1:
            self._pg.configure(rendezvous, f"baton-{generation}-{rank}",  # type: ignore[attr-defined]
                               rank, world_size)
        with self._lock:
            self.rank, self.world_size, self.generation = rank, world_size, generation
            self.failure = None

    def fail(self, reason: str) -> None:
        """Record a failure (the first one is kept) and close the group's connections."""
        with self._lock:
            first = self.failure is None
            if first:
                self.failure, self.failed_at = reason, time.monotonic()
        if first:
            log.warning("process group of generation %d failed: %s", self.generation, reason)
            self._abort()

    def close(self) -> None:
        self._abort()

    def _abort(self) -> None:
        try:
            self._pg.abort(errored=False)  # type: ignore[attr-defined]
        except Exception as err:  # noqa: BLE001 - an abort is best effort
            log.debug("abort of the process group: %r", err)

    # ------------------------------------------------------------------ collectives

    def _run(self, what: str, launch: Callable[[], list[object]]) -> bool:
        """Launch the works of one collective and wait for them; False if the group is
        (or became) broken."""
        if self.failure is not None:
            return False
        if self.superseded():
            self.fail(f"{what}: the membership moved on")
            return False
        try:
            for work in launch():
                work.wait()  # type: ignore[attr-defined]
        except Exception as err:  # noqa: BLE001 - any failure of a peer (module docstring)
            self.fail(f"{what}: {' '.join(str(err).split())[:300]}")
            return False
        return True

    def all_reduce(self, tensor: torch.Tensor,
                   op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> bool:
        return self._run("all_reduce", lambda: [self._pg.allreduce([tensor], op)])  # type: ignore[attr-defined]

    def broadcast(self, tensor: torch.Tensor, src: int) -> bool:
        return self._run("broadcast", lambda: [self._pg.broadcast_one(tensor, src)])  # type: ignore[attr-defined]

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> bool:
        def launch() -> list[object]:
            return [self._pg.allgather([outputs], [tensor], AllgatherOptions())]  # type: ignore[attr-defined]

        return self._run("all_gather", launch)

    def exchange(self, sends: list[tuple[torch.Tensor, int, int]],
                 recvs: list[tuple[torch.Tensor, int, int]]) -> bool:
        def launch() -> list[object]:
            works = [self._pg.send([t], peer, tag) for t, peer, tag in sends]  # type: ignore[attr-defined]
            works += [self._pg.recv([t], peer, tag) for t, peer, tag in recvs]  # type: ignore[attr-defined]
            return works

        return self._run("send/recv", launch)
