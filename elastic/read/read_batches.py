"""Reading planned byte ranges of a snapshot into tensors, in bounded batches, verified.

Contract
--------
A ``ReadOp`` is one byte range ``[start, end)`` of one chunk, widened to whole checksum
blocks, of which the target uses ``[need0, need1)``. A ``Placed`` op says where its bytes
go: ``direct`` ops land straight in ``dst`` (a contiguous slice of the tensor that will be
loaded, whose bytes are ``[need0, need1)`` in file order; the partial checksum blocks at the
edges go to a staging buffer), the others are read whole into a staging buffer and copied
(``copy_staged``: a resharded target needs a non-contiguous part of the chunk).

``read_placed(placed, source, manifest)`` reads every op in batches of about
``BATCH_BYTES`` (local disk: ``preadv`` into the tensors' memory) and verifies the crc32 of
every block it read against the manifest (a mismatch is ``SnapshotIntegrityError`` naming
file, chunk and block), then that every floating element it read is finite (a NaN or an Inf
is ``NonFiniteError``, a ``SnapshotIntegrityError``, naming the tensor), on
``VERIFY_THREADS`` pool threads: from a local store each pool
thread reads and verifies whole batches (``ByteSource.parallel_reads``), a few MiB at a
time so that the crc32 finds the bytes still in the CPU's cache; from the RAM tier
or S3 this thread reads the batches in order and the pool verifies them meanwhile. A large
direct op is cut into batch-sized pieces (``split_direct``), so one tensor's blocks are read
and verified in parallel. It returns only once nothing writes into the tensors any
more. It reads each op once: callers that must not read a byte twice
(``elastic.read.group_read``) plan ops that do not overlap. Values are copied bitwise; nothing
is ever unpickled.
"""

from __future__ import annotations

import operator
import os
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace

import torch

from elastic.format import ChunkRecord, Manifest, finite_check, verify_blocks
from elastic.read.byte_source import ByteSource
from elastic.state import Target

# Reads are issued in batches of about this many bytes: it bounds each staging buffer (partial
# checksum blocks, whole chunks a resharded target needs a part of) and what one call to the
# RAM copy returns, so a restore holds the state plus at most (VERIFY_THREADS + 1) x this
# much; and it is the unit of work of the verifying threads.
BATCH_BYTES = 32 << 20
# Threads that verify crc32s (about 20 GB/s each with zlib-ng, 4 GB/s with the stdlib's zlib
# 1.2.13 where zlib-ng is missing, which is then slower than reading a page-cached file): as
# many as the process may use, at most 4 (a node's other workers restore at the same time).
VERIFY_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                            else os.cpu_count() or 1))
# A thread that reads and verifies a batch (a local store) does so this many bytes at a time,
# so the crc32 reads bytes the kernel has just copied while they are still in the CPU's
# cache: 0.37 GB read + verified on one thread in 47 ms in 32 MiB pieces, 38.5 ms in 1-4 MiB.
VERIFY_PIECE_BYTES = 4 << 20


@dataclass(frozen=True)
class ReadOp:
    key: str
    chunk: ChunkRecord
    start: int  # block-aligned absolute byte range to fetch
    end: int
    # The rectangle, in global coordinates, that this op supplies to the target.
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    rows_only: bool  # bytes are the contiguous rows [data_start, ...) of the chunk
    need0: int = 0  # the absolute bytes [need0, need1) the target uses (inside start..end)
    need1: int = 0


@dataclass
class Placed:
    """Where one op's bytes go: ``dst`` (the target's slice) straight from the file when it
    is contiguous and in the chunk's byte order, else through ``staged`` (then copied)."""

    op: ReadOp
    dst: torch.Tensor
    src_shape: tuple[int, ...]
    direct: bool


def place(op: ReadOp, target: Target, local: torch.Tensor) -> Placed:
    t_lo = target.piece.offsets
    if op.lo == t_lo and op.hi == tuple(map(operator.add, t_lo, target.piece.shape)):
        dst = local  # the op fills the whole target (a whole-tensor chunk: the usual case)
    else:
        dst = local[tuple(map(slice, map(operator.sub, op.lo, t_lo),
                              map(operator.sub, op.hi, t_lo)))]
    if op.rows_only:
        src_shape = (op.hi[0] - op.lo[0], *op.chunk.shape[1:])
    else:
        src_shape = tuple(op.chunk.shape)
    # Same shape and contiguous: the target's slice holds the needed bytes in file order.
    direct = tuple(dst.shape) == src_shape and dst.is_contiguous() and (
        op.rows_only or (op.lo == op.chunk.offsets and tuple(op.hi) == tuple(
            map(operator.add, op.chunk.offsets, op.chunk.shape))))
    return Placed(op, dst, src_shape, direct)


