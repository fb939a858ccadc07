"""The loop and the session agree on what a step is, or the step fails in one line.

A `Session` counts a step where the loop asks for the next batch (`session.data_loader`) or
calls `step_done()`; the snapshot, the schedule and the data position trust that count. Each
check catches a loop that disagrees (it would train on silently, or hang) in one `UsageError`
line naming the mistake and the fix.

- `OptimizerSteps(optimizer)`: `stepped(optimizer, step)` from the session's optimizer
  pre-hook, `boundary()` from every `step_done()` (a redone step's too). A second
  `optimizer.step()` with no step boundary in between is refused: a loop with its own
  `DataLoader` that never ends a step is never snapshotted, never stops at `until`, and its next
  run starts cold. (Other optimizers, `extras`, may step more often: `trainer.train.story`
  counts only this one.)
- `refuse_untrained(step, forwards, optimizer_stepped)`: the loop asked for the next batch while
  this one went through no forward (with gradients) and no `optimizer.step()`: thrown away, yet
  counted. That is a Ray loop's resume skip (`if epoch * steps_per_epoch + i < start:
  continue`), wrong with the restored loader, which already starts where the run stopped. A
  batch whose forward ran and whose update the loop skipped (a NaN loss, fp16's overflow)
  counts, as in Baton's loop.
- `check_global_batch(saved_origin, batch_size, allow, step)`: a continuation at another global
  batch than the snapshot's session trained at (`trainer.train.story.DataOrigin`) is refused
  naming both; `allow=True` continues with a warning; a snapshot without one is not checked.
- `SyncPasses(model)`: at a step with an uneven split, the ranks of a DDP model agree on every
  forward pass that will all-reduce gradients (of an FSDP2 model, on every forward pass: each
  gathers the sharded parameters) and, at the step's end, on how many there were (one `MAX`
  all-reduce of `[n, -n]` through `elastic.collectives`), placed so that a rank with one pass
  more meets the others' end-of-step agreement, not their next collective: every rank fails in
  one line instead of hanging (docs/design.md, "Step checks"). The fix it names is
  `loader.microbatches`. Even splits pay nothing; an agreement whose collective failed
  (in-process recovery lost a member: the step is redone) refuses nothing.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from data_state import share
from elastic import collectives
from trainer.train.session_setup import UsageError

log = logging.getLogger("baton.session")

_ACCUMULATE = ("split the batch with `for x_part, y_part in loader.microbatches([x, y]):` "
               "instead, which runs the same collectives on every rank")


class OptimizerSteps:
    """See the module docstring."""

    def __init__(self, optimizer: torch.optim.Optimizer | None) -> None:
        self._optimizer = optimizer
        self._stepped = False  # the optimizer stepped since the last step boundary

    def stepped(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        if optimizer is not self._optimizer:
            return
        if self._stepped:
            raise UsageError(
                f"step {step}: optimizer.step() ran twice without a step boundary, so the "
                "session never snapshots, never stops at until and a new run starts from step "
                "0: iterate session.data_loader(...) in place of your DataLoader (asking for "
                "the next batch ends a step), or call session.step_done() after each step")
        self._stepped = True

    def boundary(self) -> None:
        self._stepped = False


def refuse_untrained(step: int, forwards: int, optimizer_stepped: bool) -> None:
    if forwards or optimizer_stepped:
        return
    raise UsageError(
        f"step {step}: the loop asked for the next batch without training on this one (no "
        "forward through the model, no optimizer.step()), which would count it as trained: "
        "delete a resume skip such as `if epoch * steps_per_epoch + i < start: continue` "
        "(the loader already starts where the run stopped)")


def check_global_batch(saved_origin: Any, batch_size: int, allow: bool, step: int) -> None:
    saved = saved_origin.get("global_batch") if isinstance(saved_origin, dict) else None
    if type(saved) is not int or saved == batch_size:
        return
    if allow:
        log.warning("session.data_loader: continuing at batch_size=%d; the snapshot of step "
                    "%d trained at batch_size=%d (allow_batch_change=True)", batch_size, step,
                    saved)
        return
    raise UsageError(
        f"session.data_loader: batch_size={batch_size}, but the snapshot of step {step} "
        f"trained at batch_size={saved}: batch_size is the global batch, the same at every "
        f"world size (do not divide it by the number of workers); pass batch_size={saved}, "
        f"or allow_batch_change=True to continue at {batch_size}")


def uneven(step_samples: int, microbatch_size: int, num_microbatches: int,
           world_size: int) -> bool:
    """Whether the ranks' batches differ in length at this step (an idle rank's stand-in is
    the step's first microbatch)."""
    lengths = set()
    for rank in range(world_size):
        block = share(num_microbatches, rank=rank, world_size=world_size)
        if not block:
            block = range(0, 1)
        lengths.add(min(block.stop * microbatch_size, step_samples)
                    - min(block.start * microbatch_size, step_samples))
    return len(lengths) > 1


