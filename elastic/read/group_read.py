"""Restore as a group: every checksum block the group needs is read once, by one rank.

``group_read_tensors(manifest, targets, source)`` is ``restore.read_tensors`` for a rank of an
initialised process group (gloo or NCCL; every rank calls it for the same snapshot, with
targets planned the same way). It returns the same tensors, bitwise, but the group reads each
byte of the snapshot that it needs once in all (how the blocks are shared out and exchanged:
docs/design.md, "The group read"):

* Every rank plans its reads as ``read_tensors`` would (``plan_reads``) and the ranks
  all-gather the block ranges. From them every rank computes the same plan: blocks one rank
  needs are *private* to it; blocks several need are *shared*, cut into pieces of at most
  ``SHARE_PIECE_BYTES``, each owned by the needing rank given the fewest bytes so far.
* A replicated (DDP) state is read about ``state / W`` per rank, the rest received; a sharded
  (FSDP2) state shares only the blocks at row boundaries, so the group reads the union of what
  its ranks need, nothing twice.
* Private blocks, and shared pieces of at least ``IN_PLACE_MIN_BYTES`` every needing rank uses
  whole, are read straight into the tensors (``device_stage.read_to``) and the latter broadcast
  from the owner's tensor; other shared pieces travel in rounds of at most ``ROUND_BYTES``
  through a round buffer on ``group_device`` (CPU for gloo, CUDA for NCCL). Memory beyond the
  state: a round buffer or one piece (for NCCL a CPU staging buffer of the same size too).
* Ops whose bytes do not land contiguously in the target are read by their rank alone. Each
  rank checks the headers of the files it reads from (at most W x the headers in all).
* Agreement: a failure (checksum, missing file, storage, memory) on one rank fails the read on
  every rank at the same point, before the exchange and before each round, with the failing
  rank's own error there and, on the others, an error of the same kind
  (``SnapshotIntegrityError`` / ``StorageUnavailableError`` / ``RestoreMemoryError`` /
  ``RuntimeError``) naming that rank and repeating its message; nothing is loaded, so
  ``Snapshotter.restore`` falls back on every rank together. Exchange buffers are allocated
  before the agreement after the own reads: a rank out of memory never leaves others waiting.
* Only bytes whose owner checked their crc32 are sent; only integers and raw bytes, no pickle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elastic import collectives
from elastic.collectives import agree_max, all_gather_ints, group_device
from elastic.errors import RestoreMemoryError, SnapshotIntegrityError, StorageUnavailableError
from elastic.format import ChunkRecord, Manifest, check_headers, snapshot_label
from elastic.read.byte_source import ByteSource
from elastic.read.device_stage import read_to
from elastic.read.read_batches import (
    Placed,
    ReadOp,
    memory,
    narrow_direct,
    place,
    verify,
)
from elastic.read.restore import allocate, check_coverage, plan_reads
from elastic.read.verdict import Verdict
from elastic.state import Target

# Shared spans are cut into pieces of at most this many bytes (whole checksum blocks), the unit
# of balancing the reads between ranks.
SHARE_PIECE_BYTES = 32 << 20
# Shared pieces at least this large that every rank needing them uses whole (a replicated
# tensor's) are read by their owner straight into its tensor and broadcast from there into the
# others' tensors; smaller ones, and the partly used blocks at the edges of sharded rows, are
# exchanged in rounds through one buffer (few collectives for many small pieces).
IN_PLACE_MIN_BYTES = 1 << 20
# Shared pieces are exchanged in rounds of at most this many bytes (one piece larger than it,
# when a checksum block is, is a round of its own): it bounds the exchange buffer.
ROUND_BYTES = 64 << 20

# A failing rank's message, as far as the others repeat it.
_MESSAGE_BYTES = 500


@dataclass(frozen=True)
class _Piece:
    """Shared bytes ``[start, end)`` of chunk number ``chunk``, read by ``owner``."""

    chunk: int
    start: int
    end: int
    owner: int
    needers: tuple[int, ...]
    whole: bool  # every needer uses all of its bytes (a replicated tensor's)


def _chunks(manifest: Manifest) -> list[tuple[str, ChunkRecord]]:
    """Every chunk with its tensor key, in an order all ranks agree on."""
    return [(key, c) for key in sorted(manifest.tensors) for c in manifest.tensors[key].chunks]


def _failure_code(err: BaseException) -> Verdict:
    """The verdict on a failed read (``elastic.read.verdict``: the maximum wins)."""
    if isinstance(err, RestoreMemoryError):
        return Verdict.NO_MEMORY
    if isinstance(err, FileNotFoundError):  # the store answered: the file is not there
        return Verdict.CORRUPT
    if isinstance(err, (SnapshotIntegrityError, ValueError)):
        return Verdict.CORRUPT
    if isinstance(err, (StorageUnavailableError, OSError)):
        return Verdict.UNREACHABLE
    return Verdict.OTHER


def _settle(err: Exception | None, step: int, what: str) -> None:
    """Every rank learns whether any rank failed ``what``; all raise together if one did,
    with the error type of the agreed worst failure (so every rank takes the same path:
    fall back, wait for storage, or stop), a failing rank with its own error when it is of
    that kind, the others naming the first failing rank and its message."""
    code = Verdict.OK if err is None else _failure_code(err)
    worst = Verdict(agree_max(int(code)))
    if worst == Verdict.OK:
        return
    # Never an empty message (a bare TimeoutError()): its rank must still be found.
    mine = (str(err) or type(err).__name__) if err is not None else ""
    said = all_gather_ints(list(mine.encode()[:_MESSAGE_BYTES]))
    if err is not None and code == worst:
        raise err
    rank, message = next((r, bytes(m).decode(errors="replace")) for r, m in enumerate(said) if m)
    where = f"{snapshot_label(step)}: rank {rank} failed while {what}: {message}"
    if worst == Verdict.CORRUPT:
        raise SnapshotIntegrityError(where) from err
    if worst == Verdict.UNREACHABLE:
        raise StorageUnavailableError(where) from err
    if worst == Verdict.NO_MEMORY:
        raise RestoreMemoryError(where) from err
    raise RuntimeError(where) from err


def group_read_tensors(manifest: Manifest, targets: dict[str, Target],
                       source: ByteSource) -> dict[str, torch.Tensor]:
    """Read, verify and assemble every target's local tensor with the group (see the module
    contract). Every rank of the default process group must call it."""
    step = manifest.step
    err: Exception | None = None
    try:
        ops = plan_reads(manifest, targets)
        local = allocate(targets, step)
        placed = [place(op, targets[op.key], local[op.key]) for op in ops]
        check_coverage(manifest, targets, placed)
    except Exception as caught:  # settled with the group: no rank may wait for this one
        err = caught
    _settle(err, step, "planning its reads")

    chunks = _chunks(manifest)
    index = {id(c): i for i, (_, c) in enumerate(chunks)}  # the manifest's own records
    direct = {index[id(p.op.chunk)]: p for p in placed if p.direct}
    alone = [p for p in placed if not p.direct]
    wants = all_gather_ints([x for i, p in sorted(direct.items())
                             for x in (i, p.op.start, p.op.end, p.op.need0, p.op.need1)])
    rank = collectives.rank()
    private, pieces = _plan(wants, manifest.block_bytes)
    # Large pieces every needer uses whole go straight into the owner's tensor and from there
    # into the others' (no round buffer, no copy); the rest go through rounds.
    in_place = [p for p in pieces if p.whole and p.end - p.start >= IN_PLACE_MIN_BYTES]
    rounds = _rounds([p for p in pieces if not (p.whole and p.end - p.start >= IN_PLACE_MIN_BYTES)])

    err = None
    try:
        mine = [narrow_direct(direct[i], start, end) for i, start, end in private.get(rank, [])]
        mine += [narrow_direct(direct[p.chunk], p.start, p.end)
                 for p in in_place if p.owner == rank]
        owned = [p for p in pieces if p.owner == rank]
        check_headers(manifest, [(p.op.key, p.op.chunk) for p in mine + alone]
                      + [chunks[p.chunk] for p in owned], source)
        read_to(mine + alone, source, manifest)
        buffers = _Buffers(in_place, rounds, rank, step)
    except Exception as caught:
        err = caught
    _settle(err, step, "reading its own blocks")

    _broadcast_in_place(in_place, direct, rank, buffers)
    for batch in rounds:
        _exchange(batch, chunks, direct, rank, source, manifest, buffers)
    return {k: t.wrap(local[k].to(t.device)) for k, t in targets.items()}


def _plan(wants: list[list[int]], block: int
          ) -> tuple[dict[int, list[tuple[int, int, int]]], list[_Piece]]:
    """From every rank's ``(chunk, start, end, need0, need1)`` entries (the block-aligned
    range it reads of a chunk, and the bytes of it that it uses): each rank's private ranges
    ``{rank: [(chunk, start, end)]}`` and the shared pieces with their owners."""
    by_chunk: dict[int, list[tuple[int, int, int]]] = {}
    uses: dict[tuple[int, int], tuple[int, int]] = {}  # (chunk, rank) -> bytes it uses
    for rank, flat in enumerate(wants):
        for i in range(0, len(flat), 5):
            chunk, start, end, need0, need1 = flat[i: i + 5]
            if end > start:
                by_chunk.setdefault(chunk, []).append((rank, start, end))
                uses[(chunk, rank)] = (need0, need1)
    private: dict[int, list[tuple[int, int, int]]] = {}
    shared: list[tuple[int, int, int, tuple[int, ...]]] = []
    for chunk in sorted(by_chunk):
        ranges = by_chunk[chunk]
        cuts = sorted({x for _, start, end in ranges for x in (start, end)})
        for a, b in zip(cuts, cuts[1:], strict=False):
            needers = tuple(r for r, start, end in ranges if start <= a and b <= end)
            if len(needers) == 1:
                spans = private.setdefault(needers[0], [])
                if spans and spans[-1][0] == chunk and spans[-1][2] == a:
                    spans[-1] = (chunk, spans[-1][1], b)  # adjacent: one read
                else:
                    spans.append((chunk, a, b))
            elif needers:
                shared.append((chunk, a, b, needers))
    load = [0] * len(wants)
    for rank, spans in private.items():
        load[rank] += sum(end - start for _, start, end in spans)
    step = max(block, SHARE_PIECE_BYTES // block * block)
    pieces: list[_Piece] = []
    for chunk, a, b, needers in shared:
        for start in range(a, b, step):
            end = min(b, start + step)
            owner = min(needers, key=lambda r: (load[r], r))
            load[owner] += end - start
            whole = all(uses[(chunk, r)][0] <= start and end <= uses[(chunk, r)][1]
                        for r in needers)
            pieces.append(_Piece(chunk, start, end, owner, needers, whole))
    return private, pieces


class _Buffers:
    """Every buffer the exchange needs, allocated at once (before the group agrees that the
    ranks' own reads succeeded): ``scratch`` receives in-place pieces this rank does not
    need; ``host`` holds a round; on NCCL ``wire`` carries a piece or a round through the
    device. Each is as large as the largest use; allocation failure is ``RuntimeError``."""

    def __init__(self, in_place: list[_Piece], rounds: list[list[_Piece]], rank: int,
                 step: int) -> None:
        device = group_device()
        scratch = max((p.end - p.start for p in in_place if rank not in p.needers), default=0)
        round_bytes = max((sum(p.end - p.start for p in batch) for batch in rounds), default=0)
        wire = max([round_bytes] + [p.end - p.start for p in in_place])
        try:
            self.scratch = torch.empty(scratch, dtype=torch.uint8)
            self.host = torch.empty(round_bytes, dtype=torch.uint8)
            self.wire = None if device.type == "cpu" else torch.empty(
                wire, dtype=torch.uint8, device=device)
        except RuntimeError as err:  # torch's allocation failure (out of memory)
            raise RestoreMemoryError(
                f"{snapshot_label(step)}: cannot allocate the buffers to exchange shared "
                f"blocks ({str(err).splitlines()[0]}): this worker is short of memory") from err


def _broadcast_in_place(pieces: list[_Piece], direct: dict[int, Placed], rank: int,
                        buffers: _Buffers) -> None:
    """Each piece from its owner's tensor into the tensors of the ranks that need it (a
    rank that does not gets it into a scratch buffer; NCCL through a device buffer)."""
    for piece in pieces:
        size = piece.end - piece.start
        if rank in piece.needers:
            p = direct[piece.chunk]
            flat = p.dst.reshape(-1).view(torch.uint8)
            mine = flat[piece.start - p.op.need0: piece.end - p.op.need0]
        else:
            mine = buffers.scratch[:size]
        if buffers.wire is None:
            collectives.broadcast(mine, piece.owner)
            continue
        wire = buffers.wire[:size]
        if rank == piece.owner:
            wire.copy_(mine)
        collectives.broadcast(wire, piece.owner)
        if rank != piece.owner:
            mine.copy_(wire)


def _rounds(pieces: list[_Piece]) -> list[list[_Piece]]:
    rounds: list[list[_Piece]] = []
    size = ROUND_BYTES
    for piece in pieces:
        if size + piece.end - piece.start > ROUND_BYTES:
            rounds.append([])
            size = 0
        rounds[-1].append(piece)
        size += piece.end - piece.start
    return rounds


def _exchange(batch: list[_Piece], chunks: list[tuple[str, ChunkRecord]],
              direct: dict[int, Placed], rank: int, source: ByteSource,
              manifest: Manifest, buffers: _Buffers) -> None:
    """One round: owners read and verify their pieces, all agree, each owner broadcasts its
    pieces that every rank needs and sends the others to the ranks that need them, and every
    rank that needs a piece copies it into its tensor."""
    # Pieces every rank needs first, by owner (each owner's are one broadcast); then the rest.
    world = collectives.world_size()
    batch = sorted(batch, key=lambda p: (len(p.needers) != world, p.owner))
    offsets, total = [], 0
    for piece in batch:
        offsets.append(total)
        total += piece.end - piece.start
    host = buffers.host[:total]
    err: Exception | None = None
    try:
        reads, ops = [], []
        for piece, off in zip(batch, offsets, strict=True):
            if piece.owner != rank:
                continue
            key, chunk = chunks[piece.chunk]
            view = memory(host[off: off + piece.end - piece.start])
            reads.append((chunk.file, piece.start, [view]))
            ops.append((ReadOp(key, chunk, piece.start, piece.end, (), (), True,
                               piece.start, piece.end), view))
        source.read_into(reads)
        for op, view in ops:
            verify(op, [view], manifest.block_bytes, manifest.step)
    except Exception as caught:
        err = caught
    _settle(err, manifest.step, "reading the blocks it shares")
    buffer = host if buffers.wire is None else buffers.wire[:total].copy_(host)
    everyone = sum(1 for piece in batch if len(piece.needers) == world)
    i = 0
    while i < everyone:  # one broadcast per owner, of its consecutive pieces
        j = i
        while j < everyone and batch[j].owner == batch[i].owner:
            j += 1
        end = offsets[j - 1] + batch[j - 1].end - batch[j - 1].start
        collectives.broadcast(buffer[offsets[i]: end], batch[i].owner)
        i = j
    # Pieces only some ranks need (the edges of sharded rows) go from owner to needers only.
    sends: list[tuple[torch.Tensor, int, int]] = []
    recvs: list[tuple[torch.Tensor, int, int]] = []
    for tag in range(everyone, len(batch)):
        piece, off = batch[tag], offsets[tag]
        part = buffer[off: off + piece.end - piece.start]
        if rank == piece.owner:
            sends += [(part, r, tag) for r in piece.needers if r != rank]
        elif rank in piece.needers:
            recvs.append((part, piece.owner, tag))
    collectives.exchange(sends, recvs)
    if buffer is not host:
        host.copy_(buffer)
    for piece, off in zip(batch, offsets, strict=True):
        if rank not in piece.needers:
            continue
        p = direct[piece.chunk]
        lo, hi = max(p.op.need0, piece.start), min(p.op.need1, piece.end)
        if hi > lo:
            flat = p.dst.reshape(-1).view(torch.uint8)
            flat[lo - p.op.need0: hi - p.op.need0].copy_(
                host[off + lo - piece.start: off + hi - piece.start])
