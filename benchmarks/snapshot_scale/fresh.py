"""The restarted worker's restore of `benchmarks/snapshot_scale/run.py`: one restore per fresh
process, Baton's against torch.load + load_state_dict, alternating, on a quiet or a busy
machine.

Contract:
- `fresh_children(size, workdir, rounds, optimizer=..., busy=...)`: `rounds` restores per
  side in fresh processes (`snapshot_scale.worker restore`), alternating (ABBA): Baton's of
  WORKDIR/run's newest snapshot against torch.load + load_state_dict of WORKDIR/state-STEP.pt.
  `optimizer`: "stepped" (the process holds its optimizer state before it restores, as the
  benchmark always measured) or "fresh" (a restarted worker's optimizer: no state yet). With
  `busy`, a second process writes and fsyncs files beside the snapshot the whole time
  (`busy_writer`). Returns per side the growth and peak of the first run (the full run's
  table) and of every run (`growth_all`, `peak_all`), and every run's seconds.
- `fresh_only(size, rounds, optimizer, busy, out)`: one snapshot and one torch.save of the
  same state, then `fresh_children`; prints the time ratio and the RSS growths (median and
  range) and merges them into `out` under "SIZE/optimizer/quiet|busy".
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import (
    alternating,
    ratios,
    read_json,
    spread,
    start_worker,
    utc_now,
    worker_result,
    write_json,
)
from benchmarks.snapshot_scale.sides import build, state_bytes, torch_save, train_step
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter


@contextlib.contextmanager
def busy_writer(workdir: str) -> Iterator[None]:
    """A second process that writes and fsyncs 256 MiB files in `workdir` until the block
    ends (another worker persisting on the same machine): it takes a core and the disk."""
    proc = start_worker("snapshot_scale.worker", "busy", json.dumps({"dir": workdir}),
                        capture_stdout=False)
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def fresh_children(size: float, workdir: str, rounds: int, *, optimizer: str = "stepped",
                   busy: bool = False) -> dict[str, Any]:
    """Restore in fresh processes, each side `rounds` times, alternating (module contract)."""
    got: dict[str, list[dict[str, float]]] = {"baton": [], "torch": []}
    with busy_writer(workdir) if busy else contextlib.nullcontext():
        for r in range(rounds):
            for mode in alternating(("baton", "torch"), r):
                payload = json.dumps({"mode": mode, "size": size, "dir": workdir,
                                      "optimizer": optimizer})
                proc = start_worker("snapshot_scale.worker", "restore", payload,
                                    capture_stderr=True)
                got[mode].append(worker_result(proc, f"{mode} restore in a fresh process"))
    rss: dict[str, Any] = {mode: {
        "growth": runs[0]["growth"], "peak": runs[0]["peak"],
        "growth_all": [run["growth"] for run in runs],
        "peak_all": [run["peak"] for run in runs]} for mode, runs in got.items()}
    rss["fresh_restore_s"] = {mode: [run["seconds"] for run in runs]
                              for mode, runs in got.items()}
    return rss


def save_both(size: float, workdir: str) -> int:
    """One snapshot and one torch.save of the same state into `workdir`; the state bytes.
    Everything it built is dropped on return: while the children restore, this process
    holds no model, capture image or RAM-tier copy (at 3.4 GB they would crowd the files
    the children read out of the page cache)."""
    model, optim, registry = build(size)
    train_step(model, optim, 1)
    snap = Snapshotter(os.path.join(workdir, "run"), registry,
                       settings=SnapshotSettings(keep_last=2))
    snap.after_step(2, force=True)
    snap.persister.wait()
    snap.close()
    torch_save(model, optim, os.path.join(workdir, "state-2.pt"))
    return state_bytes(registry)


def fresh_only(size: float, rounds: int, optimizer: str, busy: bool, out: Path) -> None:
    """One snapshot and one torch.save, then `fresh_children`; print and merge into `out`."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("BATON_BENCH_DIR")) as workdir:
        nbytes = save_both(size, workdir)
        gc.collect()  # this process's copies of the state are gone before the children run
        load = os.getloadavg()[0]
        rss = fresh_children(size, workdir, rounds, optimizer=optimizer, busy=busy)
        load = max(load, os.getloadavg()[0])
    seconds = rss.pop("fresh_restore_s")
    r = ratios(seconds["baton"], seconds["torch"])
    below = sum(a < b for a, b in zip(seconds["baton"], seconds["torch"], strict=True))
    growth = {mode: spread(rss[mode]["growth_all"]) for mode in ("baton", "torch")}
    print(f"{nbytes / 1e9:.2f} GB, optimizer {optimizer}, {'busy' if busy else 'quiet'}: "
          f"restore in a fresh process / torch.load + load_state_dict: {r['median']:.2f}x "
          f"({r['min']:.2f}-{r['max']:.2f}), Baton faster in {below} of {rounds} rounds; "
          f"medians {statistics.median(seconds['baton']):.3f} s / "
          f"{statistics.median(seconds['torch']):.3f} s; RSS growth / state: Baton "
          f"{growth['baton']['median']:.2f}x ({growth['baton']['min']:.2f}-"
          f"{growth['baton']['max']:.2f}), torch {growth['torch']['median']:.2f}x "
          f"({growth['torch']['min']:.2f}-{growth['torch']['max']:.2f})", flush=True)
    results = read_json(out)
    results[f"{size:g}/{optimizer}/{'busy' if busy else 'quiet'}"] = {
        "state_gb": nbytes / 1e9, "rounds": rounds, "date_utc": utc_now(),
        "load_average_max": load, "seconds": seconds, "ratio": r, "growth": growth,
        "growth_vs_torch": ratios(rss["baton"]["growth_all"], rss["torch"]["growth_all"]),
        "peak": {mode: spread(rss[mode]["peak_all"]) for mode in ("baton", "torch")}}
    write_json(out, results)
