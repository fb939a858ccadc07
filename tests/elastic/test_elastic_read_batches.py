"""Parallel verified reads (elastic/read/read_batches.py): a tensor larger than a batch is cut into
block-aligned pieces verified on several threads (and, from a local store, read by them);
every byte still lands once, bitwise, counted once, and a corrupt block anywhere is found and
named."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch
from torch import nn

import elastic.read.read_batches as read_batches
from elastic.errors import SnapshotIntegrityError
from elastic.read.byte_source import ByteSource
from elastic.read.read_batches import ReadOp, place, split_direct
from elastic.read.restore import plan_targets, read_tensors
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.state.layout import Piece, Target
from elastic.state.registry import StateRegistry
from elastic.store.snapshot_store import SnapshotStore

BLOCK = 1024


def _snapshot(run: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 128), nn.Linear(128, 5))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    registry = StateRegistry()
    registry.register("model", model)
    registry.register("optim", optim)
    optim.zero_grad()
    model(torch.randn(4, 96)).square().mean().backward()
    optim.step()
    snap = Snapshotter(run, registry,
                       settings=SnapshotSettings(durable=False, ram=False, block_bytes=BLOCK))
    snap.after_step(1, force=True)
    snap.close()
    return {k: v.detach().clone() for k, v in registry.flatten().tensors.items()}


@pytest.fixture
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    # 3 blocks per batch: the 48 KiB weights and moments become 16 pieces each.
    monkeypatch.setattr(read_batches, "BATCH_BYTES", 3 * BLOCK)


def test_split_pieces_cover_the_op_in_whole_blocks() -> None:
    dst = torch.zeros(3750, dtype=torch.uint8)
    # The chunk starts at 100; the op fetches [100, 4100) and the target needs [300, 4050).
    chunk = read_batches.ChunkRecord("f", "k@0", (0,), (1000,), (100, 4100), (0,) * 4)
    op = ReadOp("k", chunk, 100, 4100, (0,), (1000,), True, need0=300, need1=4050)
    whole = read_batches.Placed(op, dst, (3750,), True)
    pieces = split_direct(whole, 2 * BLOCK, BLOCK)
    assert [(p.op.start, p.op.end) for p in pieces] == [(100, 2148), (2148, 4100)]
    assert [(p.op.need0, p.op.need1) for p in pieces] == [(300, 2148), (2148, 4050)]
    assert all(p.direct and p.dst.numel() == p.op.need1 - p.op.need0 for p in pieces)
    # A piece's dst is the matching part of the op's destination memory.
    assert pieces[1].dst.data_ptr() == whole.dst.data_ptr() + (2148 - 300)
    assert split_direct(whole, 8 * BLOCK, BLOCK) == [whole]


@pytest.mark.usefixtures("small_batches")
def test_pieces_restore_bitwise_reading_each_byte_once(tmp_path) -> None:
    saved = _snapshot(str(tmp_path))
    store = SnapshotStore(str(tmp_path))
    manifest = store.load_manifest(1)
    (file,) = manifest.files
    source = ByteSource(store, 1)
    targets = plan_targets(manifest, {k: torch.empty_like(v) for k, v in saved.items()})
    got = read_tensors(manifest, targets, source)
    assert source.bytes_into == os.path.getsize(store.step_path(1, file))
    assert source.staged_bytes == 0
    for key, value in saved.items():
        assert torch.equal(got[key], value), key
    # A resharded target: rows 37..101 of the first weight, pieces cut inside its range.
    weight = saved["model.0.weight"]
    part = Piece("model.0.weight", weight.dtype, tuple(weight.shape), (37, 0),
                 (64, weight.shape[1]))
    rows = read_tensors(manifest, {"model.0.weight": Target(part, torch.device("cpu"),
                                                            lambda t: t)},
                        ByteSource(store, 1))["model.0.weight"]
    assert torch.equal(rows, weight[37:101])


@pytest.mark.usefixtures("small_batches")
@pytest.mark.parametrize("verify_piece_blocks", [None, 1], ids=["whole-batch", "block-pieces"])
def test_a_corrupt_block_inside_a_piece_is_named(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                 verify_piece_blocks: int | None) -> None:
    """Also when a pool thread reads and verifies its batch one block at a time."""
    if verify_piece_blocks is not None:
        monkeypatch.setattr(read_batches, "BATCH_BYTES", 24 * BLOCK)
        monkeypatch.setattr(read_batches, "VERIFY_PIECE_BYTES", verify_piece_blocks * BLOCK)
    saved = _snapshot(str(tmp_path))
    store = SnapshotStore(str(tmp_path))
    manifest = store.load_manifest(1)
    chunk = manifest.tensors["optim.state.0.weight.exp_avg_sq"].chunks[0]
    # A byte in block 9 of the chunk: in the fourth piece, verified on a pool thread.
    where = chunk.byte_range[0] + 9 * BLOCK + 17
    path = store.step_path(1, chunk.file)
    with open(path, "r+b") as fh:
        fh.seek(where)
        byte = fh.read(1)
        fh.seek(where)
        fh.write(bytes([byte[0] ^ 0x40]))
    targets = plan_targets(manifest, {k: torch.empty_like(v) for k, v in saved.items()})
    with pytest.raises(SnapshotIntegrityError, match=f"chunk {chunk.name}, block 9;"):
        read_tensors(manifest, targets, ByteSource(store, 1))


def test_place_of_a_split_piece_matches_its_op() -> None:
    """``place`` and ``split_direct`` agree: pieces of a placed op are all direct."""
    local = torch.zeros(64, 32)
    chunk = read_batches.ChunkRecord("f", "k@0,0", (0, 0), (64, 32), (8, 8 + 64 * 128),
                                     (0,) * 8)
    op = ReadOp("k", chunk, 8, 8 + 64 * 128, (0, 0), (64, 32), True, 8, 8 + 64 * 128)
    target = Target(Piece("k", torch.float32, (64, 32), (0, 0), (64, 32)),
                    torch.device("cpu"), lambda t: t)
    placed = place(op, target, local)
    pieces = split_direct(placed, 2 * BLOCK, BLOCK)
    assert len(pieces) == 4
    assert sum(p.dst.numel() for p in pieces) == local.numel() * 4


@pytest.mark.usefixtures("small_batches")
@pytest.mark.parametrize("with_ram", [False, True])
def test_local_batches_are_read_on_the_pool_others_by_the_caller(
        tmp_path, monkeypatch: pytest.MonkeyPatch, with_ram: bool) -> None:
    """A local store's batches are read by the pool's threads (several readers: the kernel's
    copy was the bottleneck); with a RAM tier in front (here one that holds nothing, so
    storage serves every read) the calling thread reads them all. Either way every byte is
    read and counted once and lands bitwise."""
    saved = _snapshot(str(tmp_path))
    store = SnapshotStore(str(tmp_path))
    manifest = store.load_manifest(1)
    (file,) = manifest.files
    readers: list[str] = []
    read_into = store.read_into

    def recorded(path: str, reads: Any) -> None:
        readers.append(threading.current_thread().name)
        read_into(path, reads)

    monkeypatch.setattr(store, "read_into", recorded)
    source = ByteSource(store, 1, ram=(lambda requests: None) if with_ram else None)
    assert source.parallel_reads is not with_ram
    targets = plan_targets(manifest, {k: torch.empty_like(v) for k, v in saved.items()})
    before = store.stats.bytes_read
    got = read_tensors(manifest, targets, source)
    for key, value in saved.items():
        assert torch.equal(got[key], value), key
    assert source.bytes_into == os.path.getsize(store.step_path(1, file))
    assert store.stats.bytes_read - before == source.bytes_into
    batch_reads = readers[1:]  # the first read is the file's header, before any batch
    assert len(batch_reads) > read_batches.VERIFY_THREADS, readers
    caller = threading.current_thread().name
    if with_ram:
        assert set(batch_reads) == {caller}, readers
    else:
        assert caller not in batch_reads and all(
            name.startswith("baton-verify") for name in batch_reads), readers


def test_a_local_batch_is_verified_piece_by_piece(tmp_path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool thread reading from a local store verifies each few-block piece of its batch
    right after reading it (the crc32 then finds the bytes in the CPU's cache), never two
    reads in a row; still bitwise, every byte read once."""
    monkeypatch.setattr(read_batches, "BATCH_BYTES", 24 * BLOCK)
    monkeypatch.setattr(read_batches, "VERIFY_PIECE_BYTES", 3 * BLOCK)
    saved = _snapshot(str(tmp_path))
    store = SnapshotStore(str(tmp_path))
    manifest = store.load_manifest(1)
    (file,) = manifest.files
    events: dict[str, list[tuple[str, int]]] = {}
    read_into, verify = store.read_into, read_batches.verify

    def recorded_read(path: str, reads: Any) -> None:
        nbytes = sum(len(b) for _, bufs in reads for b in bufs)
        events.setdefault(threading.current_thread().name, []).append(("read", nbytes))
        read_into(path, reads)

    def recorded_verify(op: ReadOp, *args: Any) -> None:
        events.setdefault(threading.current_thread().name, []).append(("verify", 0))
        verify(op, *args)

    monkeypatch.setattr(store, "read_into", recorded_read)
    monkeypatch.setattr(read_batches, "verify", recorded_verify)
    source = ByteSource(store, 1)
    targets = plan_targets(manifest, {k: torch.empty_like(v) for k, v in saved.items()})
    got = read_tensors(manifest, targets, source)
    for key, value in saved.items():
        assert torch.equal(got[key], value), key
    assert source.bytes_into == os.path.getsize(store.step_path(1, file))
    pool = {name: seq for name, seq in events.items() if name.startswith("baton-verify")}
    reads = [n for seq in pool.values() for kind, n in seq if kind == "read"]
    assert len(reads) > 24 // 3 and max(reads) <= 3 * BLOCK, reads
    for seq in pool.values():
        kinds = [kind for kind, _ in seq]
        assert kinds[0] == "read" and kinds[-1] == "verify", kinds
        assert ("read", "read") not in zip(kinds, kinds[1:], strict=False), kinds
