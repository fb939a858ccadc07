"""Where dataset bytes live: local paths and `s3://` URIs behind one small fsspec layer.

Contract:
- `resolve(uri, storage_options)` returns `(filesystem, path)`; `uri` is a plain local path,
  `file://...` or `s3://bucket/prefix`. URIs stay `str` throughout (a `Path` would collapse the
  `//` of `s3://`).
- S3 settings come from the standard AWS environment (credentials, region, and the endpoint in
  `AWS_ENDPOINT_URL_S3`, else `AWS_ENDPOINT_URL`). botocore honours those variables itself, but
  we pass the endpoint explicitly *and* skip fsspec's instance cache: fsspec caches filesystem
  objects by constructor arguments, so an instance built while one endpoint was set would
  otherwise be handed back after the endpoint changed (tests start a fresh server per session).
  Explicit `storage_options` win over the environment.
- `write_atomic` makes a file appear whole or not at all: on local disk it writes a temporary
  sibling and renames it; on S3 a single PUT is already atomic.
- `merge_ranges` plans few requests for many byte ranges of one file: ranges whose gap is at
  most `hole_limit` bytes are merged into one span, read with `read_span`. Object stores
  charge a fixed latency per request (about 8 ms against the moto server on this machine,
  tens of ms on real S3) and stream hundreds of MB/s after it, so reading a small hole is
  cheaper than a second request.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import fsspec

from data_state.manifest import DatasetError

# Gaps up to this many bytes are read rather than skipped (see module docstring): about one
# request's latency times the bandwidth after it, for S3 and for the moto server alike.
DEFAULT_HOLE_LIMIT = 4 << 20
# One merged read never grows past this, so memory per read stays bounded.
MAX_SPAN_BYTES = 64 << 20

_ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")  # first set one wins


def resolve(
    uri: str, storage_options: Mapping[str, Any] | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem for `uri` and the path inside it (no trailing slash)."""
    if not uri:
        raise ValueError("dataset URI is empty: pass a local directory or s3://bucket/prefix")
    protocol, _, rest = uri.partition("://")
    if not rest:  # a plain local path
        protocol, rest = "file", uri
    options = dict(storage_options or {})
    if protocol in ("s3", "s3a"):
        endpoint = next((os.environ[k] for k in _ENDPOINT_ENV if os.environ.get(k)), None)
        if endpoint and "endpoint_url" not in options:
            options["endpoint_url"] = endpoint
        options.setdefault("skip_instance_cache", True)
        fs = fsspec.filesystem("s3", **options)
        return fs, rest.rstrip("/")
    if protocol in ("file", "local"):
        fs = fsspec.filesystem("file", **options)
        return fs, os.path.abspath(rest).rstrip("/") or "/"
    raise ValueError(
        f"unsupported dataset URI scheme {protocol!r} in {uri!r}: use a local path or s3://"
    )


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def join(path: str, *parts: str) -> str:
    return "/".join([path.rstrip("/"), *(p.strip("/") for p in parts)])


def write_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old state or all of `data`."""
    if is_local(fs):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    else:
        fs.pipe_file(path, data)


def read_span(fs: fsspec.AbstractFileSystem, path: str, start: int, end: int) -> bytes:
    """Bytes `[start, end)` of `path`; `DatasetError` naming the file if they are not there."""
    try:
        blob = fs.cat_file(path, start=start, end=end)
    except FileNotFoundError:
        raise DatasetError(
            f"{path} is missing (it was there when the dataset was opened): copy it back or "
            "prepare the dataset again"
        ) from None
    if len(blob) != end - start:
        raise DatasetError(
            f"short read from {path}: wanted bytes [{start}, {end}), got {len(blob)}; the "
            "file is truncated or was replaced: prepare the dataset again"
        )
    return blob


def merge_ranges(
    ranges: Sequence[tuple[int, int]], *, hole_limit: int
) -> list[tuple[int, int, list[int]]]:
    """Group ranges into spans `(start, end, indices of member ranges)`.

    Ranges are sorted by start; a range joins the current span when the gap to it is at most
    `hole_limit` and the span stays under `MAX_SPAN_BYTES`.
    """
    order = sorted(range(len(ranges)), key=lambda i: ranges[i])
    spans: list[tuple[int, int, list[int]]] = []
    for i in order:
        start, end = ranges[i]
        if start < 0 or end < start:
            raise ValueError(f"invalid byte range ({start}, {end})")
        if spans:
            s_start, s_end, members = spans[-1]
            if start - s_end <= hole_limit and max(end, s_end) - s_start <= MAX_SPAN_BYTES:
                spans[-1] = (s_start, max(end, s_end), [*members, i])
                continue
        spans.append((start, end, [i]))
    return spans
