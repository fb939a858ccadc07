"""A group restores reading each byte once between its ranks (issue 14, point 4), on real
gloo process groups (and NCCL where a machine has two GPUs or more: `multigpu`): a DDP
restore at W=3 reads the state once in all, not three times; a
corrupt block in one rank's part sends every rank back to the previous snapshot together;
an FSDP2 restore from W=2 to W'=4 reads no more than 1.1x the bytes its ranks need.

Bytes are counted per rank with a counting ``ByteSource`` (what it delivered, minus the
safetensors headers it read: the headers of the files a rank reads from, at most W x all
headers in the group) and cross-checked with ``SnapshotStore.stats``."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import elastic.read.group_read as group_read_module
import elastic.read.newest as newest_module
from elastic.format.records import Manifest
from elastic.read.byte_source import ByteSource
from elastic.read.group_read import group_read_tensors
from elastic.read.restore import plan_targets, read_tensors
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.storage import MERGE_HOLE_BYTES, READ_INTO_MAX_WASTE, merge_ranges
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import build, full_state, run_group, train_step

BLOCK = 256  # small checksum blocks: TinyNet's tensors span several, as real ones do


def _header_bytes(manifest: Manifest, files: set[str]) -> int:
    """What ``check_headers`` reads of each file: its bytes up to its first chunk."""
    first: dict[str, int] = {}
    for rec in manifest.tensors.values():
        for c in rec.chunks:
            first[c.file] = min(first.get(c.file, c.byte_range[0]), c.byte_range[0])
    return sum(first[f] for f in files)


def _save(rank: int, world_size: int, run: str, layout: str, steps: tuple[int, ...],
          block_bytes: int) -> None:
    ts = build(seed=7, layout=layout, world_size=world_size)
    snap = Snapshotter(run, ts.registry, rank, world_size,
                       settings=SnapshotSettings(layout=layout, snapshot_every=10**6,
                                                 split_min_bytes=64, durable=False,
                                                 block_bytes=block_bytes, keep_last=len(steps)))
    for step in range(1, max(steps) + 1):
        train_step(ts, step)
        if step in steps:
            snap.after_step(step, force=True)
            snap.persister.wait()
            ref = full_state(ts)
            if rank == 0:
                save_file(ref, os.path.join(run, f"ref-{step}.safetensors"))
    snap.close()


def _restore_ddp(rank: int, world_size: int, run: str, out: str,
                 in_place_min_bytes: int | None = None) -> None:
    """Restore through ``Snapshotter.restore`` with a ByteSource that keeps count;
    ``in_place_min_bytes`` sets ``group_read.IN_PLACE_MIN_BYTES`` in this process."""
    sources: list[ByteSource] = []
    if in_place_min_bytes is not None:
        group_read_module.IN_PLACE_MIN_BYTES = in_place_min_bytes

    class Counting(ByteSource):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            sources.append(self)

    newest_module.ByteSource = Counting  # type: ignore[misc]  # this process only
    # Over NCCL the model lives on this rank's GPU (as a real DDP worker's).
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    ts = build(seed=99, layout="ddp", world_size=world_size, device=device)
    snap = Snapshotter(run, ts.registry, rank, world_size,
                       settings=SnapshotSettings(layout="ddp", snapshot_every=10**6))
    before = snap.store.stats.bytes_read
    step = snap.restore()
    store_bytes = snap.store.stats.bytes_read - before
    got = full_state(ts)
    source = sources[-1]
    manifest = snap.store.load_manifest(step)
    headers = _header_bytes(manifest, set(source.headers))
    result = {"step": step, "errors": snap.restore_errors,
              "tensor_bytes": source.bytes_into - headers, "headers": headers,
              "store_bytes": store_bytes,
              "state_bytes": manifest.nbytes(), "restored_from": snap.restored_from}
    snap.close()
    if rank == 0:
        save_file(got, os.path.join(out, "got.safetensors"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)


def _results(out: str, world_size: int) -> list[dict]:
    results = []
    for r in range(world_size):
        with open(os.path.join(out, f"rank{r}.json")) as fh:
            results.append(json.load(fh))
    return results


def _assert_bitwise(got_file: str, ref_file: str) -> None:
    got, ref = load_file(got_file), load_file(ref_file)
    assert sorted(got) == sorted(ref)
    for key, value in ref.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


@pytest.mark.parametrize("in_place_min_bytes", [None, 0], ids=["rounds", "in-place"])
def test_ddp_restore_at_three_reads_each_byte_once(tmp_path, in_place_min_bytes) -> None:
    """TinyNet's pieces are smaller than IN_PLACE_MIN_BYTES: they are exchanged in rounds;
    with the threshold at 0 they go from the owner's tensors into the others' instead."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out")
    os.makedirs(out)
    run_group(_save, 2, run, "ddp", (3,), BLOCK, tmp_dir=str(tmp_path))
    run_group(_restore_ddp, 3, run, out, in_place_min_bytes, tmp_dir=str(tmp_path))
    _check_each_byte_read_once(run, out, 3)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_ddp_restore_over_nccl_reads_each_byte_once(tmp_path) -> None:
    """The group read over NCCL (issue 14: its exchange then runs in CUDA buffers), on as many
    GPUs as there are, up to 4, one rank per GPU, the model on its rank's GPU: every byte
    read once in all, the state restored bitwise."""
    world = min(4, torch.cuda.device_count())
    run, out = str(tmp_path / "run"), str(tmp_path / "out")
    os.makedirs(out)
    run_group(_save, 2, run, "ddp", (3,), BLOCK, tmp_dir=str(tmp_path))
    run_group(_restore_ddp, world, run, out, tmp_dir=str(tmp_path), backend="nccl")
    _check_each_byte_read_once(run, out, world)


