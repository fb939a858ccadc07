"""What a snapshot costs at real sizes: Baton against torch.save / torch.load / DCP, side by side.

For GPT + AdamW states of about 0.37, 1.4 and 3.4 GB (``--sizes 0.3,1.2,3``), one process
per size measures, in ``--rounds`` rounds that cycle through every order of the sides (use a
multiple of 6 for the three writers; see ``rotate``):

- blocking capture: ``Snapshotter.after_step`` (the copy into the reused capture image; with
  the pipelined form it overlaps forward/backward, this is its floor), against ``torch.save``
  + ``fsync`` of the same state dicts and against the time ``dcp.async_save`` takes to return;
- background persist: from the end of the capture until the persist thread is done (the RAM
  copy into the in-process RAM tier's store, crc32 of every block, write + fsync, receipt,
  commit), against ``torch.save`` + ``fsync`` and against ``dcp.async_save`` until its future
  is done (DCP's file writer fsyncs too);
- restore from local disk and from the RAM tier (``read_tensors`` + ``StateRegistry.load``:
  Snapshotter.restore's data path), against ``torch.load`` + ``load_state_dict`` of the file
  torch.save wrote. Files were just written, so every side reads from the page cache.
- S3 (a moto server in a subprocess on this machine, ``--s3-max`` GB and below): persist
  (multipart upload) and restore of a Baton snapshot against ``torch.save`` into memory +
  boto3's managed upload (multipart, 10 threads) and its download + ``torch.load``.
- the bytes the coordinator handles per snapshot: the receipts it is sent (JSON) and the
  manifest it writes. RAM copies go to the RAM tier's stores (peers on a cluster), never to
  the coordinator.

Every side keeps two snapshots, as it does for real: torch.save and DCP write a new file (or
directory) per snapshot, Baton overwrites the files of the snapshot its retention retired
(``elastic/spares.py``; from the fourth snapshot on). Three warm-up snapshots come first
(Baton's capture image and RAM-tier buffers are allocated by the first two and reused after,
the third's commit leaves the first's files as spares). Each ratio is Baton's time over the
baseline's in the same round: the median
and range over the rounds are printed. Peak memory of a restore is measured in fresh
processes (one per case), which build the model and optimizer, materialise the optimizer's
state with one training step (a process that holds its training state, no gradients), then
restore: ``growth`` is the peak RSS
above the RSS before the restore, ``peak`` the peak RSS, both divided by the state's size.
The restore's time in such fresh processes (``--fresh-rounds`` per side, alternating) is
the restarted worker's case, where every page the restore fills is new; in the long-lived
process above, freed memory is partly recycled by the allocator.

From the measured rates of the largest size, ``project`` estimates 7B and 70B models (AdamW
fp32: 16 bytes per parameter) on 16 and 128 workers (8 per node, FSDP-sharded state): the
head's bytes and RAM per snapshot (metadata only), time per snapshot, and the restore after
one node loss (the lost node's RAM-tier copies come from storage, the rest from peers).

    python benchmarks/snapshot_scale.py                         # 0.3 and 1.2 GB, 6 rounds
    python benchmarks/snapshot_scale.py --sizes 3 --s3-max 0    # 3.4 GB (needs ~18 GB RAM)
    # results are merged, size by size, into benchmarks/results/snapshot_scale.json

The machine is small and shared: absolute times move by tens of percent between runs; the
ratios, measured back to back, much less.
"""

from __future__ import annotations

import argparse
import functools
import gc
import io
import itertools
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic.registry import StateRegistry  # noqa: E402
from elastic.restore import (  # noqa: E402
    ByteSource,
    check_compatible,
    collector_paused,
    plan_targets,
    read_tensors,
)
from elastic.snapshotter import Snapshotter  # noqa: E402
from elastic.store import SnapshotStore  # noqa: E402
from trainer.config import ModelConfig  # noqa: E402
from trainer.model import GPT  # noqa: E402

