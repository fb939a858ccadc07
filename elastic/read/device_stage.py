"""Restoring into tensors the reader cannot write directly (a GPU's): through bounded host
staging buffers, each block verified before it is copied to the device.

``read_to(placed, source, manifest)`` is what a restore calls to fill its placed ops: ops whose
destination is in host memory go to ``elastic.read.read_batches.read_placed`` (read straight
into the tensors, then verified); every other op goes, device by device, to ``read_staged``
with that device's ``Copier``.

``read_staged(placed, source, manifest, copier)`` reads the ops in file order, in batches of at
most ``buffer_bytes`` (a large contiguous op is cut: ``split_direct``), each into one of at most
``buffers`` host buffers (``Stager``: page-locked when the copier asks, as CUDA's asynchronous
copies need), verifies every checksum block of the batch there and only then hands each op's
bytes to ``copier.copy``; on CUDA a side stream copies batch k while the next are read. A
buffer is read into again only once the copies out of it have finished (its fence). With a
local store and no RAM tier (``ByteSource.parallel_reads``) the verifying pool's threads read
and verify batches at once, copied to the device in file order as they are ready.

* Bytes of a batch that fails verification never reach the device; those of earlier batches
  did (``elastic.read.restore`` states what a failed restore leaves and what follows).
* It returns, or raises, only once every copy it issued has finished and no thread writes into
  its buffers: a fallback restore never races with a copy of this one.
* Host memory beyond the state: ``buffers`` x ``buffer_bytes`` (4-6 x 32 MiB), plus one buffer
  of a chunk's size while an op must read a whole chunk larger than a buffer (a resharded
  target that needs a non-contiguous part of it).

``HostCopier`` copies synchronously from pageable memory (devices other than CUDA, and the
staging tests on a CPU); ``CudaCopier`` issues ``copy_(non_blocking=True)`` on its own stream
from pinned buffers and fences with CUDA events.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Protocol

import torch

from elastic.format import Manifest
from elastic.read.byte_source import ByteSource
from elastic.read.read_batches import (
    VERIFY_THREADS,
    Placed,
    batches_of,
    memory,
    read_placed,
    staged_part,
    verify,
    verify_pool,
)

# Each staging buffer holds this many bytes (a batch); a CUDA copy of 32 MiB from pinned
# memory takes ~1.5 ms, a read of it from the page cache ~6 ms, so copies keep up.
STAGE_BUFFER_BYTES = 32 << 20
# Buffers: one per reading thread, one whose bytes are being copied, one spare.
STAGE_BUFFERS = VERIFY_THREADS + 2


class Fence(Protocol):
    def query(self) -> bool: ...  # the copies it stands for have finished

    def synchronize(self) -> None: ...  # wait until they have


class Copier(Protocol):
    """Copies host bytes to a device's tensors (see the module contract)."""

    pinned: bool  # whether staging buffers must be page-locked

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def fence(self) -> Fence: ...  # stands for every copy issued so far

    def finish(self) -> None: ...  # every copy issued has finished


class _Done:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class HostCopier:
    """Synchronous copies (``dst.copy_(src)``) from pageable buffers."""

    pinned = False

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def fence(self) -> Fence:
        return _Done()

    def finish(self) -> None:
        return None


