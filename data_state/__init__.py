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

What `trainer` uses besides: the cursor's arithmetic (`share`, `CursorRangeError`,
`LAST_EPOCH`), a Session's `ShareLoader`, `numpy_loader` (JAX), a dataset's manifest and
tokenizer (`read_manifest`, `load_stored_tokenizer`) and its location (`resolve_uri`,
`join_uri`, `write_atomic`); for a Ray Data pipeline, `StreamShareLoader` over a feeder
(`create_feeder` and `FeederClient`: one actor for every rank; `local_feeder`: in this
process) and `pipeline_units` (the pipeline checked and cut into units).

The names of this face are loaded on first use (PEP 562 ``__getattr__``), never at ``import
data_state``: a `--workers N` process imports `data_state.parallel`, and that must not
pay for torch (seconds per process; only `dataset.py` and `loader.py` need it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from data_state.corpus import prepare_corpus
    from data_state.cursor import (
        LAST_EPOCH,
        CursorRangeError,
        DataCursor,
        assign_microbatches,
        share,
    )
    from data_state.dataset import TokenDataset, load_stored_tokenizer, read_manifest
    from data_state.loader import Microbatch, ResumableLoader
    from data_state.manifest import DatasetError, DatasetManifest
    from data_state.numpy_source import numpy_loader
    from data_state.order import Permutation
    from data_state.ray_feeder import FeederClient, create_feeder, local_feeder
    from data_state.ray_units import pipeline_units
    from data_state.share_loader import ShareLoader, StepShare
    from data_state.storage import join as join_uri
    from data_state.storage import resolve as resolve_uri
    from data_state.storage import write_atomic
    from data_state.stream_feeder import UnitReadError
    from data_state.stream_loader import StreamShareLoader

# Public name -> the module that defines it ("module:name" where the face renames it).
_LAZY = {
    "CursorRangeError": "data_state.cursor",
    "FeederClient": "data_state.ray_feeder",
    "StreamShareLoader": "data_state.stream_loader",
    "UnitReadError": "data_state.stream_feeder",
    "create_feeder": "data_state.ray_feeder",
    "local_feeder": "data_state.ray_feeder",
    "pipeline_units": "data_state.ray_units",
    "DataCursor": "data_state.cursor",
    "DatasetError": "data_state.manifest",
    "DatasetManifest": "data_state.manifest",
    "LAST_EPOCH": "data_state.cursor",
    "Microbatch": "data_state.loader",
    "Permutation": "data_state.order",
    "ResumableLoader": "data_state.loader",
    "ShareLoader": "data_state.share_loader",
    "StepShare": "data_state.share_loader",
    "TokenDataset": "data_state.dataset",
    "assign_microbatches": "data_state.cursor",
    "join_uri": "data_state.storage:join",
    "load_stored_tokenizer": "data_state.dataset",
    "numpy_loader": "data_state.numpy_source",
    "prepare_corpus": "data_state.corpus",
    "read_manifest": "data_state.dataset",
    "resolve_uri": "data_state.storage:resolve",
    "share": "data_state.cursor",
    "write_atomic": "data_state.storage",
}

__all__ = [
    "LAST_EPOCH",
    "CursorRangeError",
    "DataCursor",
    "DatasetError",
    "DatasetManifest",
    "FeederClient",
    "Microbatch",
    "Permutation",
    "ResumableLoader",
    "ShareLoader",
    "StepShare",
    "StreamShareLoader",
    "TokenDataset",
    "UnitReadError",
    "assign_microbatches",
    "create_feeder",
    "join_uri",
    "load_stored_tokenizer",
    "local_feeder",
    "numpy_loader",
    "pipeline_units",
    "prepare_corpus",
    "read_manifest",
    "resolve_uri",
    "share",
    "write_atomic",
]


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'data_state' has no attribute {name!r}")
    module, _, attr = target.partition(":")
    # Looked up each time, not cached here: the name stays its module's (a patch is seen).
    return getattr(importlib.import_module(module), attr or name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