# GPT shapes whose fp32 parameters + AdamW moments come to about the named size.
SHAPES = {0.3: (512, 7), 1.2: (1024, 8), 3.0: (1536, 9)}
VOCAB, SEQ = 8192, 32
# The projection's cluster: workers per node, and the models: parameters and parameter
# tensors (Llama-2 7B: 32 layers of 9 tensors + 3; 70B: 80 layers + 3).
WORKERS_PER_NODE = 8
MODELS = {"7B": (7e9, 32 * 9 + 3), "70B": (70e9, 80 * 9 + 3)}
# A crc32 costs about this much metadata: ~12 bytes of JSON in a receipt, ~20 in the
# indented manifest.
META_PER_BLOCK = 32
BYTES_PER_PARAM = 16  # AdamW with fp32 state, as the issue counts it (7B -> 112 GB)


def build(size: float) -> tuple[GPT, torch.optim.Optimizer, StateRegistry]:
    d_model, n_layers = SHAPES[size]
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=VOCAB, d_model=d_model, n_layers=n_layers,
                            n_heads=8), seq_len=SEQ)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    registry = StateRegistry()
    registry.register("model", model)
    registry.register("optim", optim)
    return model, optim, registry


def train_step(model: GPT, optim: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    optim.zero_grad(set_to_none=True)
    model.loss(torch.randint(0, VOCAB, (1, SEQ), generator=gen)).backward()
    optim.step()


def state_bytes(registry: StateRegistry) -> int:
    return sum(t.numel() * t.element_size() for t in registry.flatten().tensors.values())


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save(model: GPT, optim: torch.optim.Optimizer, path: str) -> None:
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, path)
    fsync_file(path)


def torch_restore(model: GPT, optim: torch.optim.Optimizer, source: Any) -> None:
    saved = torch.load(source, weights_only=True)
    model.load_state_dict(saved["model"])
    optim.load_state_dict(saved["optim"])


def dcp_save(model: GPT, optim: torch.optim.Optimizer, directory: str,
             rows: dict[str, list[float]]) -> None:
    """``dcp.async_save`` as a DCP user calls it: the time until it returns (the stall) and
    until its future is done (written and fsynced)."""
    start = time.perf_counter()
    msd, osd = get_state_dict(model, optim)
    future = cast("Future[Any]", dcp.async_save({"model": msd, "optim": osd},
                                               checkpoint_id=directory))
    rows["dcp_return"].append(time.perf_counter() - start)
    future.result()
    rows["dcp_done"].append(time.perf_counter() - start)


def baton_restore(registry: StateRegistry, store: SnapshotStore, step: int,
                  ram: Any = None) -> bool:
    """Snapshotter.restore's data path, without its coordinator bookkeeping; True if every
    byte came from RAM."""
    with collector_paused():
        manifest = store.load_manifest(step)
        live = registry.flatten()
        check_compatible(registry, manifest, live.tensors, live.skeletons)
        source = ByteSource(store, step, ram=ram)
        tensors = read_tensors(manifest, plan_targets(manifest, live.tensors), source)
        registry.load(tensors, manifest.state, checked=True)
    return source.used_ram and not source.used_storage


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rotate(fns: list[Callable[[], None]], r: int) -> None:
    """Run ``fns`` in the ``r``-th of their n! orders (mod n!): over n! rounds each one runs in
    each position, and right after each other one, equally often. Only turns (each first in
    turn) are not enough here: on this machine (a VM whose host takes back the memory it
    frees) how fast a write into the page cache goes depends on what ran just before it, and
    in turns one order repeats every third round (persist measured 0.7-1.2 s in every round
    in which it followed torch.save then DCP, 0.2-0.3 s in the others)."""
    orders = list(itertools.permutations(range(len(fns))))
    for i in orders[r % len(orders)]:
        fns[i]()


def count_coordinator_bytes(snap: Snapshotter) -> list[int]:
    """Wrap the coordinator's ``report_shard``: the JSON bytes of every receipt it gets."""
    sizes: list[int] = []
    report = snap.coordinator.report_shard

    def counted(receipt: dict[str, Any]) -> Any:
        sizes.append(len(json.dumps(receipt)))
        return report(receipt)

    snap.coordinator.report_shard = counted  # type: ignore[method-assign]
    return sizes