class SyncPasses:
    """See the module docstring."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._armed = False
        self._passes = 0
        self._counted = False  # the wrapper's hook counted the forward now running
        self._where = ""  # the step and this rank's share, for the message
        self._hooks: list[Any] = []
        # What each pass does collectively, for the messages.
        self._sharded = isinstance(model, FSDPModule)
        if isinstance(model, DistributedDataParallel):
            self._hooks = [
                model.register_forward_pre_hook(self._before_wrapper, prepend=True),
                model.module.register_forward_pre_hook(self._before_module, prepend=True),
            ]
        elif self._sharded:  # before FSDP2's own pre-forward hook and its all-gather
            self._hooks = [model.register_forward_pre_hook(self._before_sharded, prepend=True)]

    def begin(self, step: int, armed: bool, samples: int, step_samples: int) -> None:
        """A batch was handed out: count its passes (`armed`: at an uneven split)."""
        self._armed = armed and bool(self._hooks)
        self._passes, self._counted = 0, False
        self._where = f"step {step}: this rank holds {samples} of the step's {step_samples} samples"

    def end(self) -> None:
        """The step ends: every rank ran as many all-reducing passes, or `UsageError`."""
        if not self._armed:
            return
        self._armed = False
        low, high = _agree(self._passes)
        if low != high:
            done = ("gathered its sharded parameters" if self._sharded
                    else "all-reduced its gradients")
            raise UsageError(
                f"{self._where} and {done} {self._passes} time(s), another rank "
                f"{high if high != self._passes else low}: {self._why()}")

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def _syncs(self) -> bool:
        """This forward, at an armed step, will all-reduce gradients in its backward."""
        return (self._armed and torch.is_grad_enabled()
                and bool(getattr(self._model, "require_backward_grad_sync", True)))

    def _before_wrapper(self, module: nn.Module, args: Any) -> None:
        if self._passes and self._syncs():  # a later pass: before DDP's forward
            self._counted = True
            self._count()

    def _before_sharded(self, module: nn.Module, args: Any) -> None:
        if self._armed:  # with or without gradients, an FSDP2 forward all-gathers
            self._count()

    def _before_module(self, module: nn.Module, args: Any) -> None:
        if self._counted:
            self._counted = False
        elif not self._passes and self._syncs():  # the first: after DDP's pre-forward
            self._count()

    def _count(self) -> None:
        self._passes += 1
        low, high = _agree(self._passes)
        if low != high:
            self._armed, self._counted = False, False  # the step failed: nothing more to agree
            would = ("would gather the sharded parameters" if self._sharded
                     else "would all-reduce gradients")
            raise UsageError(
                f"{self._where}; its forward pass {self._passes} {would} while another rank "
                f"ended the step after {low}: {self._why()}")

    def _why(self) -> str:
        layout = "FSDP2" if self._sharded else "DDP"
        return (f"a loop's own gradient accumulation at an uneven split runs a different "
                f"number of collectives on each rank ({layout} hangs); {_ACCUMULATE}")


def _agree(value: int) -> tuple[int, int]:
    """The smallest and largest `value` over the ranks (every rank calls it)."""
    if not collectives.grouped():
        return value, value
    both = torch.tensor([value, -value], dtype=torch.int64, device=collectives.group_device())
    group = collectives.installed()
    if group is None:
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
    elif group.all_reduce(both, dist.ReduceOp.MAX) is False:
        # In-process recovery's group failed (a member lost): the step is redone, and what
        # the aborted collective left in `both` says nothing about the loop.
        return value, value
    return -int(both[1].item()), int(both[0].item())
