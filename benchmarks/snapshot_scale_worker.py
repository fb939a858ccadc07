"""The fresh process of `benchmarks/snapshot_scale.py`: a restarted worker's restore.

    python -m benchmarks.snapshot_scale_worker restore '{"mode": "baton"|"torch", "size": GB,
                                                         "dir": WORKDIR}'

It builds the model and optimizer of `size`, materialises the optimizer's state with one
training step (a process that holds its training state, no gradients), then restores the
newest snapshot of WORKDIR/run (Baton) or WORKDIR/state-STEP.pt (torch.load +
load_state_dict). Prints {growth, peak, seconds}: the peak RSS above the RSS before the restore
and the peak RSS, both over the state's size, and the restore's seconds.
"""

from __future__ import annotations

import os
import time
from typing import Any

from benchmarks.common import reset_peak_rss, status_bytes, worker_main
from benchmarks.snapshot_scale_sides import (
    baton_restore,
    build,
    state_bytes,
    torch_restore,
    train_step,
)
from elastic.store import SnapshotStore


def restore(payload: dict[str, Any]) -> dict[str, float]:
    mode, size, workdir = payload["mode"], float(payload["size"]), payload["dir"]
    model, optim, registry = build(size)
    # A fresh optimizer has no state: one step materialises it; then free the gradients, as
    # a restarted worker has none.
    train_step(model, optim, 1)
    optim.zero_grad(set_to_none=True)
    nbytes = state_bytes(registry)
    reset_peak_rss()  # building the model peaked higher than it holds now
    before = status_bytes("VmRSS")
    store = SnapshotStore(os.path.join(workdir, "run"))
    step = max(store.committed_steps())
    start = time.perf_counter()
    if mode == "baton":
        baton_restore(registry, store, step)
    else:
        torch_restore(model, optim, os.path.join(workdir, f"state-{step}.pt"))
    seconds = time.perf_counter() - start
    peak = status_bytes("VmHWM")
    return {"growth": (peak - before) / nbytes, "peak": peak / nbytes, "seconds": seconds}


if __name__ == "__main__":
    raise SystemExit(worker_main({"restore": restore}))
