"""How long does a snapshot stop training? Baton against torch.save and DCP async_save.

Measured in one run, on this machine, with the built-in GPT at about 25M parameters
(d_model 512, 6 layers, 8 heads, vocab 6144, batch 4 x 128 tokens, fp32, AdamW):

(a) stall per snapshot: the time the training loop spends inside snapshot calls.
    - Baton, pipelined: ``begin_capture_if_due`` after ``optimizer.step`` and ``wait_capture``
      before the next one; the copy runs on a side thread during the next forward/backward
      (CheckFreq-style).
    - Baton, blocking: ``after_step`` (copy, then return): the copy floor.
    - ``torch.save`` of the same model+optimizer state, then ``fsync`` (durable).
    - ``torch.distributed.checkpoint.async_save``: time until control returns.
(b) throughput: blocks of 10 steps alternately without snapshots and with Baton snapshotting
    every 10 steps (pipelined, persist in background), median step time ratio.
(c) restore time of the whole state: from the coordinator's RAM copy, from local disk
    (page cache warm: an optimistic "storage"), and from an S3 API on 127.0.0.1 (moto).
(d) the replica check a snapshot adds at world size > 1 (fingerprints of every replicated
    tensor, ``elastic.replicas``), against the pipelined stall and the step.
(e) the full replica checksums a rank of a group takes (crc32 of every replicated tensor, whole,
    ``elastic.write.replica_sums``): the pipelined stall and the blocking capture of rank 0 of 2
    with them (B) and without (A), alternated in one run (``benchmarks.snapshot_stall.replicas``).

Targets: Baton's pipelined stall <= 1/20 of torch.save+fsync and below DCP's async stall;
throughput overhead <= 3 % with a snapshot every 10 steps; restore from RAM <= 1/3 of restore
from storage. The machine is small and shared: absolute times vary by tens of percent between
runs, ratios much less; each figure is compared with its baseline from the same run.

    python -m benchmarks.snapshot_stall.run          # writes benchmarks/results/snapshot_stall.json
    python -m benchmarks.snapshot_stall.run --quick  # fewer steps, no S3 (smoke run)
    python -m benchmarks.snapshot_stall.run --only replica-checksums --rounds 12   # (e) alone
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import time

import torch

from benchmarks.common import RESULTS, arg_parser, moto_s3, timed, write_json
from benchmarks.snapshot_stall.replicas import replica_checksum_cost
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.state.registry import StateRegistry
from trainer.config import ModelConfig
from trainer.train.model import GPT

CFG = ModelConfig(vocab_size=6144, d_model=512, n_layers=6, n_heads=8)
SEQ_LEN = 128
BATCH = 4
# A restore that reads storage only (no RAM tier).
NO_RAM = SnapshotSettings(ram=False)


class Run:
    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = GPT(CFG, seq_len=SEQ_LEN)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.registry = StateRegistry()
        self.registry.register("model", self.model)
        self.registry.register("optim", self.optim)
        self.gen = torch.Generator().manual_seed(seed)

    def forward_backward(self) -> None:
        tokens = torch.randint(0, CFG.vocab_size, (BATCH, SEQ_LEN), generator=self.gen)
        self.optim.zero_grad(set_to_none=True)
        self.model.loss(tokens).backward()

    def step(self) -> None:
        self.forward_backward()
        self.optim.step()

    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def state_bytes(self) -> int:
        flat = self.registry.flatten().tensors
        return sum(t.numel() * t.element_size() for t in flat.values())


def baton_pipelined_stall(run: Run, root: str, snapshots: int, every: int) -> list[float]:
    """Stall of snapshot s = time in begin_capture at step s + time in wait_capture just
    before the optimizer step of s+1 (what the copy did not hide behind forward/backward)."""
    snap = Snapshotter(root, run.registry,
                       settings=SnapshotSettings(snapshot_every=every, on_busy="wait"))
    began: dict[int, float] = {}
    waited: dict[int, float] = {}
    for step in range(1, every * (snapshots + 1) + 2):
        run.forward_backward()
        waited[step] = timed(snap.wait_capture)
        run.optim.step()
        t0 = time.perf_counter()
        if snap.begin_capture_if_due(step):
            began[step] = time.perf_counter() - t0
    snap.close()
    stalls = [began[s] + waited[s + 1] for s in sorted(began) if s + 1 in waited]
    return stalls[1:]  # the first capture allocates and touches the image: not typical


def replica_check(run: Run, reps: int) -> list[float]:
    """What a snapshot adds at world size > 1: the fingerprints of every replicated model and
    optimizer tensor (``elastic.replicas``), computed at ``begin_capture`` from the state the
    capture reads anyway (their all-reduce is the busy agreement's, with ~20 KiB more)."""
    from elastic.replicas import fingerprints

    tensors = run.registry.flatten(run.registry.model_keys()).tensors
    return [timed(lambda i=i: fingerprints(tensors, i)) for i in range(reps)]


def baton_blocking_stall(run: Run, root: str, reps: int) -> list[float]:
    snap = Snapshotter(root, run.registry,
                       settings=SnapshotSettings(snapshot_every=1, on_busy="wait"))
    out = []
    for i in range(reps + 1):
        snap.persister.wait()
        out.append(timed(lambda i=i: snap.after_step(i + 1)))
    snap.close()
    return out[1:]


def torch_save_stall(run: Run, path: str, reps: int) -> list[float]:
    def save() -> None:
        with open(path, "wb") as fh:
            torch.save({"model": run.model.state_dict(), "optim": run.optim.state_dict()}, fh)
            fh.flush()
            os.fsync(fh.fileno())

    return [timed(save) for _ in range(reps)]


def dcp_async_stall(run: Run, root: str, reps: int) -> list[float]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=0, world_size=1)
    out = []
    for i in range(reps):
        msd, osd = get_state_dict(run.model, run.optim)
        t0 = time.perf_counter()
        future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/dcp{i}")
        out.append(time.perf_counter() - t0)
        future.result()
    return out


