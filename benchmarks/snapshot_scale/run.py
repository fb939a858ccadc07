"""What a snapshot costs at real sizes: Baton against torch.save / torch.load / DCP, side by side.

For GPT + AdamW states of about 0.37, 1.4 and 3.4 GB (``--sizes 0.3,1.2,3``), one process per size
measures, in ``--rounds`` rounds cycling through every order of the sides (a multiple of 6 for the
three writers; see ``common.in_every_order``):
- blocking capture (``Snapshotter.after_step``: the floor of the pipelined form) against
  ``torch.save`` + ``fsync`` and the time ``dcp.async_save`` takes to return;
- background persist (from the capture's end until the persist thread is done: RAM copy, crc32,
  write + fsync, receipt, commit) against the same, ``dcp.async_save`` until its future is done;
- restore from local disk and from the RAM tier (Snapshotter.restore's data path) against
  ``torch.load`` + ``load_state_dict``, all from the page cache;
- S3 (``s3.py``: a moto server in a subprocess, ``--s3-max`` GB and below): Baton's persist and
  restore against ``torch.save`` + boto3's managed upload and its download + ``torch.load``;
- the bytes the coordinator handles per snapshot (receipts and manifest; RAM copies never go to it).

Every side keeps two snapshots, as for real, after three warm-ups; a ratio is Baton's time over the
baseline's in one round (median and range printed). A restore's peak memory and time in fresh
processes (``worker.py``, ``--fresh-rounds`` per side) is a restarted worker's case;
``--fresh-only`` (``fresh.py``) measures it alone, with ``--optimizer fresh`` (no optimizer state
yet) or ``--busy`` (a process writing and fsyncing beside it). ``project`` (``report.py``): the
largest size's rates at 7B and 70B on 16 and 128 workers.

    python -m benchmarks.snapshot_scale.run                         # 0.3 and 1.2 GB, 6 rounds
    python -m benchmarks.snapshot_scale.run --sizes 3 --s3-max 0    # 3.4 GB (needs ~18 GB RAM)
    # results are merged, size by size, into benchmarks/results/snapshot_scale.json
    python -m benchmarks.snapshot_scale.run --sizes 0.3,1.2,3 --fresh-only --fresh-rounds 8 --busy
    # into benchmarks/results/snapshot_scale_fresh.json

Absolute times on the small shared machine move by tens of percent between runs; the ratios,
measured back to back, much less. Method: benchmarks/reports/2026-12-05-snapshot-scale.md.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS,
    arg_parser,
    in_every_order,
    read_json,
    timed,
    write_json,
)
from benchmarks.snapshot_scale.fresh import fresh_children, fresh_only
from benchmarks.snapshot_scale.report import print_tables, project, summarise
from benchmarks.snapshot_scale.s3 import measure_s3
from benchmarks.snapshot_scale.sides import (
    SHAPES,
    baton_restore,
    build,
    dcp_save,
    state_bytes,
    torch_restore,
    torch_save,
    train_step,
)
from elastic.coord.receipts import Receipt
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.store.snapshot_store import SnapshotStore


def count_coordinator_bytes(snap: Snapshotter) -> list[int]:
    """Wrap the coordinator's ``report_shard``: the JSON bytes of every receipt it gets."""
    sizes: list[int] = []
    report = snap.coordinator.report_shard

    def counted(receipt: Receipt) -> Any:
        sizes.append(len(json.dumps(receipt.to_json())))
        return report(receipt)

    snap.coordinator.report_shard = counted  # type: ignore[method-assign]
    return sizes



def _warm_up(snap: Snapshotter, model: Any, optim: Any, workdir: str) -> None:
    """Steady state: the capture image and the recycled RAM-tier buffers exist (the first two
    snapshots allocate them), Baton's retention has retired one snapshot (its files are the
    spares the next persist overwrites), and torch.save and DCP have written before; every
    side keeps two."""
    warm: dict[str, list[float]] = {k: [] for k in ("dcp_return", "dcp_done")}
    for step in (2, 3, 4):
        train_step(model, optim, step)
        snap.after_step(step, force=True)
        snap.persister.wait()
        snap.coordinator.flush(0)
        torch_save(model, optim, os.path.join(workdir, f"state-{step}.pt"))
        dcp_save(model, optim, os.path.join(workdir, f"dcp-{step}"), warm)
    os.remove(os.path.join(workdir, "state-2.pt"))
    shutil.rmtree(os.path.join(workdir, "dcp-2"))


