"""The resumable, world-size-free loader: fixed microbatches per step, shared out to workers.

- A step is `M = global_batch / microbatch_size` microbatches, a pure function of the cursor:
  microbatch m of the step at cursor `(seed, epoch, c)` holds positions `[c + m*b, c + (m+1)*b)`
  of `Permutation(len(dataset), seed=seed, epoch=epoch)` (b = microbatch_size), whatever the
  world size; worker `rank` only chooses which microbatches it materialises
  (`cursor.assign_microbatches`: contiguous balanced blocks).
- The loop (docs/data.md, "The loader"): `with ResumableLoader(ds, global_batch=...,
  microbatch_size=..., seed=..., rank=..., world_size=...) as loader`, optionally
  `loader.load_state_dict(saved)` (any world size); per step `for mb in loader.next_step()`
  (this rank's microbatches, each loss divided by `mb.num_microbatches`, gradients summed over
  ranks), the optimizer step, then `loader.advance()`; `state_dict()` is JSON, no rank.
- `next_step()` is idempotent until `advance()` (it returns the same step again, e.g. to redo a
  failed one). Prefetched steps are never counted: the cursor moves only in `advance()`, after
  the step's optimizer update. `pending` is True in between (`trainer.train.session.Session`
  refuses to end a step while its loader is pending).
- `reshard(rank=..., world_size=...)` changes this worker's share in place (a resize);
  `load_state_dict` restores a cursor saved under any world size; both drop prefetched work.
  `check_state(state)` is `load_state_dict`'s refusal without the load (a `ValueError` naming
  the field: another dataset or seed, a position past the epoch's end, a counter out of range,
  the end of the last epoch a cursor can hold): a restore asks it before reading.
- Epochs end when fewer than `global_batch` positions remain (the tail dropped: `cursor.py`);
  `drop_last=False` trains the tail as a shorter last step. `shuffle=False` reads every epoch
  in dataset order (recorded in the cursor's fingerprint: a shuffled run's snapshot is refused
  by an in-order loader and back).
- Subclasses choose what a step's part becomes (`_materialize`): token microbatches here,
  collated items in `data_state.map_loader`.
- A background thread prefetches up to `prefetch_steps` steps into a bounded queue; its errors
  (a corrupt shard) are raised by `next_step()`. `close()` (or leaving the `with` block) stops
  and joins it; the loader restarts it lazily if used again.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from data_state.cursor import (
    DataCursor,
    assign_microbatches,
    share,
    step_samples,
    steps_per_epoch,
)
from data_state.order import Permutation

if TYPE_CHECKING:  # torch only as a type: a numpy source needs none (data_state.numpy_source)
    import torch

Order = Callable[[np.ndarray], Any]  # positions of an epoch -> sample indices


class SampleSource(Protocol):
    """What the loader needs from a dataset (`TokenDataset` is one)."""

    fingerprint: str
    seq_len: int

    def __len__(self) -> int: ...

    def batch(self, indices: Sequence[int] | np.ndarray) -> torch.Tensor: ...


@dataclass(frozen=True)
class Microbatch:
    # (microbatch_size, seq_len), int64: what the source's batch() gives (a numpy array from
    # `data_state.numpy_source.NumpySamples`, for JAX)
    tokens: torch.Tensor
    index: int  # m in [0, num_microbatches): its place in the step (seeds its sketches)
    sample_indices: tuple[int, ...]  # global sample (sequence) indices, row by row
    num_microbatches: int  # M, the same on every worker
    step: int  # epoch * steps_per_epoch + step within the epoch (for a fixed global_batch)
    epoch: int


@dataclass(frozen=True)
class StepPlan:
    """Where the step at a cursor lies in its epoch's order, and this rank's part of it."""

    epoch: int
    step: int  # epoch * steps_per_epoch + step within the epoch
    first: int  # the step's first position in the epoch's order
    samples: int  # samples in the step (global_batch, or a kept tail)
    microbatch_size: int
    num_microbatches: int  # ceil(samples / microbatch_size)
    mine: range  # this rank's microbatches (empty: an idle rank)

    def span(self, microbatches: range) -> tuple[int, int]:
        """Positions [start, stop) of a contiguous block of this step's microbatches."""
        b = self.microbatch_size
        start = self.first + min(microbatches.start * b, self.samples)
        return start, self.first + min(microbatches.stop * b, self.samples)