def memory(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place."""
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def verify(op: ReadOp, parts: list[memoryview], block: int, step: int) -> None:
    """Check the crc32 of every checksum block of ``op``'s bytes, which arrived in
    ``parts`` (consecutive pieces of ``[op.start, op.end)``: a block may span two), and that
    its floating values are finite (``elastic.format.finite``), each piece right after its
    crc32, while it is still in the core's cache: one pass over the bytes, not two."""
    verify_blocks(op.chunk, op.start, parts, block, step,
                  finite_check(op.chunk, op.key, op.start, step))


def read_placed(placed: list[Placed], source: ByteSource, manifest: Manifest) -> None:
    """Read, verify and place every op (see the module contract)."""
    ordered = sorted(placed, key=lambda p: (p.op.chunk.file, p.op.start))
    batches = batches_of(ordered, BATCH_BYTES, manifest.block_bytes)
    # Local store: every pool thread reads and verifies whole batches. preadv and crc32
    # release the GIL, and the kernel's copy from the page cache costs more than the crc32,
    # so one reader thread was the bottleneck (1.41 GB from the page cache: 188-197 ms with
    # one reader, 135-155 ms with two threads reading). Other sources have one reader, this
    # thread, in file order (the RAM tier's and S3's clients are not shared between
    # threads), and the pool verifies what it read meanwhile. Each batch in flight holds its
    # own staging buffer, recycled once it is verified: at most VERIFY_THREADS + 1.
    pool = verify_pool()
    spare: list[bytearray] = []
    in_flight: list[Future[bytearray]] = []
    try:
        for batch in batches:
            if len(in_flight) > VERIFY_THREADS:
                spare.append(in_flight.pop(0).result())
            staging = spare.pop() if spare else bytearray()
            if source.parallel_reads:
                in_flight.append(pool.submit(_read_and_check, batch, source, staging, manifest))
            else:
                staging, parts_of = _read_batch(batch, source, staging)
                in_flight.append(pool.submit(_check_batch, batch, parts_of, manifest, staging))
    finally:
        wait(in_flight)  # nothing writes into the tensors once this returns
    for f in in_flight:
        f.result()


def split_direct(p: Placed, max_bytes: int, block: int) -> list[Placed]:
    """A direct op cut into ops of at most ``max_bytes`` (whole checksum blocks, at least
    one), so the verification of one large tensor spreads over the pool's threads; each
    piece's ``dst`` is the flat bytes of its part of ``p.dst``. Other ops are not cut (a
    staged chunk is placed whole)."""
    op = p.op
    step = max(block, max_bytes // block * block)
    if not p.direct or op.end - op.start <= step:
        return [p]
    return [narrow_direct(p, s, min(op.end, s + step)) for s in range(op.start, op.end, step)]


def narrow_direct(p: Placed, start: int, end: int) -> Placed:
    """The part of direct op ``p`` that reads bytes ``[start, end)`` (whole checksum blocks
    inside ``[p.op.start, p.op.end)``); its ``dst`` is the flat bytes of its part of
    ``p.dst``, and the partial blocks at the op's edges stay staged."""
    op = p.op
    a = min(max(start, op.need0), end)
    b = max(min(end, op.need1), a)
    flat = p.dst.reshape(-1).view(torch.uint8)
    piece = replace(op, start=start, end=end, need0=a, need1=b)
    return Placed(piece, flat[a - op.need0: b - op.need0], (b - a,), True)


def _read_batch(batch: list[Placed], source: ByteSource, staging: bytearray
                ) -> tuple[bytearray, list[list[memoryview]]]:
    """Read one batch of ops: direct bytes into their tensors, the rest into ``staging``
    (grown if needed, returned). Returns each op's parts, in file order."""
    need = sum(p.op.end - p.op.start - (p.op.need1 - p.op.need0 if p.direct else 0)
               for p in batch)
    if len(staging) < need:
        staging = bytearray(need)
    free = memoryview(staging)
    reads: list[tuple[str, int, list[memoryview]]] = []
    parts_of: list[list[memoryview]] = []
    staged = 0
    for p in batch:
        op = p.op
        if p.direct:
            head, free = free[: op.need0 - op.start], free[op.need0 - op.start:]
            tail, free = free[: op.end - op.need1], free[op.end - op.need1:]
            parts = [head, memory(p.dst), tail]
        else:
            whole, free = free[: op.end - op.start], free[op.end - op.start:]
            parts = [whole]
        staged += sum(len(x) for x in parts) - (op.need1 - op.need0 if p.direct else 0)
        reads.append((op.chunk.file, op.start, parts))
        parts_of.append(parts)
    source.count_staged(staged)
    source.read_into(reads)
    return staging, parts_of


def _check_batch(batch: list[Placed], parts_of: list[list[memoryview]],
                 manifest: Manifest, staging: bytearray) -> bytearray:
    """Verify every block of a batch that was read, then place its staged chunks; returns
    the batch's staging buffer (free again)."""
    for p, parts in zip(batch, parts_of, strict=True):
        verify(p.op, parts, manifest.block_bytes, manifest.step)
    for p, parts in zip(batch, parts_of, strict=True):
        if not p.direct:
            copy_staged(p, parts[0])
    return staging


def _read_and_check(batch: list[Placed], source: ByteSource, staging: bytearray,
                    manifest: Manifest) -> bytearray:
    """``_read_batch`` then ``_check_batch``, on one pool thread (``parallel_reads``), in
    pieces of about ``VERIFY_PIECE_BYTES``: each is verified right after it is read."""
    for piece in batches_of(batch, VERIFY_PIECE_BYTES, manifest.block_bytes):
        staging, parts_of = _read_batch(piece, source, staging)
        staging = _check_batch(piece, parts_of, manifest, staging)
    return staging


def batches_of(placed: list[Placed], max_bytes: int, block: int) -> list[list[Placed]]:
    """``placed`` in order, large direct ops cut (``split_direct``), grouped into
    consecutive batches of about ``max_bytes`` (an op larger than that alone)."""
    batches: list[list[Placed]] = []
    size = 0
    for piece in (q for p in placed for q in split_direct(p, max_bytes, block)):
        if not batches or size + (piece.op.end - piece.op.start) > max_bytes:
            batches.append([])
            size = 0
        batches[-1].append(piece)
        size += piece.op.end - piece.op.start
    return batches


_POOL: list[ThreadPoolExecutor] = []
if hasattr(os, "register_at_fork"):  # a forked child has none of the pool's threads
    os.register_at_fork(after_in_child=_POOL.clear)


def verify_pool() -> ThreadPoolExecutor:
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=VERIFY_THREADS,
                                        thread_name_prefix="baton-verify"))
    return _POOL[0]


