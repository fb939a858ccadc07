"""Round trip and resharding matrix: save at W in {1,2,3}, load at W' in {1,2,3,4},
DDP and FSDP2 in both directions, on real gloo process groups.

One process group per save world size saves both layouts; one group per load world size
restores every saved snapshot into both layouts and compares, on rank 0, every logical
tensor, moment and step counter bitwise with the saver's gathered state, then trains on and
compares with the saver's uninterrupted continuation (bitwise when the layout and world
size are the same; else within float-averaging rounding, since all ranks see equal batches).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.testing import build, full_state, json_state, run_group, train_step

SNAP_STEP = 3
CONT_STEPS = 2
LAYOUTS = ("ddp", "fsdp")


def save_worker(rank: int, world_size: int, root: str) -> None:
    for layout in LAYOUTS:
        ts = build(seed=7, layout=layout, world_size=world_size)
        run = os.path.join(root, f"{layout}-w{world_size}")
        snap = Snapshotter(run, ts.registry, rank, world_size,
                           settings=SnapshotSettings(layout=layout, snapshot_every=SNAP_STEP,
                                                     split_min_bytes=64, durable=False))
        ref = js = None
        # Pipelined capture: the copy of step 3 overlaps step 4's forward/backward.
        for step in range(1, SNAP_STEP + CONT_STEPS + 1):
            train_step(ts, step, before_update=snap.wait_capture)
            if step == SNAP_STEP:
                ref, js = full_state(ts), json_state(ts)
            snap.begin_capture_if_due(step)
        snap.close()
        dist.barrier()
        cont = full_state(ts)
        if rank == 0:
            save_file(ref, os.path.join(run, "ref.safetensors"))
            save_file(cont, os.path.join(run, "cont.safetensors"))
            with open(os.path.join(run, "ref.json"), "w") as fh:
                json.dump(js, fh)


def load_worker(rank: int, world_size: int, runs: list[str]) -> None:
    for run in runs:
        saved_layout, saved_w = os.path.basename(run).split("-w")
        for layout in LAYOUTS:
            ts = build(seed=99, layout=layout, world_size=world_size)
            snap = Snapshotter(run, ts.registry, rank, world_size,
                               settings=SnapshotSettings(layout=layout, snapshot_every=10**6))
            assert snap.restore() == SNAP_STEP
            got, js = full_state(ts), json_state(ts)
            for step in range(SNAP_STEP + 1, SNAP_STEP + CONT_STEPS + 1):
                train_step(ts, step)
            cont = full_state(ts)
            snap.close()
            if rank != 0:
                continue
            where = f"{run} -> {layout} x{world_size}"
            ref = load_file(os.path.join(run, "ref.safetensors"))
            assert sorted(got) == sorted(ref), where
            for key, value in ref.items():
                assert got[key].dtype == value.dtype and torch.equal(got[key], value), (
                    f"{where}: {key} differs after restore"
                )
            with open(os.path.join(run, "ref.json")) as fh:
                assert js == json.load(fh), where
            want = load_file(os.path.join(run, "cont.safetensors"))
            same = saved_layout == layout and int(saved_w) == world_size
            for key, value in want.items():
                if same:
                    assert torch.equal(cont[key], value), f"{where}: {key} diverged"
                else:
                    torch.testing.assert_close(
                        cont[key], value, rtol=1e-5, atol=1e-6, msg=f"{where}: {key} diverged"
                    )


def _matrix(tmp_path, save_sizes: list[int], load_sizes: list[int]) -> None:
    root = str(tmp_path / "runs")
    os.makedirs(root)
    for w in save_sizes:
        run_group(save_worker, w, root, tmp_dir=str(tmp_path))
    runs = sorted(os.path.join(root, d) for d in os.listdir(root))
    assert len(runs) == 2 * len(save_sizes)
    for w in load_sizes:
        run_group(load_worker, w, runs, tmp_dir=str(tmp_path))


def test_reshard_fast_subset(tmp_path) -> None:
    """Save at 2 (DDP and FSDP2), load at 3 and 1, both layouts."""
    _matrix(tmp_path, [2], [3, 1])


@pytest.mark.slow
def test_reshard_full_matrix(tmp_path) -> None:
    _matrix(tmp_path, [1, 2, 3], [1, 2, 3, 4])
