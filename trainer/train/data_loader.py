"""`ElasticDataLoader`: a `DataLoader`-shaped loader that is elastic, made by a `Session`:
`session.data_loader(dataset, batch_size=64, shuffle=True, seed=0)` (docs/ray-train-loop.md).

- `batch_size` is the global batch: every step trains that many samples over all ranks (with
  `drop_last=False` an epoch's tail is one shorter last step) at any world size; each rank gets
  its share (`data_state.share_loader`: fixed microbatches of `microbatch_size`, in contiguous
  blocks). The order depends only on `(seed, epoch)` (`shuffle=False`: dataset order), so a run
  resized or resumed at any world size trains every sample of an epoch exactly once.
- Iterating yields one batch per step, from the committed data position to its epoch's end.
  Asking for the next batch ends the previous step: the cursor advances, then
  `session.step_done()` acts at the boundary (snapshot, preemption, resize, stop). After a stop
  every iteration is empty. After a `break` the next iteration, `set_epoch()` or
  `session.close()` ends the open step if an optimizer step ran since its batch was handed
  out, else the same batch is handed out again.
- `epoch` is the committed position's epoch: loop `for epoch in range(loader.epoch, epochs)`;
  `set_epoch(e)` raises a one-line `ValueError` for another epoch (a loop counting from 0 after
  a restore would train extra epochs). `len(loader)` is the number of steps of an epoch.
- The loop and the session agree on what a step is (`trainer.train.step_checks`, one-line
  `UsageError`s): a batch that went through neither forward nor `optimizer.step()`, a
  `batch_size` other than the restored snapshot's (unless `allow_batch_change=True`, with a
  warning), and, at an uneven split, ranks all-reducing a different number of times.
- Loss weights: so that DDP/FSDP's gradient average is the mean over the step's samples, a
  forward hook on the model scales the gradient into its outputs by the share's weight
  (`StepShare.weight`: 1 for an even split, 0 on an idle rank's stand-in); a mean loss needs no
  change. A step of weight other than 1 whose batch never went through forward fails in one line.
- `microbatches(batch)`: gradient accumulation. It splits the batch (or its parts, `[x, y]`:
  every tensor along dim 0, per-sample lists too) into pieces of `microbatch_size`, each with
  its part of the weight, all but the last under `trainer.train.parallel.grad_sync(model,
  last=False)`: one all-reduce per rank per step (with FSDP2, ranks with fewer pieces add
  zero-weight passes). A piece whose forward did not run inside the loop over it is a `UsageError`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from data_state import ShareLoader, StepShare, StreamShareLoader
from elastic.errors import FatalRunError
from trainer.train import step_checks
from trainer.train.parallel import grad_sync, parallelism_of, unwrapped
from trainer.train.session_setup import UsageError
from trainer.train.story import ORIGIN_KEY, DataOrigin
from trainer.train.stream_data import is_stream, stream_shares


def make_loader(session: LoaderOwner, dataset: Any, *, batch_size: int, microbatch_size: int,
                shuffle: bool, seed: int, collate_fn: Any, drop_last: bool, num_workers: int,
                fingerprint: str | None, allow_batch_change: bool, dtypes: Any = None,
                on_error: str = "raise") -> ElasticDataLoader:
    """`Session.data_loader`'s loader, registered as the session's `data`: settings checked
    under the names the caller used, then the data position and global batch of the snapshot
    the session restored, if any; its `data_origin` records this session's global batch."""
    if "data" in session.registry.keys():
        raise UsageError("Session.data_loader: this session already has its data loader "
                         "(data=... or an earlier data_loader call): make one")
    if session.step != session.start_step:
        raise UsageError("Session.data_loader: make the loader before the first step")
    stream = is_stream(dataset)
    _check_settings(None if stream else dataset, batch_size, microbatch_size, seed, num_workers,
                    drop_last)
    if not stream and (dtypes is not None or on_error != "raise"):
        raise UsageError("session.data_loader: dtypes and on_error are for a Ray Dataset; a "
                         "map-style dataset's collate_fn makes its tensors")
    restored = session.snapshotter.restored_state
    step_checks.check_global_batch(restored.get(ORIGIN_KEY), batch_size, allow_batch_change,
                                   session.start_step)
    saved = restored.get("data")
    shares: ShareLoader | StreamShareLoader
    if stream:
        shares = stream_shares(dataset, rank=session.rank, world_size=session.world_size,
                               batch_size=batch_size, microbatch_size=microbatch_size,
                               seed=seed, shuffle=shuffle, drop_last=drop_last,
                               collate_fn=collate_fn, dtypes=dtypes, on_error=on_error,
                               num_workers=num_workers, fingerprint=fingerprint)
    else:
        shares = ShareLoader(dataset, global_batch=batch_size, microbatch_size=microbatch_size,
                             seed=seed, shuffle=shuffle, drop_last=drop_last,
                             collate_fn=collate_fn, num_workers=num_workers, rank=session.rank,
                             world_size=session.world_size, fingerprint=fingerprint)
    if saved is not None:
        try:
            shares.load_state_dict(saved)
        except ValueError as err:  # another dataset, seed or shuffle: the same on a restart
            shares.close()
            raise FatalRunError(f"the data loader does not fit the snapshot it continues: "
                                f"{err}") from err
    loader = ElasticDataLoader(session, shares, session.model)
    session.registry.register("data", loader)
    session.registry.register(ORIGIN_KEY, DataOrigin(shares, session), optional=True)
    return loader


