"""World-size-free loading of an existing map-style `torch.utils.data.Dataset`.

Contract:
- `MapStyleLoader(dataset, global_batch=, microbatch_size=, seed=, collate_fn=, rank=,
  world_size=)` is `ResumableLoader` over any object with `__len__` and `__getitem__`: the
  same keyed order (`Permutation(len(dataset), seed, epoch)`), the same cursor (no rank, no
  world size in it), the same fixed microbatches shared out to ranks, the same
  `next_step()` / `advance()` / `state_dict()` / `load_state_dict()` / `reshard()`. So a run
  resized from 2 ranks to 3 still trains every sample of an epoch exactly once, and
  microbatch m of step s holds the same samples at any world size.
- `shuffle=False` and `drop_last=False` are `ResumableLoader`'s.
- Each microbatch is `collate_fn([dataset[i] for i in its sample indices])` (default:
  `torch.utils.data.default_collate`), returned as a `MapMicrobatch` whose `batch` is what the
  collate function made; `index`, `sample_indices`, `num_microbatches`, `step`, `epoch` are
  as in `data_state.loader.Microbatch`.
- The cursor names the dataset by `fingerprint` (default: the dataset's class name and
  length): a snapshot taken over another dataset is refused on restore. Pass a fingerprint
  of the content (a file digest, a version tag) when the same class and length may hold
  other data.
- Items are read and collated on the loader's prefetch thread: `__getitem__` and
  `collate_fn` must be safe to call from a thread other than the training loop's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import default_collate

from data_state.loader import Order, ResumableLoader, StepPlan


class MapDataset(Protocol):
    """A map-style dataset: `torch.utils.data.Dataset` with a length."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


@dataclass(frozen=True)
class MapMicrobatch:
    batch: Any  # collate_fn of the microbatch's items
    index: int  # m in [0, num_microbatches): its place in the step
    sample_indices: tuple[int, ...]  # dataset indices, in order
    num_microbatches: int
    step: int
    epoch: int


class _MapSource:
    """A map-style dataset as the loader's `SampleSource` (only its length is used)."""

    def __init__(self, dataset: MapDataset, fingerprint: str) -> None:
        self.dataset = dataset
        self.fingerprint = fingerprint
        self.seq_len = 0

    def __len__(self) -> int:
        return len(self.dataset)

    def batch(self, indices: Sequence[int] | np.ndarray) -> torch.Tensor:
        raise NotImplementedError("MapStyleLoader collates items itself")

    def __repr__(self) -> str:
        return f"{type(self.dataset).__name__} of {len(self.dataset)} items"


def map_source(dataset: MapDataset, fingerprint: str | None = None) -> _MapSource:
    """`dataset` as a loader's source, named by `fingerprint` (default: class and length)."""
    return _MapSource(dataset, fingerprint or f"map:{type(dataset).__qualname__}:{len(dataset)}")


class MapStyleLoader(ResumableLoader):
    """See the module docstring."""

    def __init__(
        self,
        dataset: MapDataset,
        *,
        global_batch: int,
        microbatch_size: int,
        seed: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        rank: int = 0,
        world_size: int = 1,
        prefetch_steps: int = 2,
        fingerprint: str | None = None,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        self.collate_fn = collate_fn or default_collate
        super().__init__(map_source(dataset, fingerprint), global_batch=global_batch,
                         microbatch_size=microbatch_size, seed=seed, rank=rank,
                         world_size=world_size, prefetch_steps=prefetch_steps,
                         shuffle=shuffle, drop_last=drop_last)
        self.items = dataset

    def next_step(self) -> list[MapMicrobatch]:  # type: ignore[override]
        """This worker's microbatches of the step at the committed cursor."""
        return super().next_step()  # type: ignore[return-value]

    def _materialize(self, plan: StepPlan, order: Order) -> list[MapMicrobatch]:  # type: ignore[override]
        out = []
        for m in plan.mine:
            picked = np.asarray(order(np.arange(*plan.span(range(m, m + 1))))).tolist()
            out.append(MapMicrobatch(
                batch=self.collate_fn([self.items[i] for i in picked]), index=m,
                sample_indices=tuple(picked), num_microbatches=plan.num_microbatches,
                step=plan.step, epoch=plan.epoch))
        return out
