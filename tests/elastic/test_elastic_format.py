"""Unit tests of the format pieces: chunk ownership, header layout, range reads with
checksums, JSON skeletons, and the pipelined capture's consistent cut."""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from elastic.format.records import Manifest, TensorRecord, crc32_blocks
from elastic.read.byte_source import ByteSource
from elastic.read.restore import read_tensors
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.state.layout import Piece, Target, owned_pieces
from elastic.state.registry import decode_tree, encode_tree
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import build, full_state, train_step
from elastic.write.capture import ShardImage


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3), min_size=1,
                    max_size=6),
    world_size=st.integers(1, 5),
    split=st.sampled_from([1, 16, 10**9]),
)
def test_every_element_is_written_exactly_once(shapes, world_size, split) -> None:
    tensors = {f"t{i}": torch.zeros(s) for i, s in enumerate(shapes)}
    seen = {k: torch.zeros(t.shape, dtype=torch.int32) for k, t in tensors.items()}
    per_rank = [0] * world_size
    for rank in range(world_size):
        for o in owned_pieces(tensors, rank, world_size, split_min_bytes=split):
            sl = tuple(slice(a, a + n) for a, n in zip(o.piece.offsets, o.piece.shape,
                                                       strict=True))
            seen[o.piece.key][sl] += 1
            assert tuple(o.source.shape) == o.piece.shape
            per_rank[rank] += o.piece.nbytes
    for key, counts in seen.items():
        assert bool((counts == 1).all()), key
    if split == 1 and all(len(s) > 0 and s[0] >= world_size for s in shapes):
        # Every tensor split by rows: each rank writes a near-equal share.
        assert max(per_rank) - min(per_rank) <= sum(4 * math.prod(s[1:]) for s in shapes)


def test_reads_only_needed_ranges_and_verifies_blocks(tmp_path) -> None:
    """A rank that needs rows 5..9 of a 12-row chunk reads about that much, not the chunk."""
    store = SnapshotStore(str(tmp_path / "run"))
    big = torch.arange(12 * 256, dtype=torch.float32).view(12, 256)  # 1 KiB rows
    tensors = {"model.w": big}
    owned = owned_pieces(tensors, 0, 1, split_min_bytes=10**9)
    image = ShardImage([o.piece for o in owned])
    for o in owned:
        image.views[(o.piece.key, o.piece.offsets)].copy_(o.source)
    path = store.step_path(1, "shard-00000-of-00001.safetensors")
    store.write_file(path, image.memoryview())
    with safe_open(path, "pt") as fh:  # a plain safetensors file
        assert torch.equal(fh.get_tensor("model.w@0,0"), big)
    block = 1024
    records = image.chunk_records("shard-00000-of-00001.safetensors", block)
    manifest = Manifest(step=1, world_size=1, layout="ddp", block_bytes=block,
                        tensors={"model.w": TensorRecord("F32", (12, 256), records["model.w"])},
                        state={}, files=[])
    sub = Target(Piece("model.w", torch.float32, (12, 256), (5, 0), (4, 256)),
                 torch.device("cpu"), lambda t: t)
    source = ByteSource(store, 1)
    got = read_tensors(manifest, {"model.w": sub}, source)["model.w"]
    assert torch.equal(got, big[5:9])
    # Exactly the 4 rows (block-aligned here), plus the file's safetensors header, which
    # restore checks every used chunk against.
    assert store.stats.bytes_read == 4 * 1024 + records["model.w"][0].byte_range[0]
    # Flip one byte inside row 6: detected, and the message names chunk and block.
    with open(path, "r+b") as fh:
        fh.seek(records["model.w"][0].byte_range[0] + 6 * 1024 + 3)
        fh.write(b"\x7f")
    with pytest.raises(ValueError, match=r"checksum mismatch .* model\.w@0,0, block 6"):
        read_tensors(manifest, {"model.w": sub}, ByteSource(store, 1))
    assert crc32_blocks(b"", 4) == [0]


@settings(max_examples=25, deadline=None)
@given(data=st.binary(max_size=3000), block=st.integers(1, 700))
def test_checksums_are_zlib_crc32_whatever_the_implementation(data: bytes, block: int) -> None:
    """The format says crc32 = zlib's CRC-32: the faster implementation Baton uses (zlib-ng)
    must give the same values, or snapshots written elsewhere would read as corrupt."""
    expected = [zlib.crc32(data[i:i + block]) for i in range(0, len(data), block)] or [0]
    assert crc32_blocks(data, block) == expected


def test_json_skeleton_round_trip_keeps_types() -> None:
    state = {"betas": (0.9, 0.95), "by_int": {3: "x", 1: [1.5, None]}, "t": torch.ones(2),
             "nested": [{"a": True}]}
    tensors: dict[str, torch.Tensor] = {}
    skeleton = encode_tree(state, "extra", tensors)
    assert list(tensors) == ["extra.t"]
    back = decode_tree(skeleton, tensors)
    assert back["betas"] == (0.9, 0.95) and back["by_int"] == {3: "x", 1: [1.5, None]}
    assert back["nested"] == [{"a": True}] and back["t"] is tensors["extra.t"]
    with pytest.raises(ValueError, match="extra.bad"):
        encode_tree({"bad": object()}, "extra", {})