class CudaCopier:
    """Asynchronous copies on a side stream of ``device``, from pinned buffers. The stream
    first waits for the device's current stream (a destination allocated just before may
    still be in use there by freed work); ``finish`` waits for the side stream."""

    pinned = True

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.stream.wait_stream(torch.cuda.current_stream(device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def fence(self) -> Fence:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def finish(self) -> None:
        self.stream.synchronize()


def copier_for(device: torch.device) -> Copier:
    return CudaCopier(device) if device.type == "cuda" else HostCopier()


class Stager:
    """At most ``count`` host buffers of ``buffer_bytes``, made as needed: ``take`` reuses a
    buffer whose copies have finished, makes a new one while fewer than ``count`` exist, and
    otherwise waits for the oldest one's copies; a batch larger than a buffer (one whole
    chunk) gets a buffer of its own, dropped once its copies are done. ``made`` counts the
    buffers ever made and ``peak_bytes`` the most bytes of buffers held at once."""

    def __init__(self, count: int, buffer_bytes: int, pinned: bool) -> None:
        self.count, self.buffer_bytes, self.pinned = count, buffer_bytes, pinned
        self.free: deque[tuple[torch.Tensor, Fence]] = deque()
        self.pooled = 0  # buffers of buffer_bytes made (at most count)
        self.made = 0
        self.held_bytes = 0
        self.peak_bytes = 0

    def _new(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        self.made += 1
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return buf

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes``; its previous copies have finished."""
        if nbytes > self.buffer_bytes:
            return self._new(nbytes)
        if self.free and self.free[0][1].query():
            return self.free.popleft()[0]
        if self.pooled < self.count:
            self.pooled += 1
            return self._new(self.buffer_bytes)
        buf, fence = self.free.popleft()  # callers hold fewer than count at once
        fence.synchronize()
        return buf

    def give(self, buf: torch.Tensor, fence: Fence) -> None:
        """``buf`` is free once ``fence`` has passed."""
        if buf.numel() <= self.buffer_bytes:
            self.free.append((buf, fence))
            return
        fence.synchronize()
        self.held_bytes -= buf.numel()


def read_to(placed: list[Placed], source: ByteSource, manifest: Manifest) -> None:
    """Host destinations straight from the source, the others through ``read_staged``."""
    host = [p for p in placed if p.dst.device.type == "cpu"]
    by_device: dict[torch.device, list[Placed]] = {}
    for p in placed:
        if p.dst.device.type != "cpu":
            by_device.setdefault(p.dst.device, []).append(p)
    if host:
        read_placed(host, source, manifest)
    for device, ops in by_device.items():
        read_staged(ops, source, manifest, copier_for(device))


def read_staged(placed: list[Placed], source: ByteSource, manifest: Manifest,
                copier: Copier, *, buffers: int = STAGE_BUFFERS,
                buffer_bytes: int = STAGE_BUFFER_BYTES) -> Stager:
    """Read, verify and copy every op through the staging buffers (module contract);
    returns the ``Stager`` (its counts)."""
    ordered = sorted(placed, key=lambda p: (p.op.chunk.file, p.op.start))
    stager = Stager(max(2, buffers), buffer_bytes, copier.pinned)
    # Reading threads at once: the buffers less one being copied out and one spare.
    ahead = max(1, min(VERIFY_THREADS, stager.count - 2)) if source.parallel_reads else 0
    pool = verify_pool()
    pending: deque[tuple[Future[list[torch.Tensor]], list[Placed], torch.Tensor]] = deque()
    try:
        for batch in batches_of(ordered, buffer_bytes, manifest.block_bytes):
            buf = stager.take(sum(p.op.end - p.op.start for p in batch))
            if ahead:
                future = pool.submit(_fill, batch, buf, source, manifest)
            else:
                future = Future()
                future.set_result(_fill(batch, buf, source, manifest))
            pending.append((future, batch, buf))
            while len(pending) > ahead:
                _copy_out(*pending.popleft(), copier, stager)
        while pending:
            _copy_out(*pending.popleft(), copier, stager)
    finally:
        for future, _, _ in pending:  # a batch failed: let the others' reads end first
            future.exception()
        copier.finish()
    return stager


def _fill(batch: list[Placed], buf: torch.Tensor, source: ByteSource,
          manifest: Manifest) -> list[torch.Tensor]:
    """Read a batch's ops into ``buf``, one after the other, and verify them; each op's
    bytes ``[start, end)`` as a uint8 view of ``buf``."""
    views, reads, pos = [], [], 0
    for p in batch:
        view = buf[pos: pos + p.op.end - p.op.start]
        pos += p.op.end - p.op.start
        views.append(view)
        reads.append((p.op.chunk.file, p.op.start, [memory(view)]))
    source.count_staged(pos)
    source.read_into(reads)
    for p, view in zip(batch, views, strict=True):
        verify(p.op, [memory(view)], manifest.block_bytes, manifest.step)
    return views


def _copy_out(future: Future[list[torch.Tensor]], batch: list[Placed], buf: torch.Tensor,
              copier: Copier, stager: Stager) -> None:
    """Copy a verified batch's bytes to their destinations (``future.result()`` raises, and
    nothing of the batch is copied, if its read or verification failed)."""
    views = future.result()
    for p, view in zip(batch, views, strict=True):
        if p.direct:  # contiguous, in file order: the needed bytes as they are
            src = view[p.op.need0 - p.op.start: p.op.need1 - p.op.start]
            copier.copy(p.dst.reshape(-1).view(torch.uint8), src)
        else:
            copier.copy(p.dst, staged_part(p, view))
    stager.give(buf, copier.fence())