def measure(size: float, rounds: int, workdir: str) -> dict[str, Any]:
    model, optim, registry = build(size)
    train_step(model, optim, 1)
    nbytes = state_bytes(registry)
    run = os.path.join(workdir, "run")
    snap = Snapshotter(run, registry, keep_last=2)
    receipts = count_coordinator_bytes(snap)
    store = SnapshotStore(run)
    rows: dict[str, list[float]] = {k: [] for k in (
        "capture", "persist", "save", "dcp_return", "dcp_done", "restore_disk", "restore_ram",
        "load")}
    warm: dict[str, list[float]] = {k: [] for k in ("dcp_return", "dcp_done")}
    # Steady state: the capture image and the recycled RAM-tier buffers exist (the first two
    # snapshots allocate them), Baton's retention has retired one snapshot (its files are the
    # spares the next persist overwrites), and torch.save and DCP have written before; every
    # side keeps two.
    for step in (2, 3, 4):
        train_step(model, optim, step)
        snap.after_step(step, force=True)
        snap.persister.wait()
        snap.coordinator.flush(0)
        torch_save(model, optim, os.path.join(workdir, f"state-{step}.pt"))
        dcp_save(model, optim, os.path.join(workdir, f"dcp-{step}"), warm)
    os.remove(os.path.join(workdir, "state-2.pt"))
    shutil.rmtree(os.path.join(workdir, "dcp-2"))
    receipts.clear()
    for r in range(rounds):
        step = r + 5
        train_step(model, optim, step)
        # Each side as it runs for real, keeping the two newest (keep_last=2): torch.save and
        # DCP write new files and delete the one before last; Baton's commit retires its
        # snapshot before last, and the next persist overwrites those files (spares,
        # elastic/spares.py: crash-safe, temp + fsync + rename). Every side removes its old
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

        rotate([baton_save, baseline_save, dcp_baseline], r)
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

        rotate([restores, baseline_load], r)
    manifest = store.load_manifest(rounds + 4)
    chunks = [c for rec in manifest.tensors.values() for c in rec.chunks]
    meta = {"receipts_per_snapshot": statistics.median(receipts),
            "manifest": os.path.getsize(store.step_path(rounds + 4, "manifest.json")),
            "chunks": len(chunks), "blocks": sum(len(c.crc32) for c in chunks),
            "block_bytes": manifest.block_bytes}
    snap.close()
    assert receipts, "the coordinator was sent no receipt"
    return {"state_bytes": nbytes, "times": rows, "coordinator_bytes": meta}


# ---------------------------------------------------------------------- S3 (moto)


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server in its own process (its request handling then does not compete for
    this process's GIL), with the standard AWS variables pointing at it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": url,
           "AWS_ENDPOINT_URL_S3": url}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure_s3(size: float, rounds: int) -> dict[str, Any]:
    import boto3

    model, optim, registry = build(size)
    train_step(model, optim, 1)
    with moto_server() as url:
        client = boto3.client("s3", endpoint_url=url)
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        client.create_bucket(Bucket=bucket)
        run = f"s3://{bucket}/run"
        snap = Snapshotter(run, registry, keep_last=2, ram=False)
        store = SnapshotStore(run)
        rows: dict[str, list[float]] = {k: [] for k in (
            "s3_persist", "s3_save", "s3_restore", "s3_load")}
        for r in range(rounds + 1):  # round 0 warms up
            step = r + 2
            train_step(model, optim, step)
            key = f"torch/state-{step}.pt"

            def baton_save(step: int = step) -> float:
                def save() -> None:
                    snap.after_step(step, force=True)
                    snap.persister.wait()
                return timed(save)

            def baseline_save(key: str = key) -> float:
                def save() -> None:
                    buffer = io.BytesIO()
                    torch.save({"model": model.state_dict(), "optim": optim.state_dict()},
                               buffer)
                    buffer.seek(0)
                    client.upload_fileobj(buffer, bucket, key)
                return timed(save)

            def baton_load(step: int = step) -> float:
                return timed(lambda: baton_restore(registry, store, step))

            def baseline_load(key: str = key) -> float:
                def load() -> None:
                    buffer = io.BytesIO()
                    client.download_fileobj(bucket, key, buffer)
                    buffer.seek(0)
                    torch_restore(model, optim, buffer)
                return timed(load)

            for pair in ((("s3_persist", baton_save), ("s3_save", baseline_save)),
                         (("s3_restore", baton_load), ("s3_load", baseline_load))):
                for name, fn in (pair if r % 2 == 0 else pair[::-1]):
                    took = fn()
                    if r:
                        rows[name].append(took)
                assert snap.persister.last_error is None, snap.persister.last_error
            client.delete_object(Bucket=bucket, Key=key)
        snap.close()
    return rows