class ResumableLoader:
    """See the module docstring."""

    # Whether ranks past the step's microbatch count may exist (they get an empty part).
    allow_idle_ranks = False

    def __init__(
        self,
        dataset: SampleSource,
        *,
        global_batch: int,
        microbatch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        prefetch_steps: int = 2,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if microbatch_size < 1 or global_batch < 1:
            raise ValueError(
                f"global_batch ({global_batch}) and microbatch_size ({microbatch_size}) "
                "must be >= 1"
            )
        if global_batch % microbatch_size:
            raise ValueError(
                f"global_batch ({global_batch}) must be a multiple of microbatch_size "
                f"({microbatch_size}): a step is a whole number of fixed microbatches"
            )
        if global_batch > len(dataset):
            raise ValueError(
                f"global_batch ({global_batch}) is larger than the dataset ({len(dataset)} "
                "sequences): no full step fits in an epoch"
            )
        if not 0 <= seed < 1 << 63:
            raise ValueError(f"seed must be in [0, 2**63), got {seed}")
        if prefetch_steps < 1:
            raise ValueError(f"prefetch_steps must be >= 1, got {prefetch_steps}")
        self.dataset = dataset
        self.global_batch, self.microbatch_size = global_batch, microbatch_size
        self.num_microbatches = global_batch // microbatch_size
        self.shuffle, self.drop_last = shuffle, drop_last
        self.steps_per_epoch = steps_per_epoch(len(dataset), global_batch, drop_last)
        self.prefetch_steps = prefetch_steps
        # An in-order run's positions name other samples than a shuffled run's: its cursor
        # must not be taken for the other's.
        self.fingerprint = dataset.fingerprint + ("" if shuffle else "+in-order")
        self._cursor = DataCursor(self.fingerprint, seed, 0, 0)
        self.rank, self.world_size = rank, world_size
        self._mine = self._share(rank, world_size)
        self._pending: Any = None
        self._prefetcher: _Prefetcher | None = None

    @property
    def cursor(self) -> DataCursor:
        """The committed position: where the next step starts."""
        return self._cursor

    @property
    def microbatches(self) -> range:
        """Indices of the microbatches this worker trains in every full step."""
        return self._mine

    @property
    def pending(self) -> bool:
        """Whether `next_step()` handed out a step that `advance()` has not committed."""
        return self._pending is not None

    def next_step(self) -> list[Microbatch]:
        """This worker's microbatches of the step at the committed cursor."""
        return list(self._fetch())

    def _fetch(self) -> Any:
        """This worker's part of the step at the committed cursor (`_materialize`'s)."""
        if self._pending is None:
            if self._prefetcher is None:
                self._prefetcher = _Prefetcher(
                    build=self._builder(),
                    start=self._cursor,
                    advance=self._after,
                    depth=self.prefetch_steps,
                    name=f"baton-data-prefetch-rank{self.rank}",
                )
            cursor, result = self._prefetcher.get()
            if isinstance(result, BaseException):
                self._stop_prefetch()  # a later call retries from the committed cursor
                raise result
            assert cursor == self._cursor, "prefetcher out of step with the committed cursor"
            self._pending = result
        return self._pending

    def advance(self) -> None:
        """Commit the step returned by `next_step()`: call after its optimizer update."""
        if self._pending is None:
            raise RuntimeError("advance() without a step: call next_step() and train on it first")
        self._pending = None
        self._cursor = self._after(self._cursor)

    def state_dict(self) -> dict[str, Any]:
        return self._cursor.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        cursor = self.check_state(state)
        self._stop_prefetch()
        self._cursor = cursor

    def check_state(self, state: Any) -> DataCursor:
        """The cursor `state` (a `state_dict()`) holds, normalized for this loader, or
        `ValueError` naming the field: another dataset or seed, a position past the epoch's
        end, a counter out of range (`cursor.py`); nothing changes."""
        cursor = DataCursor.from_dict(state)
        if cursor.dataset != self.fingerprint:
            raise ValueError(
                f"data cursor is for dataset {cursor.dataset!r} but this loader reads "
                f"{self.fingerprint!r} ({self.dataset!r}): resume with the dataset (and the "
                "shuffle setting) the run was started with"
            )
        if cursor.seed != self._cursor.seed:
            raise ValueError(
                f"data cursor field 'seed' is {cursor.seed} but the loader was built with seed "
                f"{self._cursor.seed}: build it with the run's seed, or start a new run"
            )
        if cursor.samples_consumed > len(self.dataset):
            raise ValueError(
                f"data cursor field 'samples_consumed' is {cursor.samples_consumed} but an "
                f"epoch of {self.dataset!r} has {len(self.dataset)} samples: the cursor is "
                "corrupt or was edited"
            )
        return cursor.normalized(num_samples=len(self.dataset), global_batch=self.global_batch,
                                 drop_last=self.drop_last)

    def reshard(self, *, rank: int, world_size: int) -> None:
        """Become worker `rank` of `world_size` from the committed cursor on (a resize)."""
        mine = self._share(rank, world_size)
        self._stop_prefetch()
        self.rank, self.world_size, self._mine = rank, world_size, mine

    def global_samples(self, cursor: DataCursor) -> list[int]:
        """Every sample index the step at `cursor` trains, over all ranks, sorted."""
        plan = self._plan(cursor, 0, 1)
        start, stop = plan.span(plan.mine)
        order = self._order(cursor.seed, cursor.epoch)
        return sorted(int(i) for i in np.asarray(order(np.arange(start, stop))))

    def close(self) -> None:
        self._stop_prefetch()

    def __enter__(self) -> ResumableLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------

    def _after(self, cursor: DataCursor) -> DataCursor:
        return cursor.advanced(num_samples=len(self.dataset), global_batch=self.global_batch,
                               drop_last=self.drop_last)

    def _share(self, rank: int, world_size: int) -> range:
        """This rank's microbatches of a full step (checked: a rank past them is an error
        unless the loader allows idle ranks)."""
        pick = share if self.allow_idle_ranks else assign_microbatches
        return pick(self.num_microbatches, rank=rank, world_size=world_size)

    def _stop_prefetch(self) -> None:
        self._pending = None
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def _order(self, seed: int, epoch: int) -> Order:
        """Positions of epoch `epoch` -> sample indices (the identity when not shuffling)."""
        if not self.shuffle:
            return lambda positions: positions
        return Permutation(len(self.dataset), seed=seed, epoch=epoch)

    def _plan(self, cursor: DataCursor, rank: int, world_size: int) -> StepPlan:
        b = self.microbatch_size
        samples = step_samples(cursor, num_samples=len(self.dataset),
                               global_batch=self.global_batch)
        count = -(-samples // b)
        return StepPlan(
            epoch=cursor.epoch,
            step=cursor.epoch * self.steps_per_epoch + cursor.samples_consumed // self.global_batch,
            first=cursor.samples_consumed, samples=samples, microbatch_size=b,
            num_microbatches=count, mine=share(count, rank=rank, world_size=world_size))

    def _builder(self) -> Callable[[DataCursor], Any]:
        """A function building this worker's part of the step at a cursor (it runs on the
        prefetch thread; a reshard replaces it)."""
        rank, world_size = self.rank, self.world_size
        orders: dict[tuple[int, int], Order] = {}

        def build(cursor: DataCursor) -> Any:
            key = (cursor.seed, cursor.epoch)
            if key not in orders:
                orders.clear()
                orders[key] = self._order(*key)
            return self._materialize(self._plan(cursor, rank, world_size), orders[key])

        return build

    def _materialize(self, plan: StepPlan, order: Order) -> list[Microbatch]:
        """This rank's microbatches of the step `plan` describes."""
        start, stop = plan.span(plan.mine)
        indices = np.asarray(order(np.arange(start, stop)))
        tokens = self.dataset.batch(indices)
        out = []
        for m in plan.mine:
            lo, hi = (p - start for p in plan.span(range(m, m + 1)))
            out.append(Microbatch(tokens=tokens[lo:hi], index=m,
                                  sample_indices=tuple(indices[lo:hi].tolist()),
                                  num_microbatches=plan.num_microbatches, step=plan.step,
                                  epoch=plan.epoch))
        return out


class _Prefetcher:
    """One thread building consecutive steps into a bounded queue; `close()` joins it."""

    _POLL_S = 0.05  # how often a blocked thread rechecks the stop flag

    def __init__(
        self,
        *,
        build: Callable[[DataCursor], Any],
        start: DataCursor,
        advance: Callable[[DataCursor], DataCursor],
        depth: int,
        name: str,
    ) -> None:
        self._build, self._advance = build, advance
        self._queue: queue.Queue[tuple[DataCursor, Any]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        # daemon: a loader that is never closed must not keep the interpreter alive.
        self._thread = threading.Thread(target=self._run, args=(start,), name=name, daemon=True)
        self._thread.start()

    def get(self) -> tuple[DataCursor, list[Microbatch] | BaseException]:
        while True:
            try:
                return self._queue.get(timeout=self._POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("data prefetch thread ended without a result") from None

    def close(self) -> None:
        self._stop.set()
        # Make room so a thread blocked in put() returns at once instead of at its next poll.
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join()

    def _run(self, cursor: DataCursor) -> None:
        try:
            while not self._stop.is_set():
                if not self._put((cursor, self._build(cursor))):
                    return
                cursor = self._advance(cursor)
        except BaseException as err:  # handed to the consumer, raised by next_step()
            self._put((cursor, err))

    def _put(self, item: tuple[DataCursor, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=self._POLL_S)
                return True
            except queue.Full:
                continue
        return False