def test_pipelined_capture_is_a_consistent_cut(tmp_path) -> None:
    """begin_capture after step s; the next forward/backward runs while copies proceed;
    wait_capture before optimizer.step: the snapshot holds exactly step s (P2)."""
    run = str(tmp_path / "run")
    ts = build(seed=2)
    snap = Snapshotter(run, ts.registry,
                       settings=SnapshotSettings(snapshot_every=2, split_min_bytes=64,
                                                 on_busy="wait"))
    expected = None
    for step in range(1, 5):
        gen = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 2, generator=gen)
        loss = (ts.model(x) - y).pow(2).mean()
        ts.optim.zero_grad(set_to_none=True)
        loss.backward()
        snap.wait_capture()  # before the optimizer mutates what is being copied
        ts.optim.step()
        ts.sched.step()
        ts.cursor.samples += 6
        if snap.begin_capture_if_due(step) and step == 4:
            expected = full_state(ts)
    snap.close()
    assert expected is not None
    fresh = build(seed=9)
    assert Snapshotter(run, fresh.registry).restore() == 4
    for key, value in expected.items():
        assert torch.equal(full_state(fresh)[key], value), key
    ref = build(seed=2)
    for step in range(1, 5):
        train_step(ref, step)
    for key, value in full_state(ref).items():
        assert torch.equal(full_state(fresh)[key], value), key


class _CountingNet(torch.nn.Module):
    """Forward reassigns one buffer (a new tensor each call) and updates another in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(3))
        self.register_buffer("total", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1  # reassigned: the old tensor is freed
        self.total.add_(1)  # in place
        return self.lin(x)


def test_capture_keeps_buffers_a_later_forward_reassigns_or_mutates(
    tmp_path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The next step's forward runs before the side thread copies (held back here): the
    snapshot still holds both buffers as they were when the capture began (P2)."""
    import threading

    from elastic.state.registry import StateRegistry
    from elastic.write.capture import Capturer

    net = _CountingNet()
    registry = StateRegistry()
    registry.register("model", net)
    net(torch.ones(1, 4))
    held = threading.Event()
    real = Capturer._capture

    def held_back(self, *args, **kwargs):
        held.wait(30)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Capturer, "_capture", held_back)
    capturer = Capturer(registry, 0, 1)
    handle = capturer.begin(1)
    for _ in range(3):
        net(torch.ones(1, 4))  # the next steps' forwards, while the copy waits
    held.set()
    captured = handle.wait()
    capturer.close()
    values = {c.piece.key: captured.image.views[(c.piece.key, c.piece.offsets)]
              for c in captured.image.chunks}
    assert torch.equal(values["model.calls"], torch.ones(3)), values["model.calls"]
    assert torch.equal(values["model.total"], torch.ones(3)), values["model.total"]
    assert torch.equal(net.calls, torch.full((3,), 4.0))  # training itself went on


@pytest.mark.gpu
def test_saved_on_cuda_restores_on_cpu_and_back(tmp_path) -> None:
    run = str(tmp_path / "run")
    ts = build(seed=2, device="cuda")
    snap = Snapshotter(run, ts.registry,
                       settings=SnapshotSettings(snapshot_every=2, split_min_bytes=64))
    for step in range(1, 3):
        train_step(ts, step)
        snap.after_step(step)
    snap.close()
    saved = full_state(ts)
    on_cpu = build(seed=9)
    assert Snapshotter(run, on_cpu.registry).restore() == 2
    back = build(seed=10, device="cuda")
    assert Snapshotter(run, back.registry).restore() == 2
    assert next(back.model.parameters()).is_cuda
    for key, value in saved.items():
        assert torch.equal(full_state(on_cpu)[key], value), key
        assert torch.equal(full_state(back)[key], value), key


@pytest.mark.gpu
def test_a_cuda_restore_fills_the_live_tensors_through_pinned_staging(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the restore reads into the live CUDA tensors (same memory before and after)
    through pinned staging buffers; a fresh optimizer's moments are made on the GPU."""
    import elastic.read.device_stage as device_stage

    run = str(tmp_path / "run")
    ts = build(seed=2, device="cuda")
    snap = Snapshotter(run, ts.registry,
                       settings=SnapshotSettings(snapshot_every=2, split_min_bytes=64))
    for step in range(1, 3):
        train_step(ts, step)
        snap.after_step(step)
    snap.close()
    saved = full_state(ts)
    stagers: list[device_stage.Stager] = []
    real = device_stage.read_staged

    def counted(*args: Any, **kwargs: Any) -> device_stage.Stager:
        stagers.append(real(*args, **kwargs))
        return stagers[-1]

    monkeypatch.setattr(device_stage, "read_staged", counted)
    live = build(seed=10, device="cuda")
    train_step(live, 1)  # its optimizer state exists, on the GPU
    before = {k: v.data_ptr() for k, v in live.registry.flatten().tensors.items()}
    assert Snapshotter(run, live.registry).restore() == 2
    assert stagers and all(s.pinned and 0 < s.peak_bytes <= s.count * s.buffer_bytes
                           for s in stagers)
    assert {k: v.data_ptr() for k, v in live.registry.flatten().tensors.items()} == before
    fresh = build(seed=11, device="cuda")  # no optimizer state yet
    assert Snapshotter(run, fresh.registry).restore() == 2
    assert all(v.is_cuda for s in fresh.optim.state.values() for k, v in s.items()
               if k != "step")
    for key, value in saved.items():
        assert torch.equal(full_state(live)[key], value), key
        assert torch.equal(full_state(fresh)[key], value), key
