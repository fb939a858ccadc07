"""Restore in place (elastic/read/restore.py, elastic/read/device_stage.py): a restore writes into
the live model and optimizer tensors (same storage before and after), allocates nothing state-sized
beyond optimizer state that did not exist yet, and a corrupt chunk found mid-restore falls back to
the previous snapshot bitwise; the staging path a GPU restore takes never lets a buffer be read into
before its copies ended, and copies nothing of a batch that fails its checksums."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import elastic.read.read_batches as read_batches
from elastic.errors import SnapshotIntegrityError
from elastic.format.records import MANIFEST_NAME, shard_filename, step_dirname
from elastic.read.device_stage import read_staged
from elastic.read.read_batches import place
from elastic.read.restore import (
    ByteSource,
    allocate,
    check_headers,
    plan_reads,
    plan_targets,
    read_tensors,
)
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.state.registry import StateRegistry
from elastic.store.snapshot_store import SnapshotStore

WIDTH = 128


class Net(nn.Module):
    """The head is used from step 3 on: snapshot 2 holds no optimizer state for it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor, late: bool) -> torch.Tensor:
        y = self.b(torch.nn.functional.gelu(self.a(x)))
        return self.head(y) if late else y[:, :4]


class State:
    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = Net()
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.registry = StateRegistry()
        self.registry.register("model", self.model)
        self.registry.register("optim", self.optim)

    def step(self, step: int) -> None:
        gen = torch.Generator().manual_seed(step)
        self.optim.zero_grad(set_to_none=True)
        self.model(torch.randn(8, WIDTH, generator=gen), step >= 3).square().mean().backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)

    def flat(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.registry.flatten().tensors.items()}

    def pointers(self) -> dict[str, int]:
        """Where every live model and optimizer tensor's bytes are."""
        return {k: v.data_ptr() for k, v in self.registry.flatten().tensors.items()}


