"""Byte ranges of one stored object: how near ranges merge into one read, and what a short
read means. Part of the storage layer (``elastic.storage.storage_io``); a leaf like it.

Contract
--------
* ``merge_ranges(ranges, hole_limit=, max_waste=)`` groups ranges into spans read with one
  request each: a range joins the span before it when the gap is at most ``hole_limit``, the
  span stays within ``MAX_SPAN_BYTES`` and, with ``max_waste``, its holes stay at most that
  fraction of the bytes its members want. ``MERGE_HOLE_BYTES`` is the hole an object store
  reads rather than pay a second request for (local disks use 0: only adjacent or
  overlapping ranges merge); ``READ_INTO_MAX_WASTE`` bounds what a restore's reads waste.
* Exact reads: a read that returned fewer bytes than asked is ``short_read``'s verdict: the
  object ends before the range (``TruncatedError``, a ``SnapshotIntegrityError``: definite,
  never retried) or the answer was cut short (``ShortReadError``: transient); both are
  defined in ``elastic.storage.errors``.

Imports: the standard library and ``elastic.storage.errors`` only.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import NoReturn

from elastic.storage.errors import ShortReadError, TruncatedError

# Ranges of one object closer than this are read as one span on S3. An object store charges a
# fixed latency per request (about 8 ms against the moto server on this machine, tens of ms on
# real S3) and streams hundreds of MB/s after it, so reading a hole of a few MB is cheaper than
# a second request. Local random reads cost no request latency: there the hole is 0 (only
# adjacent or overlapping ranges merge), so nothing is read that was not asked for.
MERGE_HOLE_BYTES = 4 << 20
# ``read_into`` (a snapshot restore's reads) merges ranges only while a span's holes stay at
# most this fraction of the bytes it wants: a resharded restore asks for every other piece of
# a file (the halves of chunks another rank needs lie between), and reading those holes would
# double its bytes.
READ_INTO_MAX_WASTE = 1 / 16
# One merged span never grows past this (a single range larger than it is read as is), so the
# memory a merged read holds stays bounded.
MAX_SPAN_BYTES = 64 << 20


def merge_ranges(ranges: Sequence[tuple[int, int]], *, hole_limit: int,
                 max_waste: float | None = None) -> list[tuple[int, int, list[int]]]:
    """Group byte ranges of one object into spans ``(start, end, indices of member ranges)``.

    Ranges are taken by start; a range joins the current span when the gap to it is at most
    ``hole_limit`` and the span stays within ``MAX_SPAN_BYTES`` and, with ``max_waste``, when
    the span's holes stay at most ``max_waste`` times the bytes its members want (so what is
    read is at most ``1 + max_waste`` times what is asked for, however small the ranges)."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i])
    spans: list[tuple[int, int, list[int]]] = []
    holes = wanted = 0  # of the current span
    for i in order:
        start, end = ranges[i]
        if start < 0 or end < start:
            raise ValueError(f"invalid byte range ({start}, {end})")
        if spans:
            s_start, s_end, members = spans[-1]
            hole, more = max(0, start - s_end), max(0, end - max(start, s_end))
            if start - s_end <= hole_limit and max(end, s_end) - s_start <= MAX_SPAN_BYTES \
                    and (max_waste is None or holes + hole <= max_waste * (wanted + more)):
                members.append(i)
                spans[-1] = (s_start, max(end, s_end), members)
                holes, wanted = holes + hole, wanted + more
                continue
        spans.append((start, end, [i]))
        holes, wanted = 0, end - start
    return spans


def short_read(path: str, start: int, end: int, got: int, size: int) -> NoReturn:
    """A read of ``[start, end)`` returned ``got`` bytes of an object of ``size`` bytes: the
    object is truncated (definite) or the answer was cut short (transient, retried)."""
    if size < end:
        raise TruncatedError(
            f"{path}: wanted bytes [{start}, {end}) but the file ends at {size}; truncated")
    raise ShortReadError(errno.EIO, f"got {got} of {end - start} bytes; response cut short",
                         path)