# ---------------------------------------------------------------------- peak memory


def rss_now() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_child(mode: str, size: float, workdir: str) -> dict[str, float]:
    model, optim, registry = build(size)
    # Materialise the optimizer's state with one step (see the module docstring; a fresh
    # optimizer has none), then free the gradients as a restarted worker has none.
    train_step(model, optim, 1)
    optim.zero_grad(set_to_none=True)
    nbytes = state_bytes(registry)
    # Reset the peak (building the model peaked higher than it holds now): Linux only.
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    before = rss_now()
    store = SnapshotStore(os.path.join(workdir, "run"))
    step = max(store.committed_steps())
    start = time.perf_counter()
    if mode == "baton":
        baton_restore(registry, store, step)
    else:
        torch_restore(model, optim, os.path.join(workdir, f"state-{step}.pt"))
    seconds = time.perf_counter() - start
    peak = peak_rss()
    return {"growth": (peak - before) / nbytes, "peak": peak / nbytes, "seconds": seconds}


def fresh_children(size: float, workdir: str, rounds: int) -> dict[str, Any]:
    """Restore in fresh processes (a restarted worker's case: all its memory is new), each
    side ``rounds`` times, alternating: peak RSS of the first, seconds of every one."""
    got: dict[str, list[dict[str, float]]] = {"baton": [], "torch": []}
    for r in range(rounds):
        for mode in ("baton", "torch") if r % 2 == 0 else ("torch", "baton"):
            child = subprocess.run([sys.executable, __file__, "--child", mode, str(size),
                                    workdir], capture_output=True, text=True, check=True)
            got[mode].append(json.loads(child.stdout.strip().splitlines()[-1]))
    rss = {mode: {"growth": runs[0]["growth"], "peak": runs[0]["peak"]}
           for mode, runs in got.items()}
    rss["fresh_restore_s"] = {mode: [run["seconds"] for run in runs]
                              for mode, runs in got.items()}
    return rss


def _save_both(size: float, workdir: str) -> int:
    """One snapshot and one torch.save of the same state into ``workdir``; the state bytes.
    Everything it built is dropped on return: while the children restore, this process
    holds no model, capture image or RAM-tier copy (at 3.4 GB they would crowd the files
    the children read out of the page cache)."""
    model, optim, registry = build(size)
    train_step(model, optim, 1)
    snap = Snapshotter(os.path.join(workdir, "run"), registry, keep_last=2)
    snap.after_step(2, force=True)
    snap.persister.wait()
    snap.close()
    torch_save(model, optim, os.path.join(workdir, "state-2.pt"))
    return state_bytes(registry)