class Allocations(TorchDispatchMode):
    """Bytes of every tensor storage an op creates on this thread (an output whose storage is
    none of the op's inputs'): all the restore allocates through torch, except reads'
    staging views over Python buffers (``torch.frombuffer`` allocates nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.bytes += t.untyped_storage().nbytes()
        return out


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _train_run(run: str, steps: int = 4) -> dict[int, dict[str, torch.Tensor]]:
    """Snapshots at steps 2 and 4 (small checksum blocks: many per tensor); the state at each."""
    trained = State(seed=3)
    snap = Snapshotter(run, trained.registry,
                       settings=SnapshotSettings(snapshot_every=2, keep_last=5, durable=False,
                                                 ram=False, block_bytes=4096))
    refs = {}
    for step in range(1, steps + 1):
        trained.step(step)
        snap.after_step(step)
        snap.persister.wait()
        if step % 2 == 0:
            refs[step] = trained.flat()
    snap.close()
    return refs


def _assert_equal(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(ref)
    for key, value in ref.items():
        assert torch.equal(got[key], value), key


def test_restore_writes_into_the_live_tensors_and_allocates_nothing_state_sized(
        tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    refs = _train_run(run)
    live = State(seed=11)
    live.step(3)  # a process that holds its optimizer state (every parameter's)
    before = live.pointers()
    params = [id(p) for p in live.model.parameters()]
    snap = Snapshotter(run, live.registry, settings=SnapshotSettings(ram=False))
    with Allocations() as allocated:
        assert snap.restore() == 4
    assert live.pointers() == before  # every model and optimizer tensor: the same memory
    assert [id(p) for p in live.model.parameters()] == params
    _assert_equal(live.flat(), refs[4])
    # Nothing state-sized: the step counters and bookkeeping, not a copy of any tensor.
    state = _nbytes(refs[4])
    assert allocated.bytes < 0.02 * state, (allocated.bytes, state)
    # The optimizer steps with the moments it was restored into: as the uninterrupted run.
    whole = State(seed=3)
    for step in range(1, 7):
        whole.step(step)
        if step > 4:
            live.step(step)
    _assert_equal(live.flat(), whole.flat())


def test_a_fresh_optimizer_s_moments_are_created_once(tmp_path: Path) -> None:
    """A restarted worker's optimizer has no state: its moments are allocated once, read
    into, and adopted by the optimizer; the model is filled in place."""
    run = str(tmp_path / "run")
    refs = _train_run(run)
    live = State(seed=11)
    model_ptrs = {k: v for k, v in live.pointers().items() if k.startswith("model.")}
    with Allocations() as allocated:
        assert Snapshotter(run, live.registry, settings=SnapshotSettings(ram=False)).restore() == 4
    _assert_equal(live.flat(), refs[4])
    assert {k: v for k, v in live.pointers().items() if k.startswith("model.")} == model_ptrs
    moments = _nbytes({k: v for k, v in refs[4].items() if k.endswith(("exp_avg", "exp_avg_sq"))})
    assert moments <= allocated.bytes < moments + 0.02 * _nbytes(refs[4]), (allocated.bytes,
                                                                           moments)


@pytest.mark.parametrize("tier", ["disk", "ram"])
def test_the_ram_tier_fills_the_same_live_tensors(tmp_path: Path, tier: str) -> None:
    trained = State(seed=3)
    trained.step(1)
    snap = Snapshotter(str(tmp_path), trained.registry,
                       settings=SnapshotSettings(durable=False, block_bytes=4096))
    snap.after_step(1, force=True)
    snap.persister.wait()
    snap.coordinator.flush(0)
    expected = trained.flat()
    live = State(seed=11)
    live.step(1)
    before = live.pointers()
    store = SnapshotStore(str(tmp_path))
    ram = None
    if tier == "ram":
        assert snap.ram_tier is not None
        ram = functools.partial(snap.ram_tier.read, 1, snap.coordinator.ram_locations(1))
    manifest = store.load_manifest(1)
    flat = live.registry.flatten()
    source = ByteSource(store, 1, ram=ram)
    targets = plan_targets(manifest, flat.tensors, in_place=live.registry.model_keys())
    live.registry.load(read_tensors(manifest, targets, source), manifest.state, checked=True)
    assert source.used_ram == (tier == "ram") and source.used_storage == (tier == "disk")
    assert live.pointers() == before
    _assert_equal(live.flat(), expected)
    snap.close()


def _flip(run: str, step: int, key: str) -> None:
    path = os.path.join(run, "snapshots", step_dirname(step), shard_filename(0, 1, 1))
    manifest = json.load(open(os.path.join(os.path.dirname(path), MANIFEST_NAME)))
    chunk = manifest["tensors"][key]["chunks"][0]
    with open(path, "r+b") as fh:
        fh.seek(chunk["byte_range"][1] - 3)  # in the chunk's last checksum block
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x40]))


def test_a_corrupt_chunk_mid_restore_falls_back_to_the_previous_snapshot_bitwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Snapshot 4's bytes are written into the live tensors before the corrupt block is
    found; the fallback to snapshot 2 overwrites every one of them and drops the optimizer
    state snapshot 2 does not have (the head's), so the run continues exactly."""
    run = str(tmp_path / "run")
    refs = _train_run(run)
    _flip(run, 4, "model.b.weight")
    live = State(seed=11)
    live.step(3)  # moments for every parameter, the head's included
    before = live.pointers()
    overwritten: list[int] = []
    verify = read_batches.verify

    def watched(op: Any, *args: Any) -> None:
        try:
            verify(op, *args)
        except SnapshotIntegrityError:
            # How many live tensors already hold snapshot 4's values at the failure.
            now = live.flat()
            overwritten.append(sum(torch.equal(now[k], refs[4][k]) and
                                   not torch.equal(refs[4][k], refs[2].get(k, refs[4][k] + 1))
                                   for k in refs[4] if k in now))
            raise

    monkeypatch.setattr(read_batches, "verify", watched)
    snap = Snapshotter(run, live.registry, settings=SnapshotSettings(ram=False))
    assert snap.restore() == 2
    assert overwritten and overwritten[0] >= 1, overwritten  # the fallback had work to do
    assert any("checksum mismatch" in e and "snapshot 4" in e for e in snap.restore_errors)
    assert snap.coordinator.committed_steps() == [2]  # 4 quarantined, nothing else moved
    assert os.path.exists(os.path.join(run, "quarantine", step_dirname(4), "reason.json"))
    _assert_equal(live.flat(), refs[2])  # the head has no optimizer state, as at step 2
    pointers = live.pointers()
    assert {k: pointers[k] for k in refs[2]} == {k: before[k] for k in refs[2]}
    for step in (3, 4):  # and it continues where the uninterrupted run went
        live.step(step)
    _assert_equal(live.flat(), refs[4])


