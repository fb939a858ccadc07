"""The data position outside PyTorch: a dataset that serves numpy arrays, and its loader.

Contract:
- `NumpySamples(dataset)` is a `TokenDataset` (or any source with `read`, `fingerprint`,
  `seq_len`, `len`) whose `batch(indices)` is a `(len(indices), seq_len)` int64 numpy array
  instead of a torch tensor: the same sequences, in the same order.
- `numpy_loader(dataset, cursor, *, global_batch, microbatch_size, rank=0, world_size=1)` is
  the `ResumableLoader` of a run over those arrays, restored to `cursor` (a snapshot's `data`
  state, JSON): its `next_step()` gives microbatch m of the step at the cursor exactly the
  samples a PyTorch worker of the same run gets (positions `[c + m*b, c + (m+1)*b)` of
  `Permutation(len(dataset), seed, epoch)`), so a JAX loop continues the sample order where
  the PyTorch run stopped (P5 across frameworks). `advance()` after each optimizer update and
  `state_dict()` is the cursor to write back.
- Nothing here, in `dataset.py`, `loader.py`, `order.py` or `cursor.py` imports torch (a
  test checks `sys.modules` in a fresh interpreter); only `TokenDataset.batch` does, on call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, cast

import numpy as np

from data_state.loader import ResumableLoader, SampleSource


class _Readable(Protocol):
    fingerprint: str
    seq_len: int

    def __len__(self) -> int: ...

    def read(self, indices: Sequence[int] | np.ndarray) -> np.ndarray: ...


class NumpySamples:
    """``dataset`` serving int64 numpy arrays (module contract)."""

    def __init__(self, dataset: _Readable) -> None:
        self.dataset = dataset
        self.fingerprint = dataset.fingerprint
        self.seq_len = dataset.seq_len

    def __len__(self) -> int:
        return len(self.dataset)

    def __repr__(self) -> str:
        return f"NumpySamples({self.dataset!r})"

    def batch(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        return np.asarray(self.dataset.read(indices)).astype(np.int64)


def numpy_loader(dataset: _Readable, cursor: dict[str, Any], *, global_batch: int,
                 microbatch_size: int, rank: int = 0, world_size: int = 1) -> ResumableLoader:
    """The run's loader over numpy arrays, at ``cursor`` (module contract)."""
    seed = cursor.get("seed") if isinstance(cursor, dict) else None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"data cursor field 'seed' must be an integer, got {seed!r}")
    # NumpySamples is a SampleSource whose batch() gives numpy, not torch: the loader only
    # slices what batch() returns.
    loader = ResumableLoader(cast(SampleSource, NumpySamples(dataset)), global_batch=global_batch,
                             microbatch_size=microbatch_size, seed=seed, rank=rank,
                             world_size=world_size)
    loader.load_state_dict(cursor)
    return loader