def throughput(run: Run, root: str, pairs: int, every: int) -> dict[str, float]:
    snap = Snapshotter(root, run.registry, settings=SnapshotSettings(snapshot_every=every))
    plain, snapped = [], []
    step = 0
    for _ in range(pairs):
        t0 = time.perf_counter()
        for _ in range(every):
            run.step()
        plain.append((time.perf_counter() - t0) / every)
        t0 = time.perf_counter()
        for _ in range(every):
            run.forward_backward()
            snap.wait_capture()
            run.optim.step()
            step += 1
            snap.begin_capture_if_due(step)
        snapped.append((time.perf_counter() - t0) / every)
    snap.close()
    return {"step_s_plain": statistics.median(plain),
            "step_s_with_snapshots": statistics.median(snapped),
            "overhead": statistics.median(snapped) / statistics.median(plain) - 1,
            "snapshots_skipped_busy": len(snap.skipped)}


def restore_times(root: str, reps: int, s3_uri: str | None) -> dict[str, float]:
    src = Run(seed=1)
    src.step()
    snap = Snapshotter(root, src.registry,
                       settings=SnapshotSettings(snapshot_every=1, on_busy="wait"))
    snap.after_step(1)
    snap.close()
    dst = Run(seed=2)
    # Warm-up: the first load into a fresh optimizer creates its state (DCP steps it once
    # with zero gradients); that one-off cost belongs to neither path.
    Snapshotter(root, dst.registry, settings=NO_RAM).restore()
    out: dict[str, float] = {}
    ram, disk = [], []
    for _ in range(reps):
        ram_snap = Snapshotter(root, dst.registry, coordinator=snap.coordinator,
                               ram_tier=snap.ram_tier)
        ram.append(timed(ram_snap.restore))
        assert ram_snap.restored_from == ("ram", 1)
        disk_snap = Snapshotter(root, dst.registry, settings=NO_RAM)
        disk.append(timed(disk_snap.restore))
        assert disk_snap.restored_from == ("storage", 1)
    out["ram_s"] = statistics.median(ram)
    out["local_disk_s"] = statistics.median(disk)
    if s3_uri:
        s3 = Snapshotter(s3_uri, src.registry, settings=SnapshotSettings(
            snapshot_every=1, ram=False, on_busy="wait"))
        s3.after_step(1)
        s3.close()
        s3_dst = Snapshotter(s3_uri, dst.registry, settings=NO_RAM)
        out["s3_s"] = timed(s3_dst.restore)
    return out


