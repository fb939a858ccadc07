"""Baton's one storage layer: local paths and ``s3://`` behind one interface, never lying,
never hanging. The leaf of the project: every byte Baton stores or loads (snapshots, the
lease, datasets, metrics, probes) goes through a ``Storage``.

The room's modules
------------------
* ``storage_io``: ``Storage``, the interface every caller uses; it picks the backend by URI,
  counts what is read and written, and merges ranges (its docstring is the layer's contract).
* ``local_files``: local paths (plain calls, atomic fsync'ed writes, ``preadv``).
* ``s3_files``: S3 objects (deadlines, retries, conditional writes); ``s3_multipart``: large
  objects in parallel parts, whole or not at all.
* ``byte_ranges``: how near ranges merge, and what a short read means.
* ``retry``: one storage call under a deadline, and which failures a retry may fix.
* ``spares``: retired shard files reused by the next write (local stores).
* ``plain_files``: the one rule for local entries of a run or dataset directory (never
  through a link, only regular files read).
* ``outputs``: where a command's local output (``--out``) may go, and how it is written
  (never into a run or dataset directory, never through a link, never over a device).
* ``json_bounds``: the one bounded JSON reader.
* ``errors``: what a failure means: ``SnapshotIntegrityError`` and ``TruncatedError``
  (definite), ``StorageUnavailableError`` (doubt), ``ShortReadError`` (transient).

Import rule (kept true by ``tests/project/test_imports.py`` and
``tests/storage/test_storage_io.py``): these modules import the standard library, fsspec/s3fs
and each other, nothing else of Baton. No other Baton module imports fsspec or s3fs.
``elastic/__init__`` loads its names lazily, so ``import elastic.storage`` pulls in neither
torch nor Ray: ``data_state`` uses this room and no other part of ``elastic``.

Callers outside the room import the names below from here, whichever module defines them.
"""

from __future__ import annotations

from elastic.storage.byte_ranges import (
    MAX_SPAN_BYTES,
    MERGE_HOLE_BYTES,
    READ_INTO_MAX_WASTE,
    merge_ranges,
)
from elastic.storage.errors import SnapshotIntegrityError, StorageUnavailableError, TruncatedError
from elastic.storage.json_bounds import (
    INT64,
    MAX_JSON_BYTES,
    JSONBoundsError,
    finite_number,
    is_int64,
)
from elastic.storage.json_bounds import (
    loads as loads_json,
)
from elastic.storage.local_files import fsync_dir
from elastic.storage.outputs import (
    DATASET_MARKER,
    RUN_MARKERS,
    dataset_output_problem,
    directory_output_problem,
    file_output_problem,
    merged_directory,
    new_directory,
    output_location,
    replaced_file,
)
from elastic.storage.plain_files import RefusedEntryError, check_below, open_append, output_problem
from elastic.storage.retry import storage_errors
from elastic.storage.spares import SPARE_DIR, retire
from elastic.storage.storage_io import Storage, absolute_uri

__all__ = ["DATASET_MARKER", "INT64", "JSONBoundsError", "MAX_JSON_BYTES", "MAX_SPAN_BYTES",
           "MERGE_HOLE_BYTES", "READ_INTO_MAX_WASTE", "RUN_MARKERS", "RefusedEntryError",
           "SPARE_DIR", "SnapshotIntegrityError", "Storage", "StorageUnavailableError",
           "TruncatedError", "absolute_uri", "check_below", "dataset_output_problem",
           "directory_output_problem", "file_output_problem", "finite_number", "fsync_dir",
           "is_int64", "loads_json", "merge_ranges", "merged_directory", "new_directory",
           "open_append", "output_location", "output_problem", "replaced_file", "retire",
           "storage_errors"]
