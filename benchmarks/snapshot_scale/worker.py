"""The fresh processes of `benchmarks/snapshot_scale/run.py`: a restarted worker's restore, and a
second process that keeps the machine busy.

    python -m benchmarks.snapshot_scale.worker restore '{"mode": "baton"|"torch", "size": GB,
                                                         "dir": WORKDIR,
                                                         "optimizer": "stepped"|"fresh"}'
    python -m benchmarks.snapshot_scale.worker busy '{"dir": WORKDIR}'

`restore` builds the model and optimizer of `size`; with "stepped" (the default) it
materialises the optimizer's state with one training step (a process that holds its training
state, no gradients), with "fresh" it leaves the optimizer without state (a restarted
worker's). Then it restores the newest snapshot of WORKDIR/run (Baton, in place) or
WORKDIR/state-STEP.pt (torch.load + load_state_dict). Prints {growth, peak, seconds}: the
peak RSS above the RSS before the restore and the peak RSS, both over the snapshot's size,
and the restore's seconds.

`busy` writes and fsyncs a 256 MiB file in WORKDIR again and again, until it is stopped
(another worker persisting on the same machine); it never returns.
"""

from __future__ import annotations

import os
import time
from typing import Any

from benchmarks.common import reset_peak_rss, status_bytes, worker_main
from benchmarks.snapshot_scale.sides import baton_restore, build, torch_restore, train_step
from elastic.store.snapshot_store import SnapshotStore

BUSY_FILE_BYTES, BUSY_WRITE_BYTES = 256 << 20, 8 << 20


def restore(payload: dict[str, Any]) -> dict[str, float]:
    mode, size, workdir = payload["mode"], float(payload["size"]), payload["dir"]
    model, optim, registry = build(size)
    if payload.get("optimizer", "stepped") == "stepped":
        # One step materialises the optimizer's state; then free the gradients, as a
        # restarted worker has none.
        train_step(model, optim, 1)
        optim.zero_grad(set_to_none=True)
    store = SnapshotStore(os.path.join(workdir, "run"))
    step = max(store.committed_steps())
    nbytes = store.load_manifest(step).nbytes()
    reset_peak_rss()  # building the model peaked higher than it holds now
    before = status_bytes("VmRSS")
    start = time.perf_counter()
    if mode == "baton":
        baton_restore(registry, store, step)
    else:
        torch_restore(model, optim, os.path.join(workdir, f"state-{step}.pt"))
    seconds = time.perf_counter() - start
    peak = status_bytes("VmHWM")
    return {"growth": (peak - before) / nbytes, "peak": peak / nbytes, "seconds": seconds}


def busy(payload: dict[str, Any]) -> None:
    chunk = os.urandom(BUSY_WRITE_BYTES)
    path = os.path.join(payload["dir"], "busy.bin")
    while True:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(BUSY_FILE_BYTES // BUSY_WRITE_BYTES):
                os.write(fd, chunk)
            os.fsync(fd)
        finally:
            os.close(fd)


if __name__ == "__main__":
    raise SystemExit(worker_main({"restore": restore, "busy": busy}))