def main() -> int:
    parser = arg_parser(__doc__, __spec__)
    parser.add_argument("--quick", action="store_true", help="fewer steps, no S3")
    parser.add_argument("--out", default=str(RESULTS / "snapshot_stall.json"))
    parser.add_argument("--only", choices=("all", "replica-checksums"), default="all",
                        help="replica-checksums: part (e) alone")
    parser.add_argument("--rounds", type=int, default=8, help="A/B rounds of part (e)")
    args = parser.parse_args()
    reps = 2 if args.quick else 3
    pairs = 2 if args.quick else 5
    tmp = tempfile.mkdtemp(prefix="baton-bench-")
    run = Run()
    run.step()
    run.step()  # optimizer state exists from here on
    print(f"GPT {run.n_params() / 1e6:.1f}M params, state {run.state_bytes() / 2**20:.0f} MiB")
    rounds = 2 if args.quick else args.rounds
    if args.only == "replica-checksums":
        alone = {"torch": torch.__version__,
                 "replica_checksums": replica_checksum_cost(run, f"{tmp}/sums", rounds)}
        print(json.dumps(alone, indent=1))
        write_json(args.out.replace(".json", "_replicas.json"), alone)
        return 0
    step_s = statistics.median(timed(run.step) for _ in range(3))

    res: dict[str, object] = {"params": run.n_params(), "state_bytes": run.state_bytes(),
                              "step_s": step_s, "torch": torch.__version__}
    res["baton_pipelined_stall_s"] = statistics.median(
        baton_pipelined_stall(run, f"{tmp}/pipe", reps, every=3))
    res["replica_check_s"] = statistics.median(replica_check(run, 10 * reps))
    res["baton_blocking_stall_s"] = statistics.median(
        baton_blocking_stall(run, f"{tmp}/block", reps))
    res["torch_save_fsync_s"] = statistics.median(torch_save_stall(run, f"{tmp}/ts.pt", reps))
    res["dcp_async_save_stall_s"] = statistics.median(dcp_async_stall(run, f"{tmp}", reps))
    res["throughput"] = throughput(run, f"{tmp}/tp", pairs, every=10)
    sums = res["replica_checksums"] = replica_checksum_cost(run, f"{tmp}/sums", rounds)
    with contextlib.nullcontext() if args.quick else moto_s3("bench"):
        s3_uri = None if args.quick else "s3://bench/snapshot-stall"
        res["restore"] = restore_times(f"{tmp}/restore", reps, s3_uri)

    ts = res["torch_save_fsync_s"]
    restore = res["restore"]
    ratios = {
        "baton_pipelined_over_torch_save": res["baton_pipelined_stall_s"] / ts,
        "baton_pipelined_over_dcp_async": res["baton_pipelined_stall_s"]
        / res["dcp_async_save_stall_s"],
        "throughput_overhead": res["throughput"]["overhead"],
        "replica_check_over_pipelined_stall": res["replica_check_s"]
        / res["baton_pipelined_stall_s"],
        "replica_check_over_step": res["replica_check_s"] / step_s,
        "replica_checksums_stall_b_over_a": sums["pipelined_stall_b_over_a"]["median"],
        "restore_ram_over_local_disk": restore["ram_s"] / restore["local_disk_s"],
    }
    if "s3_s" in restore:
        ratios["restore_ram_over_s3"] = restore["ram_s"] / restore["s3_s"]
    res["ratios"] = ratios
    print(json.dumps(res, indent=1))
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
