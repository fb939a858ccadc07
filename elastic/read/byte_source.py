"""Where a restore's bytes come from: ``ByteSource``, one snapshot's reads from the RAM tier
or the store, and ``copy_bytes``, the one copy of read bytes into a buffer.

Contract
--------
* ``ByteSource(store, step, ram=None)`` serves the reads of one snapshot: the RAM tier
  (``ram``: peers' stores, file by file; what they do not hold or lost comes from storage)
  or the store. One per restore (or verify): it caches the files' headers (it is the
  ``HeaderSource`` of ``elastic.format.chunk_checks.check_headers``) and the checks of each
  file. On a local store it refuses a shard file that is a symbolic link, not a regular file
  or whose real path is not in the snapshot's directory (``ManifestError``); a missing file
  or a RAM copy shorter than asked is ``SnapshotIntegrityError``.
* ``read_into(reads)`` fills each read's buffers with consecutive bytes of its file (exact);
  several threads may call it at once when ``parallel_reads`` (a local store, no RAM tier).
* ``copy_bytes(dst, src)``: ``dst[:] = src``, large copies through torch.

Why a module of its own: the batched reader (``read_batches``), the staging path
(``device_stage``), the group read and restore itself all read through a ``ByteSource``;
here none of them has to import another to name it.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from elastic.format import SafetensorsHeader, check_shard_file, snapshot_label
from elastic.storage import SnapshotIntegrityError
from elastic.store import SnapshotStore

# Copies of at least this many bytes go through torch (``copy_bytes``).
TORCH_COPY_MIN_BYTES = 1 << 20


# (file, start, end) requests -> bytes (any buffer) per request, None for a request the
# source does not hold (read from storage), or None when it serves none of them.
ReadMany = Callable[[list[tuple[str, int, int]]], list[Any] | None]


@dataclass
class ByteSource:
    """Reads of one snapshot: from the RAM tier when ``ram`` serves them (file by file:
    whatever it does not hold comes from ``store``), else from ``store``.
    One per restore (or verify): it caches the files' headers and the symlink checks.
    ``bytes_into`` counts the bytes ``read_into`` delivered, ``staged_bytes`` those of them
    that went to a staging buffer first (resharding reads whole chunks into one).
    ``read_into`` may be called from several threads at once when ``parallel_reads``
    (a local store and no RAM tier: each call opens its own file handles)."""

    store: SnapshotStore
    step: int
    ram: ReadMany | None = None
    used_ram: bool = False
    used_storage: bool = False
    headers: dict[str, SafetensorsHeader] = field(default_factory=dict)
    bytes_into: int = 0
    staged_bytes: int = 0
    _safe_files: set[str] = field(default_factory=set)
    _counts: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def parallel_reads(self) -> bool:
        """Whether ``read_into`` may run on several threads at once (see the class)."""
        return self.ram is None and self.store.is_local

    def count_staged(self, nbytes: int) -> None:
        with self._counts:
            self.staged_bytes += nbytes

    def read_many(self, requests: list[tuple[str, int, int]]) -> list[bytes]:
        """Small reads (file headers) as ``bytes``."""
        bufs = [bytearray(end - start) for _, start, end in requests]
        self.read_into([(file, start, [memoryview(b)])
                        for (file, start, _), b in zip(requests, bufs, strict=True)])
        return [bytes(b) for b in bufs]

    def read_into(self, reads: list[tuple[str, int, list[memoryview]]]) -> None:
        """Fill each read's buffers with consecutive bytes of its file from its offset on
        (exact: a short file is ``SnapshotIntegrityError``). The RAM tier serves what it
        holds; storage reads the rest, each file's ranges straight into the buffers."""
        if not reads:
            return
        with self._counts:
            self.bytes_into += sum(len(b) for _, _, bufs in reads for b in bufs)
        if self.ram is not None:
            got = self.ram([(f, start, start + sum(len(b) for b in bufs))
                            for f, start, bufs in reads])
            rest = []
            for (file, start, bufs), data in zip(reads, got or [None] * len(reads),
                                                 strict=True):
                if data is None:  # not held (or its store is gone): storage
                    rest.append((file, start, bufs))
                    continue
                self.used_ram = True
                view = memoryview(data).cast("B")
                if len(view) != sum(len(b) for b in bufs):
                    raise SnapshotIntegrityError(
                        f"{snapshot_label(self.step)}: the RAM copy of {file} ends before byte "
                        f"{start + sum(len(b) for b in bufs)}; truncated")
                pos = 0
                for buf in bufs:
                    copy_bytes(buf, view[pos: pos + len(buf)])
                    pos += len(buf)
            reads = rest
            if not reads:
                return
        self.used_storage = True
        by_file: dict[str, list[tuple[int, list[memoryview]]]] = {}
        for file, start, bufs in reads:
            by_file.setdefault(file, []).append((start, bufs))
        for file, members in sorted(by_file.items()):
            path = self.store.step_path(self.step, file)
            self._refuse_links(file, path)
            try:
                self.store.read_into(path, members)
            except FileNotFoundError as err:
                raise SnapshotIntegrityError(f"{snapshot_label(self.step)}: shard file {file} is "
                                             "missing") from err

    def _refuse_links(self, file: str, path: str) -> None:
        """A local shard must be a regular file inside the snapshot's own directory
        (``elastic.format.chunk_checks.check_shard_file``); checked once per file."""
        if not self.store.is_local or file in self._safe_files:
            return
        check_shard_file(self.store, self.step, file)
        if os.path.isfile(path):
            self._safe_files.add(file)


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` (same length); large copies through torch, which uses the process's
    threads (a 32 MiB copy: 21 GB/s on this 2-core machine against the memoryview's 14)."""
    if len(dst) < TORCH_COPY_MIN_BYTES:
        dst[:] = src
        return
    with warnings.catch_warnings():  # a source from the RAM tier may be read-only
        warnings.simplefilter("ignore", UserWarning)
        source = torch.frombuffer(src, dtype=torch.uint8)
    torch.frombuffer(dst, dtype=torch.uint8).copy_(source)
