"""data_state: token datasets in Parquet (local or s3://), the world-size-free data cursor,
the resumable loader and corpus preparation. Imports nothing from the rest of Baton but the
storage layer, `elastic.storage.storage_io` (a leaf module; see `data_state/storage.py`).

Public API:
- `prepare_corpus(sources, out, *, seq_len, ...)` -> `DatasetManifest` (corpus.py)
- `TokenDataset(uri, split)`: random access to sequences (dataset.py)
- `Permutation(n, seed=, epoch=)`: the O(1)-memory sample order (order.py)
- `DataCursor`: the whole data state, `(dataset, seed, epoch, samples_consumed)` (cursor.py)
- `ResumableLoader(dataset, global_batch=, microbatch_size=, seed=, rank=, world_size=)`
  with `next_step()` / `advance()` / `state_dict()` / `load_state_dict()` / `reshard()`

The names above are loaded on first use (PEP 562 ``__getattr__``), never at ``import
data_state``: a `--workers N` process imports `data_state.parallel`, and that must not
pay for torch (seconds per process; only `dataset.py` and `loader.py` need it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from data_state.corpus import prepare_corpus
    from data_state.cursor import DataCursor, assign_microbatches
    from data_state.dataset import TokenDataset
    from data_state.loader import Microbatch, ResumableLoader
    from data_state.manifest import DatasetError, DatasetManifest
    from data_state.order import Permutation

_LAZY = {
    "DataCursor": "data_state.cursor",
    "DatasetError": "data_state.manifest",
    "DatasetManifest": "data_state.manifest",
    "Microbatch": "data_state.loader",
    "Permutation": "data_state.order",
    "ResumableLoader": "data_state.loader",
    "TokenDataset": "data_state.dataset",
    "assign_microbatches": "data_state.cursor",
    "prepare_corpus": "data_state.corpus",
}

__all__ = [
    "DataCursor",
    "DatasetError",
    "DatasetManifest",
    "Microbatch",
    "Permutation",
    "ResumableLoader",
    "TokenDataset",
    "assign_microbatches",
    "prepare_corpus",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'data_state' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
