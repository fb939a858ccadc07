"""data_state: token datasets in Parquet (local or s3://), the world-size-free data cursor,
the resumable loader and corpus preparation. Imports nothing from the rest of Baton but the
storage layer, `elastic.storage_io` (a leaf module; see `data_state/storage.py`).

Public API:
- `prepare_corpus(sources, out, *, seq_len, ...)` -> `DatasetManifest` (corpus.py)
- `TokenDataset(uri, split)`: random access to sequences (dataset.py)
- `Permutation(n, seed=, epoch=)`: the O(1)-memory sample order (order.py)
- `DataCursor`: the whole data state, `(dataset, seed, epoch, samples_consumed)` (cursor.py)
- `ResumableLoader(dataset, global_batch=, microbatch_size=, seed=, rank=, world_size=)`
  with `next_step()` / `advance()` / `state_dict()` / `load_state_dict()` / `reshard()`
"""

from data_state.corpus import prepare_corpus
from data_state.cursor import DataCursor, assign_microbatches
from data_state.dataset import TokenDataset
from data_state.loader import Microbatch, ResumableLoader
from data_state.manifest import DatasetError, DatasetManifest
from data_state.order import Permutation

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