def _check_settings(dataset: Any, batch_size: Any, microbatch_size: Any, seed: Any,
                    num_workers: Any, drop_last: bool) -> None:
    """Settings of any loader; a map-style `dataset`'s length (None: a Ray Dataset)."""
    def whole(name: str, value: Any, low: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UsageError(f"session.data_loader: {name} must be an integer >= {low}, got "
                             f"{value!r}")

    whole("batch_size", batch_size, 1)
    whole("microbatch_size", microbatch_size, 1)
    whole("num_workers", num_workers, 0)
    whole("seed", seed, 0)
    if seed >= 1 << 63:
        raise UsageError(f"session.data_loader: seed must be below 2**63, got {seed}")
    if batch_size % microbatch_size:
        raise UsageError(f"session.data_loader: batch_size ({batch_size}) must be a multiple "
                         f"of microbatch_size ({microbatch_size})")
    if dataset is None:  # a Ray Dataset: checked as its units are read
        return
    if not hasattr(dataset, "__len__"):
        raise UsageError("session.data_loader: the dataset has no len(): pass a map-style "
                         "Dataset (__len__, __getitem__) or a data_state.TokenDataset")
    if drop_last and batch_size > len(dataset):
        raise UsageError(f"session.data_loader: batch_size ({batch_size}) is larger than the "
                         f"dataset ({len(dataset)} samples) and drop_last=True: no step fits "
                         "an epoch; lower batch_size or pass drop_last=False")
    if len(dataset) == 0:
        raise UsageError("session.data_loader: the dataset is empty")


class StepCounter(Protocol):
    """What the loader needs from its `Session`."""

    optimizer_steps: int  # optimizer.step() calls so far (the session's pre-hook counts them)

    @property
    def step(self) -> int: ...

    def step_done(self, *, boundary: bool = False) -> bool: ...


class LoaderOwner(StepCounter, Protocol):
    """What `make_loader` needs from its `Session`: the steps, this rank's share, the model,
    the state it restored and its registry."""

    rank: int
    world_size: int
    model: nn.Module
    start_step: int
    snapshotter: Any  # `restored_state`: the restored snapshot's JSON state per component
    registry: Any


class ElasticDataLoader:
    """See the module docstring."""

    def __init__(self, session: StepCounter, shares: ShareLoader | StreamShareLoader,
                 model: nn.Module) -> None:
        self._session = session
        self.shares = shares
        self._model = model
        self._handed: StepShare | None = None  # the share of the step still open
        self._handed_at = 0  # the session's optimizer_steps when it was handed out
        self._scale = 1.0  # the weight the next forward's gradients get
        self._forwards = 0  # forwards (with gradients) since the share was handed out
        self.stopped = False
        self._hook = unwrapped(model).register_forward_hook(self._on_forward)
        self._passes = step_checks.SyncPasses(model)

    # ------------------------------------------------------------------ DataLoader's face

    def __len__(self) -> int:
        return self.shares.steps_per_epoch

    @property
    def epoch(self) -> int:
        """The epoch of the committed data position."""
        return self.shares.cursor.epoch

    @property
    def microbatch_size(self) -> int:
        return self.shares.microbatch_size

    @property
    def sample_indices(self) -> tuple[int, ...]:
        """Dataset indices of the batch handed out last, while its step is open (empty on an
        idle rank: its batch is a stand-in): for audits of which samples a rank trained."""
        return self._handed.sample_indices if self._handed is not None else ()

    @property
    def weight(self) -> float:
        """The loss weight of the batch handed out last (1 when no step is open)."""
        return self._handed.weight if self._handed is not None else 1.0

    def set_epoch(self, epoch: int) -> None:
        self.end_open_step()
        if not self.stopped and epoch != self.epoch:
            raise UsageError(
                f"loader.set_epoch({epoch}): the data position is in epoch {self.epoch} (a "
                "restored run continues its epoch); loop over range(loader.epoch, epochs)")

    def __iter__(self) -> Iterator[Any]:
        self.end_open_step()
        epoch = self.epoch
        while not self.stopped:
            share = self.shares.next_step()
            self._handed, self._handed_at = share, self._session.optimizer_steps
            self._scale, self._forwards = share.weight, 0
            self._passes.begin(self._session.step + 1, step_checks.uneven(
                share.step_samples, share.microbatch_size, share.num_microbatches,
                self.shares.world_size), len(share.sample_indices), share.step_samples)
            yield share.batch
            step_checks.refuse_untrained(self._session.step + 1, self._forwards,
                                         self._session.optimizer_steps > self._handed_at)
            self._end_step()  # the loop asked for the next batch: its step is done
            if self.epoch != epoch:
                return

    def microbatches(self, batch: Any) -> Iterator[Any]:
        """Pieces of the batch just handed out, for gradient accumulation (module doc)."""
        share = self._handed
        count = len(share.sample_indices) or _length(share.batch) if share is not None else 0
        if share is None or _length(batch) != count:
            raise UsageError("loader.microbatches(batch): pass the batch this loader has just "
                             "handed out (or its parts, e.g. [x, y]), inside the loop over it")
        pieces = _split(batch, self.microbatch_size, count)
        passes = len(pieces)
        if parallelism_of(self._model) == "fsdp":
            world_size = self.shares.world_size
            passes = max(passes, -(-share.num_microbatches // world_size))
        try:
            for i in range(passes):
                real = i < len(pieces)
                piece = pieces[i] if real else pieces[-1]
                self._scale = share.weight * _length(piece) / count if real else 0.0
                before = self._forwards
                with grad_sync(self._model, last=i == passes - 1):
                    yield piece
                if self._forwards == before:  # list(...) of the pieces, or a skipped one
                    raise UsageError(
                        "loader.microbatches: run each piece's forward and backward inside "
                        "the loop over it (its weight and gradient sync apply only there)")
        finally:
            self._scale = share.weight

    def state_dict(self) -> dict[str, Any]:
        return self.shares.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shares.load_state_dict(state)

    def reshard(self, *, rank: int, world_size: int) -> None:
        self.shares.reshard(rank=rank, world_size=world_size)

    def close(self) -> None:
        self._hook.remove()
        self._passes.close()
        self.shares.close()

    # ------------------------------------------------------------------ step ends

    def end_open_step(self) -> None:
        """End a step left open by a `break`: done if an optimizer step ran since its batch
        was handed out; otherwise its batch is handed out again."""
        if self._handed is None:
            return
        if self._session.optimizer_steps > self._handed_at:
            self._end_step()
        else:
            self._handed = None

    def _end_step(self) -> None:
        share, self._handed = self._handed, None
        assert share is not None
        if share.weight != 1.0 and self._forwards == 0:
            raise UsageError(
                f"step {share.step}: this rank's batch carries loss weight {share.weight:.4g} "
                "but never went through the model's forward, so the weight could not be "
                "applied: compute the loss from the model passed to Session(...)")
        self._passes.end()  # every rank all-reduced as often (an uneven split)
        epoch = self.epoch
        self.shares.advance()
        if self._session.step_done(boundary=self.epoch != epoch):
            self.stopped = True

    def _on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or self._handed is None:
            return
        self._forwards += 1
        weight = self._scale
        if weight == 1.0:
            return  # exactly the plain gradient
        for tensor in tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(functools.partial(_scaled, weight))


def _scaled(weight: float, grad: torch.Tensor) -> torch.Tensor:
    # zeros, not grad * 0: a stand-in's non-finite gradient must not leak into the sum.
    return grad * weight if weight else torch.zeros_like(grad)


def _length(batch: Any) -> int:
    """The number of samples in a collated batch (its first tensor's dim 0)."""
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ValueError("loader.microbatches: the batch holds no tensor to split")


def _split(batch: Any, size: int, count: int) -> list[Any]:
    """`batch` cut into pieces of `size` samples (of `count`): tensors along dim 0, lists
    and tuples of `count` non-tensor items (a collated list of strings) by item."""
    starts = range(0, count, size)

    def cut(value: Any) -> list[Any]:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return [value[s:s + size] for s in starts]
        if isinstance(value, dict):
            parts = {k: cut(v) for k, v in value.items()}
            return [type(value)({k: p[i] for k, p in parts.items()}) for i in range(len(starts))]
        if isinstance(value, (list, tuple)):
            if len(value) == count and not any(isinstance(v, (torch.Tensor, dict, list, tuple))
                                               for v in value):
                return [value[s:s + size] for s in starts]
            columns = [cut(v) for v in value]
            rebuilt = [[c[i] for c in columns] for i in range(len(starts))]
            if hasattr(value, "_fields"):  # a named tuple
                return [type(value)(*r) for r in rebuilt]
            return [type(value)(r) if isinstance(value, tuple) else r for r in rebuilt]
        return [value for _ in starts]  # a scalar or other shared value: every piece has it

    return cut(batch)
