"""Capture: copy the chunks this rank owns into one reusable CPU file image.

``ShardImage`` is a preallocated uint8 buffer laid out *as the shard file itself*: safetensors
header first, then every owned chunk's bytes. Capturing is a ``copy_`` of each live tensor piece
into its view of the image; persisting is one sequential write of the image (no serialisation,
no extra copy). The image is reused while the owned pieces stay the same (names, shapes,
dtypes), so after the first snapshot a capture touches no fresh pages (a copy into fresh pages
costs several times more: benchmarks/reports/2026-12-07-snapshot-path-costs.md). On CUDA it is
pinned and the copies run on a side stream. Chunks are laid out in decreasing element size, so
every offset is aligned to its element size and the image can be viewed as any dtype.

``Capturer.begin(step)`` takes, synchronously, what the training loop itself changes during the
next step (every non-model component, tensors in them cloned, and the models' buffers, which
forward may update in place) and the references to every model and optimizer tensor (a forward
that reassigns a buffer, or FSDP2 swapping unsharded parameters in, must not change which
tensors this snapshot reads). One long-lived side thread then plans the chunks and copies them
into the image (on CUDA through a side stream that starts after the work already queued),
overlapping the next forward/backward, which reads parameters and optimizer state but does not
change them. ``handle.wait()`` must return before anything mutates them (the next
``optimizer.step()``): the only place training can wait. CheckFreq's pipelining: the stall is
``max(0, capture time - forward/backward time)`` plus the small synchronous part.

At world size > 1 (``replica_checksums=None``, read at each capture) the side thread also takes
the crc32 of every replicated model and optimizer tensor, whole, after the copies and before
``handle.wait()`` returns (``elastic.write.replica_sums``): ``Captured.replicas``, carried by
the persist's receipt so that the commit can refuse replicas that differ.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from elastic.faults import FaultInjector
from elastic.format import (
    ChunkRecord,
    HeaderEntry,
    build_header,
    chunk_name,
    crc32_blocks,
    dtype_to_str,
)
from elastic.state import (
    DEFAULT_SPLIT_MIN_BYTES,
    FlatState,
    OwnedPiece,
    Piece,
    StateRegistry,
    owned_pieces,
)
from elastic.write.replica_sums import replica_checksums


@dataclass(frozen=True)
class ImageChunk:
    piece: Piece
    name: str
    start: int  # absolute byte offset in the file
    end: int


class ShardImage:
    """The bytes of one shard file, preallocated once per ownership plan."""

    def __init__(self, pieces: list[Piece], pin: bool = False) -> None:
        order = sorted(pieces, key=lambda p: (-_esize(p.dtype), p.key, p.offsets))
        entries, cursor = [], 0
        for p in order:
            entries.append(HeaderEntry(chunk_name(p.key, p.offsets), dtype_to_str(p.dtype),
                                       p.shape, (cursor, cursor + p.nbytes)))
            cursor += p.nbytes
        header = build_header(entries)
        self.signature = tuple(order)
        # zeros, not empty: touch every page now so the first capture is as fast as the rest.
        self.buffer = torch.zeros(len(header) + cursor, dtype=torch.uint8, pin_memory=pin)
        self.buffer[: len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        self.chunks: list[ImageChunk] = []
        self.views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        for p, e in zip(order, entries, strict=True):
            start, end = len(header) + e.data_offsets[0], len(header) + e.data_offsets[1]
            self.chunks.append(ImageChunk(p, e.name, start, end))
            self.views[(p.key, p.offsets)] = self.buffer[start:end].view(p.dtype).view(p.shape)

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    def memoryview(self) -> memoryview:
        return self.buffer.numpy().data.cast("B")

    def chunk_records(self, file: str, block_bytes: int) -> dict[str, list[ChunkRecord]]:
        """Records per tensor key, with crc32 per block computed over the image bytes."""
        view = self.memoryview()
        out: dict[str, list[ChunkRecord]] = {}
        for c in self.chunks:
            rec = ChunkRecord(file=file, name=c.name, offsets=c.piece.offsets,
                              shape=c.piece.shape, byte_range=(c.start, c.end),
                              crc32=tuple(crc32_blocks(view[c.start:c.end], block_bytes)))
            out.setdefault(c.piece.key, []).append(rec)
        return out


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class Captured:
    """A finished capture: the image holds step ``step``'s bytes until persisted."""

    step: int
    rank: int
    world_size: int
    image: ShardImage
    skeletons: dict[str, Any]
    catalog: dict[str, dict[str, Any]]  # every logical tensor: {"dtype", "shape"}
    # crc32 of every replicated model and optimizer tensor, whole (world size > 1)
    replicas: dict[str, int] = field(default_factory=dict)