def fresh_only(size: float, rounds: int) -> None:
    """One snapshot and one torch.save of the same state, then ``fresh_children``: the
    restarted worker's restore alone, with more rounds than the full run affords."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("BATON_BENCH_DIR")) as workdir:
        nbytes = _save_both(size, workdir)
        gc.collect()  # this process's copies of the state are gone before the children run
        seconds = fresh_children(size, workdir, rounds)["fresh_restore_s"]
    r = ratio(seconds["baton"], seconds["torch"])
    below = sum(a < b for a, b in zip(seconds["baton"], seconds["torch"], strict=True))
    print(f"{nbytes / 1e9:.2f} GB, restore in a fresh process / torch.load + "
          f"load_state_dict in one: {r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f}), "
          f"Baton faster in {below} of {rounds} rounds; medians "
          f"{statistics.median(seconds['baton']):.3f} s / "
          f"{statistics.median(seconds['torch']):.3f} s")


# ---------------------------------------------------------------------- summary


def ratio(num: list[float], den: list[float]) -> dict[str, float]:
    r = [a / b for a, b in zip(num, den, strict=True)]
    return {"median": statistics.median(r), "min": min(r), "max": max(r)}


def summarise(got: dict[str, Any], rss: dict[str, Any],
              s3: dict[str, list[float]] | None) -> dict[str, Any]:
    t = got["times"]
    gb = got["state_bytes"] / 1e9
    med = {k: statistics.median(v) for k, v in t.items()}
    out: dict[str, Any] = {
        "state_gb": gb, "times_s": t, "rss": rss,
        "coordinator_bytes": got["coordinator_bytes"],
        "capture_vs_save": ratio(t["capture"], t["save"]),
        "capture_vs_dcp_return": ratio(t["capture"], t["dcp_return"]),
        "persist_vs_save": ratio(t["persist"], t["save"]),
        "persist_vs_dcp_done": ratio(t["persist"], t["dcp_done"]),
        "restore_disk_vs_load": ratio(t["restore_disk"], t["load"]),
        "restore_ram_vs_load": ratio(t["restore_ram"], t["load"]),
        "fresh_restore_vs_load": ratio(rss["fresh_restore_s"]["baton"],
                                       rss["fresh_restore_s"]["torch"]),
        "gb_per_s": {k: gb / v for k, v in med.items()},
    }
    if s3:
        out["s3_times_s"] = s3
        out["s3_persist_vs_save"] = ratio(s3["s3_persist"], s3["s3_save"])
        out["s3_restore_vs_load"] = ratio(s3["s3_restore"], s3["s3_load"])
        out["gb_per_s"].update({k: gb / statistics.median(v) for k, v in s3.items()})
    return out


def project(results: dict[str, Any]) -> dict[str, Any]:
    """7B / 70B on 16 / 128 workers from the per-process rates of the largest size measured
    (one process's rate taken as a node's: conservative for a node's disk and copies)."""
    base = max(results.values(), key=lambda r: r["state_gb"])
    rate = base["gb_per_s"]
    meta = base["coordinator_bytes"]
    # The coordinator's metadata (receipts + manifest) is O(chunks + checksum blocks): the
    # measured bytes less the blocks' share, per chunk.
    per_chunk = (meta["receipts_per_snapshot"] + meta["manifest"]
                 - META_PER_BLOCK * meta["blocks"]) / meta["chunks"]
    storage_rate = rate.get("s3_restore", rate["restore_disk"])
    rows = {}
    for name, (params, param_tensors) in MODELS.items():
        state = params * BYTES_PER_PARAM / 1e9  # GB
        for workers in (16, 128):
            nodes = workers // WORKERS_PER_NODE
            per_node = state / nodes
            after = max(nodes - 1, 1)
            lost = 1 / nodes  # the RAM-tier copies the lost node held come from storage
            # FSDP2: weights and both moments in one chunk per worker; step counters whole.
            chunks = 3 * param_tensors * workers + param_tensors
            blocks = chunks + state * 1e9 / meta["block_bytes"]
            head = per_chunk * chunks + META_PER_BLOCK * blocks
            rows[f"{name}/{workers}"] = {
                "state_gb": state, "nodes": nodes, "chunks": chunks,
                "head_mb_per_snapshot": head / 1e6,
                "head_ram_mb": 2 * head / 1e6,  # the committed manifest + one in flight
                "stall_s": state / workers / rate["capture"],
                "snapshot_s": per_node / rate["persist"],
                "ram_tier_gb_per_node": 2 * per_node,  # committed + in flight
                "restore_after_node_loss_s": state / after * (
                    (1 - lost) / rate["restore_ram"] + lost / storage_rate),
                "restore_all_from_storage_s": state / after / storage_rate,
            }
    return {"from_state_gb": base["state_gb"], "workers_per_node": WORKERS_PER_NODE,
            "bytes_per_param": BYTES_PER_PARAM, "metadata_bytes_per_chunk": per_chunk,
            "metadata_bytes_per_block": META_PER_BLOCK,
            "storage_rate": "s3 (moto)" if "s3_restore" in rate else "local disk",
            "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="0.3,1.2", help="state sizes in GB: 0.3, 1.2, 3")
    parser.add_argument("--rounds", type=int, default=6,
                        help="rounds per size; a multiple of 6 balances the writers' orders")
    parser.add_argument("--fresh-rounds", type=int, default=4,
                        help="restores in fresh processes per side (alternating)")
    parser.add_argument("--s3-rounds", type=int, default=2)
    parser.add_argument("--s3-max", type=float, default=1.2,
                        help="measure S3 (moto) for sizes up to this (0: never)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/snapshot_scale.json"))
    parser.add_argument("--fresh-only", action="store_true",
                        help="only the restores in fresh processes (--fresh-rounds per side); "
                        "prints the ratios, writes nothing")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "SIZE", "DIR"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, size, workdir = args.child
        print(json.dumps(rss_child(mode, float(size), workdir)))
        return
    if args.fresh_only:
        for size in (float(s) for s in args.sizes.split(",")):
            fresh_only(min(SHAPES, key=lambda s: abs(s - size)), args.fresh_rounds)
        return
    out = Path(args.out)
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    results.pop("projection", None)
    results = {k: v for k, v in results.items() if "gb_per_s" in v}  # older layouts
    for size in (float(s) for s in args.sizes.split(",")):
        size = min(SHAPES, key=lambda s: abs(s - size))
        with tempfile.TemporaryDirectory(dir=os.environ.get("BATON_BENCH_DIR")) as workdir:
            got = measure(size, args.rounds, workdir)
            rss = fresh_children(size, workdir, args.fresh_rounds)
        s3 = measure_s3(size, args.s3_rounds) if size <= args.s3_max else None
        results[f"{size:g}"] = summarise(got, rss, s3)
        print(f"[{size:g} GB done]", file=sys.stderr, flush=True)
    results = dict(sorted(results.items(), key=lambda kv: float(kv[0])))
    results["projection"] = project(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print_tables(results)


def print_tables(results: dict[str, Any]) -> None:
    def cell(r: dict[str, float] | None) -> str:
        return "-" if r is None else f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"

    sizes = [s for s in results if s != "projection"]
    print("| | " + " | ".join(f"{results[s]['state_gb']:.2f} GB" for s in sizes) + " |")
    print("|---" * (len(sizes) + 1) + "|")
    for label, key in (
            ("blocking capture / torch.save+fsync", "capture_vs_save"),
            ("blocking capture / dcp.async_save returns", "capture_vs_dcp_return"),
            ("background persist / torch.save+fsync", "persist_vs_save"),
            ("background persist / dcp.async_save done", "persist_vs_dcp_done"),
            ("restore, local disk / torch.load+load_state_dict", "restore_disk_vs_load"),
            ("restore, RAM tier / torch.load+load_state_dict", "restore_ram_vs_load"),
            ("restore in a fresh process, local disk / the same with torch.load",
             "fresh_restore_vs_load"),
            ("S3 persist / torch.save+boto3 upload", "s3_persist_vs_save"),
            ("S3 restore / boto3 download+torch.load", "s3_restore_vs_load")):
        print(f"| {label} | " + " | ".join(cell(results[s].get(key)) for s in sizes) + " |")
    print("| GB/s: persist, torch.save, dcp done | " + " | ".join(
        "{persist:.2f}, {save:.2f}, {dcp_done:.2f}".format(**results[s]["gb_per_s"])
        for s in sizes) + " |")
    print("| GB/s: restore disk, RAM, torch.load | " + " | ".join(
        "{restore_disk:.2f}, {restore_ram:.2f}, {load:.2f}".format(**results[s]["gb_per_s"])
        for s in sizes) + " |")
    for mode in ("baton", "torch"):
        print(f"| restore RSS growth, peak / state ({mode}) | " + " | ".join(
            f"{results[s]['rss'][mode]['growth']:.2f}x, {results[s]['rss'][mode]['peak']:.2f}x"
            for s in sizes) + " |")
    print("| coordinator bytes per snapshot (receipts + manifest) | " + " | ".join(
        "{:.0f} KB".format((results[s]["coordinator_bytes"]["receipts_per_snapshot"]
                            + results[s]["coordinator_bytes"]["manifest"]) / 1e3)
        for s in sizes) + " |")
    proj = results["projection"]
    print(f"\nProjection from the {proj['from_state_gb']:.2f} GB rates "
          f"({proj['workers_per_node']} workers per node, storage: {proj['storage_rate']}):")
    print("| model / workers | state | head bytes per snapshot | head RAM | stall | "
          "snapshot (per node) | RAM tier per node | restore after a node loss | "
          "all from storage |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in proj["rows"].items():
        print(f"| {name} | {r['state_gb']:.0f} GB | {r['head_mb_per_snapshot']:.1f} MB | "
              f"{r['head_ram_mb']:.1f} MB | {r['stall_s']:.2f} s | {r['snapshot_s']:.0f} s | "
              f"{r['ram_tier_gb_per_node']:.0f} GB | {r['restore_after_node_loss_s']:.0f} s | "
              f"{r['restore_all_from_storage_s']:.0f} s |")


if __name__ == "__main__":
    main()