def copy_staged(p: Placed, raw: memoryview) -> None:
    """Copy the target's part of an op's bytes (``raw``: bytes ``[start, end)``) to ``dst``."""
    data = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else \
        torch.empty(0, dtype=torch.uint8)
    p.dst.copy_(staged_part(p, data))


def staged_part(p: Placed, raw: torch.Tensor) -> torch.Tensor:
    """The target's part of an op's bytes (``raw``: bytes ``[start, end)`` as a uint8 CPU
    tensor), viewed as ``dst``'s dtype and shape (no copy unless ``raw`` sits at an offset
    the dtype cannot be viewed at)."""
    op, dtype = p.op, p.dst.dtype
    if op.rows_only:
        skip = op.need0 - op.start
        return _typed(raw[skip: skip + op.need1 - op.need0], dtype, p.src_shape)
    c0, c1 = op.chunk.byte_range
    whole = _typed(raw[c0 - op.start: c1 - op.start], dtype, op.chunk.shape)
    return whole[tuple(slice(a - o, b - o) for a, b, o in zip(op.lo, op.hi, op.chunk.offsets,
                                                              strict=True))]


def _typed(data: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    # A typed view needs its byte offset to be a multiple of the item size; bytes staged at
    # another offset (a checksum block size that is not one) are copied first.
    if data.storage_offset() % dtype.itemsize:
        data = data.clone()
    return data.view(dtype).view(shape)