class DeferredCopier:
    """A device copy engine that copies only when a fence is waited for (a slow DMA): a
    staging buffer read into again before its fence would hand it other bytes."""

    pinned = False

    def __init__(self) -> None:
        self.queued: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.copied = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.queued.append((dst, src))

    def _run(self, upto: int) -> None:
        for dst, src in self.queued[self.copied: upto]:
            dst.copy_(src)
        self.copied = max(self.copied, upto)

    def fence(self) -> Any:
        upto, copier = len(self.queued), self

        class Fence:
            def query(self) -> bool:
                return copier.copied >= upto

            def synchronize(self) -> None:
                copier._run(upto)
        return Fence()

    def finish(self) -> None:
        self._run(len(self.queued))


def _placed(run: str, sentinel: float) -> tuple[Any, list[Any], dict[str, torch.Tensor],
                                                ByteSource]:
    store = SnapshotStore(run)
    manifest = store.load_manifest(4)
    flat = State(seed=11).registry.flatten().tensors
    targets = plan_targets(manifest, flat)
    ops = plan_reads(manifest, targets)
    source = ByteSource(store, 4)
    check_headers(manifest, [(op.key, op.chunk) for op in ops], source)
    local = allocate(targets, 4)
    for t in local.values():
        t.fill_(sentinel)
    return manifest, [place(op, targets[op.key], local[op.key]) for op in ops], local, source


@pytest.mark.parametrize("parallel", [True, False])
def test_staging_reuses_a_buffer_only_after_its_copies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parallel: bool) -> None:
    run = str(tmp_path / "run")
    refs = _train_run(run)
    manifest, placed, local, source = _placed(run, sentinel=7.0)
    if not parallel:  # the RAM tier's order: this thread reads, in file order
        monkeypatch.setattr(ByteSource, "parallel_reads", property(lambda self: False))
    copier = DeferredCopier()
    buffer_bytes = 3 * manifest.block_bytes
    stager = read_staged(placed, source, manifest, copier, buffers=3,
                         buffer_bytes=buffer_bytes)
    for key, value in local.items():
        assert torch.equal(value, refs[4][key]), key
    assert stager.made == 3 and stager.peak_bytes == 3 * buffer_bytes  # bounded, reused
    assert len(copier.queued) > 3 * 3  # many batches through three buffers


def test_a_batch_that_fails_its_checksums_is_never_copied(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    refs = _train_run(run)
    _flip(run, 4, "model.b.weight")
    manifest, placed, local, source = _placed(run, sentinel=7.0)
    copier = DeferredCopier()
    with pytest.raises(SnapshotIntegrityError, match="model.b.weight"):
        read_staged(placed, source, manifest, copier, buffers=3,
                    buffer_bytes=2 * manifest.block_bytes)
    assert copier.copied == len(copier.queued)  # every copy issued finished before it raised
    weight = local["model.b.weight"].reshape(-1)
    corrupt_block = manifest.tensors["model.b.weight"].chunks[0]
    last = (corrupt_block.byte_range[1] - corrupt_block.byte_range[0] - 1) // 4
    assert weight[last].item() == 7.0  # the failing batch's bytes never reached it
    assert torch.equal(weight[:1024], refs[4]["model.b.weight"].reshape(-1)[:1024])