class CaptureHandle:
    def __init__(self, step: int, future: Future[Captured]) -> None:
        self.step = step
        self._future = future

    def wait(self) -> Captured:
        return self._future.result()


class Capturer:
    def __init__(self, registry: StateRegistry, rank: int, world_size: int, *,
                 split_min_bytes: int = DEFAULT_SPLIT_MIN_BYTES,
                 faults: FaultInjector | None = None,
                 replica_checksums: bool | None = None) -> None:
        self.registry = registry
        self.rank = rank
        self.world_size = world_size
        self.split_min_bytes = split_min_bytes
        self.faults = faults or FaultInjector()
        # None: whenever this rank is one of several (its world size may change in process).
        self.replica_checksums = replica_checksums
        self._image: ShardImage | None = None
        # One long-lived thread: starting a thread per capture costs more than the rest of
        # begin() on a busy machine.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-capture")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def begin(self, step: int, models: FlatState | None = None) -> CaptureHandle:
        """Take the small, loop-mutated state now; copy models/optimizers on the side thread.
        ``models``: the registry's models and optimizers flattened just now, if the caller
        has them (the snapshotter's replica check does)."""
        self.faults.hit(self.rank, step, "capture")
        model_keys = self.registry.model_keys()
        other = self.registry.flatten([k for k in self.registry.keys() if k not in model_keys])
        # Scheduler, data cursor and extras change during the next step: copy them now (small).
        other_tensors = {k: t.detach().clone() for k, t in other.tensors.items()}
        # Buffers may be mutated by forward (e.g. BatchNorm statistics): freeze them now too.
        buffers = {b.data_ptr(): b.detach().clone() for m in self.registry.modules()
                   for b in m.buffers() if not isinstance(b, DTensor) and b.numel() > 0}
        # Which tensors this snapshot reads is decided now, with the buffers above: FSDP2
        # swaps unsharded parameters into its modules during forward/backward, and a forward
        # may reassign a buffer (whose new tensor could even reuse a frozen one's address).
        flat = models if models is not None else self.registry.flatten(model_keys)
        ready = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            ready = torch.cuda.Event()
            ready.record()  # the side stream starts after everything queued so far
        future = self._pool.submit(self._capture, step, flat, other.skeletons, other_tensors,
                                   buffers, ready)
        return CaptureHandle(step, future)

    def _capture(self, step: int, flat: FlatState, skeletons: dict[str, Any],
                 other_tensors: dict[str, torch.Tensor], buffers: dict[int, torch.Tensor],
                 ready: Any) -> Captured:
        with torch.no_grad():
            tensors = {**flat.tensors, **other_tensors}
            for key, t in tensors.items():
                frozen = None if isinstance(t, DTensor) else buffers.get(t.data_ptr())
                if frozen is not None and frozen.shape == t.shape:
                    tensors[key] = frozen
            owned = owned_pieces(tensors, self.rank, self.world_size, self.split_min_bytes)
            signature = tuple(sorted((o.piece for o in owned),
                                     key=lambda p: (-_esize(p.dtype), p.key, p.offsets)))
            on_cuda = any(o.source.is_cuda for o in owned)
            if self._image is None or self._image.signature != signature:
                self._image = ShardImage([o.piece for o in owned], pin=on_cuda)
            checked = ({k: tensors[k] for k in flat.tensors} if self._checksummed() else {})
            if on_cuda:
                stream = torch.cuda.Stream()
                if ready is not None:
                    stream.wait_event(ready)
                with torch.cuda.stream(stream):
                    _copy_all(owned, self._image, non_blocking=True)
                    replicas = replica_checksums(checked)  # after the copies, same stream
                stream.synchronize()
            else:
                _copy_all(owned, self._image)
                replicas = replica_checksums(checked)
        catalog = {k: {"dtype": dtype_to_str(t.dtype), "shape": list(t.shape)}
                   for k, t in tensors.items()}
        ordered = {k: ({**flat.skeletons, **skeletons})[k] for k in self.registry.keys()}
        return Captured(step, self.rank, self.world_size, self._image, ordered, catalog,
                        replicas)

    def _checksummed(self) -> bool:
        """Whether this capture takes the replica checksums (the constructor's argument)."""
        if self.replica_checksums is None:
            return self.world_size > 1
        return self.replica_checksums


def _copy_all(owned: list[OwnedPiece], image: ShardImage, non_blocking: bool = False) -> None:
    for o in owned:
        image.views[(o.piece.key, o.piece.offsets)].copy_(o.source.detach(),
                                                          non_blocking=non_blocking)
