"""A rank's share of each fixed global batch, as one batch per step: what a `DataLoader` with
a `DistributedSampler` hands a rank, but world-size free.

Contract:
- `ShareLoader(dataset, global_batch=, microbatch_size=1, seed=, shuffle=True, drop_last=True,
  collate_fn=None, num_workers=0, rank=, world_size=, fingerprint=None)` is a
  `ResumableLoader`: the same keyed order, cursor (no rank, no world size in it), state,
  `reshard()` and `advance()`. Its step part (`next_step()`) is one `StepShare`.
- The dataset is map-style (`__len__`, `__getitem__`; items are collated by `collate_fn`,
  default `torch.utils.data.default_collate`, named as in `data_state.map_loader`) or one of
  Baton's token datasets (`data_state.TokenDataset`, any `SampleSource`: the batch is
  `dataset.batch(indices)`, an int64 tensor; a `collate_fn` is refused there).
- A step's `step_samples` samples (`global_batch`, or a kept tail) form
  `ceil(step_samples / microbatch_size)` microbatches, shared out in contiguous blocks
  (`cursor.share`), so rank r's share holds the same samples at any world size up to the
  microbatch count. A rank past the last microbatch is idle: its share holds the step's first
  microbatch as a stand-in (`idle=True`) with weight 0, so a data-parallel backward still runs
  on every rank (DDP and FSDP reduce gradients in it) and adds nothing.
- `StepShare.weight` is `world_size * len(sample_indices) / step_samples`: the factor on this
  rank's mean loss that turns the gradient average over ranks (DDP, FSDP) into the mean over
  the step's samples whatever the split; 1 for an even split, 0 on an idle rank.
- `num_workers > 0` reads a share's items on that many threads (started by the prefetch
  thread): `__getitem__` and `collate_fn` must be safe to call from other threads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import default_collate

from data_state.loader import Order, ResumableLoader, SampleSource, StepPlan
from data_state.map_loader import MapDataset, map_source


@dataclass(frozen=True)
class StepShare:
    batch: Any  # the collated samples of this share (an idle rank's: the stand-in's)
    sample_indices: tuple[int, ...]  # dataset indices trained by this rank (empty: idle)
    step_samples: int  # samples of the whole step, over all ranks
    microbatch_size: int
    num_microbatches: int  # microbatches of the whole step
    weight: float  # world_size * len(sample_indices) / step_samples
    step: int
    epoch: int

    @property
    def idle(self) -> bool:
        return not self.sample_indices

    @property
    def microbatches(self) -> int:
        """How many of the step's microbatches this share holds (1 for an idle stand-in)."""
        return max(1, -(-len(self.sample_indices) // self.microbatch_size))


def _is_token_dataset(dataset: Any) -> bool:
    return hasattr(dataset, "batch") and hasattr(dataset, "fingerprint")


class ShareLoader(ResumableLoader):
    """See the module docstring."""

    allow_idle_ranks = True

    def __init__(
        self,
        dataset: MapDataset | SampleSource,
        *,
        global_batch: int,
        seed: int,
        microbatch_size: int = 1,
        shuffle: bool = True,
        drop_last: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        rank: int = 0,
        world_size: int = 1,
        prefetch_steps: int = 2,
        fingerprint: str | None = None,
    ) -> None:
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        tokens = _is_token_dataset(dataset)
        if tokens and collate_fn is not None:
            raise ValueError("collate_fn: a token dataset's batches are token tensors "
                             "(dataset.batch); drop collate_fn, or pass a map-style dataset")
        source: SampleSource = dataset if tokens else map_source(dataset, fingerprint)  # type: ignore[arg-type,assignment]
        self.items: MapDataset | None = None if tokens else dataset  # type: ignore[assignment]
        self.collate_fn = collate_fn or default_collate
        self.num_workers = num_workers
        self._pool: ThreadPoolExecutor | None = None
        super().__init__(source, global_batch=global_batch, microbatch_size=microbatch_size,
                         seed=seed, rank=rank, world_size=world_size,
                         prefetch_steps=prefetch_steps, shuffle=shuffle, drop_last=drop_last)

    def next_step(self) -> StepShare:  # type: ignore[override]
        """This rank's share of the step at the committed cursor (the same until advance())."""
        share: StepShare = self._fetch()
        return share

    def close(self) -> None:
        super().close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _materialize(self, plan: StepPlan, order: Order) -> StepShare:  # type: ignore[override]
        idle = not plan.mine
        start, stop = plan.span(range(0, 1) if idle else plan.mine)
        indices = np.asarray(order(np.arange(start, stop))).tolist()
        return StepShare(
            batch=self._read(indices),
            sample_indices=() if idle else tuple(indices),
            step_samples=plan.samples, microbatch_size=plan.microbatch_size,
            num_microbatches=plan.num_microbatches,
            weight=0.0 if idle else self.world_size * len(indices) / plan.samples,
            step=plan.step, epoch=plan.epoch)

    def _read(self, indices: Sequence[int]) -> Any:
        if self.items is None:
            return self.dataset.batch(indices)
        items = self.items
        if self.num_workers:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_workers,
                                                thread_name_prefix="baton-data-read")
            return self.collate_fn(list(self._pool.map(items.__getitem__, indices)))
        return self.collate_fn([items[i] for i in indices])
