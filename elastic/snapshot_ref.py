"""A snapshot named by its directory: `RUN/snapshots/000001200` is run `RUN`, step 1200.

Why: a `ray.train.Checkpoint` of a Baton run (what `ElasticTorchTrainer.fit()` returns as
`Result.checkpoint`) is a directory, the newest committed snapshot's. Everything that takes
a run and a step (`baton snapshots ...`, `baton fit --from`, a `Session`'s `run_uri`) accepts
that directory too.

Contract: `split_snapshot_dir(uri)` -> `(run_uri, step)` when `uri` (a local path, `file://`
or `s3://` URI, trailing slashes ignored) ends with `snapshots/<digits>`, else None: pure
string work, no I/O. `checkpoint_uri(obj)` is the location a `ray.train.Checkpoint`-like
object (with `path` and a pyarrow `filesystem`) names, as a URI Baton's storage reads
(`s3://` for an S3 filesystem, the path otherwise); a string is returned as it is.
"""

from __future__ import annotations

import re
from typing import Any

_SNAPSHOT_DIR = re.compile(r"^(?P<run>.+?)/+snapshots/+(?P<step>[0-9]+)/*$")


def split_snapshot_dir(uri: str) -> tuple[str, int] | None:
    found = _SNAPSHOT_DIR.match(uri)
    if found is None:
        return None
    return found["run"], int(found["step"])


def checkpoint_uri(obj: Any) -> str:
    if isinstance(obj, str):
        return obj
    path, filesystem = getattr(obj, "path", None), getattr(obj, "filesystem", None)
    if not isinstance(path, str):
        raise ValueError(f"expected a run directory, a snapshot directory or a "
                         f"ray.train.Checkpoint, got {type(obj).__name__}")
    if getattr(filesystem, "type_name", "local") == "s3":
        return "s3://" + path.lstrip("/")
    return path