def measure(size: float, rounds: int, workdir: str) -> dict[str, Any]:
    model, optim, registry = build(size)
    train_step(model, optim, 1)
    nbytes = state_bytes(registry)
    run = os.path.join(workdir, "run")
    snap = Snapshotter(run, registry, settings=SnapshotSettings(keep_last=2))
    receipts = count_coordinator_bytes(snap)
    store = SnapshotStore(run)
    rows: dict[str, list[float]] = {k: [] for k in (
        "capture", "persist", "save", "dcp_return", "dcp_done", "restore_disk", "restore_ram",
        "load")}
    _warm_up(snap, model, optim, workdir)
    receipts.clear()
    for r in range(rounds):
        step = r + 5
        train_step(model, optim, step)
        # Each side as it runs for real, keeping the two newest (keep_last=2): torch.save and
        # DCP write new files and delete the one before last; Baton's commit retires its
        # snapshot before last, and the next persist overwrites those files (spares,
        # elastic/storage/spares.py: crash-safe, temp + fsync + rename). Every side removes its old
        # files at the same point: right after its own write, untimed, not at the start of
        # the round.
        path = os.path.join(workdir, f"state-{step}.pt")

        def baton_save(step: int = step) -> None:
            rows["capture"].append(timed(lambda: snap.after_step(step, force=True)))
            rows["persist"].append(timed(snap.persister.wait))
            # The commit hands the deletion of the snapshot before last to the coordinator's
            # housekeeping thread; let it finish untimed, so it does not run into the next
            # measurement.
            snap.coordinator.flush(0)

        def baseline_save(path: str = path, step: int = step) -> None:
            rows["save"].append(timed(lambda: torch_save(model, optim, path)))
            os.remove(os.path.join(workdir, f"state-{step - 2}.pt"))

        def dcp_baseline(step: int = step) -> None:
            dcp_save(model, optim, os.path.join(workdir, f"dcp-{step}"), rows)
            shutil.rmtree(os.path.join(workdir, f"dcp-{step - 2}"))

        # Every order, not turns: on this machine (a VM whose host takes back the memory it
        # frees) how fast a write into the page cache goes depends on what ran just before it,
        # and in turns one order repeats every third round (persist measured 0.7-1.2 s in
        # every round in which it followed torch.save then DCP, 0.2-0.3 s in the others).
        in_every_order([baton_save, baseline_save, dcp_baseline], r)
        assert snap.persister.last_error is None, snap.persister.last_error
        assert step in snap.coordinator.committed_steps()

        def restores(step: int = step) -> None:
            rows["restore_disk"].append(timed(lambda: baton_restore(registry, store, step)))
            assert snap.ram_tier is not None
            ram = functools.partial(snap.ram_tier.read, step,
                                    snap.coordinator.ram_locations(step))
            from_ram: list[bool] = []
            rows["restore_ram"].append(timed(
                lambda: from_ram.append(baton_restore(registry, store, step, ram))))
            assert from_ram == [True], "the RAM tier did not serve the restore"

        def baseline_load(path: str = path) -> None:
            rows["load"].append(timed(lambda: torch_restore(model, optim, path)))

        in_every_order([restores, baseline_load], r)
    meta = _coordinator_meta(store, rounds + 4, receipts)
    snap.close()
    assert receipts, "the coordinator was sent no receipt"
    return {"state_bytes": nbytes, "times": rows, "coordinator_bytes": meta}


def _coordinator_meta(store: SnapshotStore, step: int, receipts: list[int]) -> dict[str, Any]:
    """The coordinator's bytes per snapshot (receipts, manifest) and what they scale with."""
    manifest = store.load_manifest(step)
    chunks = [c for rec in manifest.tensors.values() for c in rec.chunks]
    return {"receipts_per_snapshot": statistics.median(receipts),
            "manifest": os.path.getsize(store.step_path(step, "manifest.json")),
            "chunks": len(chunks), "blocks": sum(len(c.crc32) for c in chunks),
            "block_bytes": manifest.block_bytes}


def main() -> None:
    parser = arg_parser(__doc__, __spec__)
    parser.add_argument("--sizes", default="0.3,1.2", help="state sizes in GB: 0.3, 1.2, 3")
    parser.add_argument("--rounds", type=int, default=6,
                        help="rounds per size; a multiple of 6 balances the writers' orders")
    parser.add_argument("--fresh-rounds", type=int, default=4,
                        help="restores in fresh processes per side (alternating)")
    parser.add_argument("--s3-rounds", type=int, default=2)
    parser.add_argument("--s3-max", type=float, default=1.2,
                        help="measure S3 (moto) for sizes up to this (0: never)")
    parser.add_argument("--out", default=str(RESULTS / "snapshot_scale.json"))
    parser.add_argument("--fresh-only", action="store_true",
                        help="only the restores in fresh processes (--fresh-rounds per side); "
                        "prints the ratios and RSS growths, merged into --fresh-out")
    parser.add_argument("--fresh-out", type=Path, default=RESULTS / "snapshot_scale_fresh.json")
    parser.add_argument("--optimizer", choices=("stepped", "fresh"), default="stepped",
                        help="--fresh-only: the restoring process holds its optimizer state "
                        "(stepped) or has none yet (fresh, a restarted worker's)")
    parser.add_argument("--busy", action="store_true",
                        help="--fresh-only: a second process writes files meanwhile")
    args = parser.parse_args()
    sizes = [min(SHAPES, key=lambda s: abs(s - float(size))) for size in args.sizes.split(",")]
    if args.fresh_only:
        for size in sizes:
            fresh_only(size, args.fresh_rounds, args.optimizer, args.busy, args.fresh_out)
        return
    results: dict[str, Any] = read_json(args.out)
    results.pop("projection", None)
    results = {k: v for k, v in results.items() if "gb_per_s" in v}  # older layouts
    for size in sizes:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BATON_BENCH_DIR")) as workdir:
            got = measure(size, args.rounds, workdir)
            rss = fresh_children(size, workdir, args.fresh_rounds)
        s3 = measure_s3(size, args.s3_rounds) if size <= args.s3_max else None
        results[f"{size:g}"] = summarise(got, rss, s3)
        print(f"[{size:g} GB done]", file=sys.stderr, flush=True)
    results = dict(sorted(results.items(), key=lambda kv: float(kv[0])))
    results["projection"] = project(results)
    write_json(Path(args.out), results)
    print_tables(results)


if __name__ == "__main__":
    main()
