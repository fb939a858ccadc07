"""elastic.portable: Baton snapshots for any framework — numpy, json and safetensors, no torch.

    from elastic.portable import PortableRun, write_snapshot
    run = PortableRun("runs/tiny")              # or s3://bucket/prefix/tiny
    snap = run.read()                           # newest committed snapshot, every byte verified
    snap.tensors["model.lm_head.weight"]        # numpy, logical (unsharded) shape
    snap.component("data")                      # the data cursor (JSON)
    write_snapshot("runs/tiny", 20, tensors, state)   # commit under the run's lease

Modules:

- ``reader``: ``PortableRun`` (list, read, run.json) and ``Snapshot``;
- ``writer``: ``write_snapshot`` (lease, generation, create-only shard, manifest last);
- ``arrays``: safetensors dtype names <-> numpy, ``decode_state``.

Every check is the PyTorch path's own: the manifest is validated by
``elastic.format.manifest_check``, the files by ``elastic.format.chunk_checks``, a manifest to
commit by ``elastic.coord.receipts``. Importing this package loads no torch
(``tests/elastic/test_portable.py`` checks it in a fresh interpreter).
"""

from __future__ import annotations

from elastic.portable.arrays import decode_state, dtype_name, numpy_dtype
from elastic.portable.reader import PortableRun, Snapshot
from elastic.portable.writer import portable_versions, write_snapshot

__all__ = ["PortableRun", "Snapshot", "decode_state", "dtype_name", "numpy_dtype",
           "portable_versions", "write_snapshot"]