def _check_each_byte_read_once(run: str, out: str, world: int) -> None:
    results = _results(out, world)
    state = results[0]["state_bytes"]
    read = [r["tensor_bytes"] for r in results]
    print(f"DDP W={world} restore: tensor bytes read per rank {read}, sum {sum(read)}, "
          f"state {state} (reading alone: {world * state})")
    assert all(r["step"] == 3 and not r["errors"] for r in results)
    assert sum(read) == state  # every byte once: nothing twice, nothing left out
    assert all(0 < n < 0.6 * state for n in read)  # shared out (state / 3, within a chunk)
    # The store saw the same bytes, plus the headers, each rank's manifest and the store
    # coordinator's small JSON records (under 1 KiB): no tensor bytes the count missed.
    manifest_bytes = os.path.getsize(os.path.join(run, "snapshots", "000000003",
                                                  "manifest.json"))
    for r in results:
        extra = r["store_bytes"] - (r["tensor_bytes"] + r["headers"] + manifest_bytes)
        assert 0 <= extra < 1024, r
    _assert_bitwise(os.path.join(out, "got.safetensors"),
                    os.path.join(run, "ref-3.safetensors"))


def test_corrupt_block_in_one_ranks_part_falls_back_on_every_rank(tmp_path) -> None:
    run, out = str(tmp_path / "run"), str(tmp_path / "out")
    os.makedirs(out)
    run_group(_save, 2, run, "ddp", (2, 4), BLOCK, tmp_dir=str(tmp_path))
    store = SnapshotStore(run)
    manifest = store.load_manifest(4)
    chunk = manifest.tensors["model.inp.weight"].chunks[0]
    path = store.step_path(4, chunk.file)
    with open(path, "r+b") as fh:  # one flipped byte in one block: one rank reads it
        fh.seek(chunk.byte_range[0] + BLOCK + 3)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    run_group(_restore_ddp, 3, run, out, tmp_dir=str(tmp_path))
    results = _results(out, 3)
    assert [r["step"] for r in results] == [2, 2, 2]
    assert all(len(r["errors"]) == 1 for r in results)
    # The rank that read the block found it; the others repeat its message and rank.
    assert all("checksum mismatch" in r["errors"][0] and "block 1" in r["errors"][0]
               for r in results)
    finder = [r for r, res in enumerate(results) if "failed while" not in res["errors"][0]]
    assert len(finder) == 1
    assert all(f"rank {finder[0]} failed while" in res["errors"][0]
               for r, res in enumerate(results) if r != finder[0])
    assert SnapshotStore(run).committed_steps() == [2]  # 4 was quarantined
    _assert_bitwise(os.path.join(out, "got.safetensors"),
                    os.path.join(run, "ref-2.safetensors"))


def _restore_fsdp(rank: int, world_size: int, run: str, out: str) -> None:
    """Restore the FSDP2 snapshot twice: with the group, and each rank alone (the read
    ``read_tensors`` does without a group), counting the bytes of both."""
    ts = build(seed=99, layout="fsdp", world_size=world_size)
    result = {}
    for mode in ("alone", "group"):
        store = SnapshotStore(run)
        (step,) = store.committed_steps()
        manifest = store.load_manifest(step)
        targets = plan_targets(manifest, ts.registry.flatten().tensors)
        source = ByteSource(store, step)
        before = store.stats.bytes_read
        read = group_read_tensors if mode == "group" else read_tensors
        tensors = read(manifest, targets, source)
        headers = _header_bytes(manifest, set(source.headers))
        assert store.stats.bytes_read - before == source.bytes_into
        result[mode] = source.bytes_into - headers
        result["needed"] = sum(t.piece.nbytes for t in targets.values())
        if mode == "group":
            ts.registry.load(tensors, manifest.state)
    got = full_state(ts)
    dist.barrier()
    if rank == 0:
        save_file(got, os.path.join(out, "got.safetensors"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)


def test_fsdp_restore_from_two_to_four_reads_at_most_1_1x_what_it_needs(tmp_path) -> None:
    """With the default 4 MiB checksum blocks every TinyNet chunk is one block, the worst
    case: a rank needing half a chunk alone reads all of it (2x). The group reads each
    block once."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out")
    os.makedirs(out)
    run_group(_save, 2, run, "fsdp", (3,), 4 << 20, tmp_dir=str(tmp_path))
    run_group(_restore_fsdp, 4, run, out, tmp_dir=str(tmp_path))
    results = _results(out, 4)
    needed = sum(r["needed"] for r in results)
    group = sum(r["group"] for r in results)
    alone = sum(r["alone"] for r in results)
    print(f"FSDP2 W=2 -> W'=4: needed {needed} B; read by the group {group} B "
          f"({group / needed:.2f}x), by each rank alone {alone} B ({alone / needed:.2f}x)")
    assert group <= 1.1 * needed
    assert alone > 1.5 * needed  # what the group saves here (the issue measured 1.9x)
    _assert_bitwise(os.path.join(out, "got.safetensors"),
                    os.path.join(run, "ref-3.safetensors"))


def test_s3_restore_reads_merge_holes_only_up_to_a_sixteenth() -> None:
    """On S3 a restore's ranges are merged into few requests, but the holes read with them
    stay within 1/16 of what is wanted: a rank that needs every other half-chunk of a file
    does not read the other halves (the data loader's merge, without the bound, would)."""
    halves = [(i * 2000, i * 2000 + 1000) for i in range(8)]
    assert len(merge_ranges(halves, hole_limit=MERGE_HOLE_BYTES)) == 1
    spans = merge_ranges(halves, hole_limit=MERGE_HOLE_BYTES, max_waste=READ_INTO_MAX_WASTE)
    assert [members for _, _, members in spans] == [[i] for i in range(8)]
    close = [(0, 1000), (1010, 2000), (2030, 3000), (3100, 4000)]  # holes 10, 30, 100
    spans = merge_ranges(close, hole_limit=MERGE_HOLE_BYTES, max_waste=READ_INTO_MAX_WASTE)
    assert [members for _, _, members in spans] == [[0, 1, 2, 3]]  # 140 <= 3860 / 16
    spans = merge_ranges(close, hole_limit=MERGE_HOLE_BYTES, max_waste=1 / 100)
    assert [members for _, _, members in spans] == [[0, 1], [2], [3]]  # 10 <= 1990 / 100


def _settle_rank(rank: int, world_size: int, case: str, out: str) -> None:
    from elastic.errors import SnapshotIntegrityError
    from elastic.read import group_read

    errors: dict[int, Exception] = (
        {0: TimeoutError()} if case == "empty message"  # str() == "": a bare deadline
        else {0: RuntimeError("boom"), 1: SnapshotIntegrityError("bad crc in block 3")})
    try:
        group_read._settle(errors.get(rank), 5, "reading")
        raised = "nothing"
    except Exception as err:  # noqa: BLE001 - what each rank raises is the result
        raised = type(err).__name__
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(raised, fh)


@pytest.mark.parametrize(("case", "agreed"), [("empty message", "StorageUnavailableError"),
                                              ("mixed kinds", "RuntimeError")])
def test_every_rank_raises_the_agreed_failure(tmp_path, case: str, agreed: str) -> None:
    # The ranks of a group restore take one path together: a failure without a message,
    # or failures of different kinds on different ranks, must not split them (some leaving
    # the restore, others waiting in the next collective for them).
    out = str(tmp_path)
    run_group(_settle_rank, 3, case, out, tmp_dir=out)
    raised = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(3)]
    if case == "empty message":  # the failing rank keeps its own error, of the agreed kind
        assert raised[0] == "TimeoutError" and raised[1:] == [agreed, agreed]
    else:
        assert raised == [agreed] * 3


def _restore_out_of_memory(rank: int, world_size: int, run: str, out: str) -> None:
    """Restore at ``world_size`` where rank 1 cannot allocate the exchange's buffers."""
    if rank == 1:
        class _NoMemory:  # group_read's torch, but every allocation there fails
            def __getattr__(self, name: str) -> Any:
                return getattr(torch, name)

            @staticmethod
            def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
                raise RuntimeError("CUDA out of memory. Tried to allocate 64.00 MiB")

        group_read_module.torch = _NoMemory()  # type: ignore[assignment]  # this process only
    ts = build(seed=99, layout="ddp", world_size=world_size)
    snap = Snapshotter(run, ts.registry, rank, world_size,
                       settings=SnapshotSettings(layout="ddp", snapshot_every=10**6))
    try:
        snap.restore()
        raised = ["nothing", ""]
    except Exception as err:  # noqa: BLE001 - what each rank raises is the result
        raised = [type(err).__name__, str(err)]
    snap.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(raised, fh)


def test_an_allocation_failure_in_the_exchange_is_agreed_not_waited_for(tmp_path) -> None:
    """Rank 1 runs out of memory for the buffers that carry shared blocks: every rank
    raises together (rank 1 its own error, the others naming it) instead of the others
    waiting in the exchange's first collective; the snapshot is not judged corrupt."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out")
    os.makedirs(out)
    run_group(_save, 2, run, "ddp", (3,), BLOCK, tmp_dir=str(tmp_path))
    run_group(_restore_out_of_memory, 3, run, out, tmp_dir=str(tmp_path))
    raised = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(3)]
    assert [kind for kind, _ in raised] == ["RestoreMemoryError"] * 3, raised
    assert "cannot allocate the buffers" in raised[1][1] and "out of memory" in raised[1][1]
    for r in (0, 2):
        assert "rank 1 failed while reading its own blocks" in raised[r][1], raised[r]
        assert "out of memory" in raised[r][1], raised[r]
    assert SnapshotStore(run).committed_steps() == [3]  # not quarantined


# ------------------------------------------------------------------ ranks skip together


def _skip_when_one_rank_is_busy(rank: int, world_size: int, run: str, out: str) -> None:
    ts = build(seed=7, layout="ddp", world_size=world_size)
    snap = Snapshotter(run, ts.registry, rank, world_size,
                       settings=SnapshotSettings(layout="ddp", snapshot_every=2, durable=False))
    snap.persister.busy = lambda: rank == 1  # type: ignore[method-assign]  # rank 1 only
    for step in (1, 2):
        train_step(ts, step)
        snap.after_step(step)
    skipped = list(snap.skipped)
    snap.persister.busy = lambda: False  # type: ignore[method-assign]
    for step in (3, 4):
        train_step(ts, step)
        snap.after_step(step)
    snap.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(skipped, fh)


def test_a_snapshot_is_skipped_by_every_rank_or_none(tmp_path) -> None:
    """Rank 1 is still persisting at step 2, rank 0 is not: both skip step 2 (a step one rank
    skipped could never commit), and step 4, when neither is busy, commits."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out")
    os.makedirs(out)
    run_group(_skip_when_one_rank_is_busy, 2, run, out, tmp_dir=str(tmp_path))
    assert [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)] == [[2], [2]]
    assert SnapshotStore(run).committed_steps() == [4]
