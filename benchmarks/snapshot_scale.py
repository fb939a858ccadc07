"""What a snapshot costs at real sizes: Baton against torch.save / torch.load, side by side.

For GPT + AdamW states of about 0.3 and 1.2 GB (``--sizes``), one process per size measures,
in ``--rounds`` rounds that alternate which side goes first:

- blocking capture: ``Snapshotter.after_step`` (the copy into the reused capture image; with
  the pipelined form it overlaps forward/backward, this is its floor), against
  ``torch.save`` + ``fsync`` of the same model and optimizer state dicts;
- background persist: from the end of the capture until the persist thread is done (RAM copy
  for the in-process coordinator, crc32 of every block, write + fsync, receipt, commit),
  against the same ``torch.save`` + ``fsync``;
- restore from local disk and from the coordinator's RAM copy (``read_tensors`` +
  ``StateRegistry.load``: Snapshotter.restore's data path), against ``torch.load`` +
  ``load_state_dict`` of the file torch.save wrote. Both files were just written, so both
  read from the page cache. Both sides write a new file per snapshot and keep the last two;
  two warm-up snapshots come first (Baton's capture image and RAM-copy buffers are
  allocated by the first two snapshots and reused after).

Each ratio is Baton's time over the baseline's in the same round: the median and the range
over the rounds are printed. Peak memory of a restore is measured in fresh processes (one per
case), which build the model and optimizer, materialise the optimizer's state (a process that
holds its training state; DCP's state-dict API does this on a fresh optimizer anyway), then
restore: ``growth`` is the peak RSS above the RSS before the restore, ``peak`` the peak RSS,
both divided by the state's size.

    python benchmarks/snapshot_scale.py                      # 0.3 and 1.2 GB, 3 rounds
    python benchmarks/snapshot_scale.py --sizes 0.3 --rounds 2
    # writes benchmarks/results/snapshot_scale.json

The machine is small and shared: absolute times move by tens of percent between runs; the
ratios, measured back to back, much less.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic.registry import StateRegistry  # noqa: E402
from elastic.restore import ByteSource, plan_targets, read_tensors  # noqa: E402
from elastic.snapshotter import Snapshotter  # noqa: E402
from elastic.store import SnapshotStore  # noqa: E402
from trainer.config import ModelConfig  # noqa: E402
from trainer.model import GPT  # noqa: E402

# GPT shapes whose fp32 parameters + AdamW moments come to about the named size.
SHAPES = {0.3: (512, 7), 1.2: (1024, 8), 3.0: (1536, 9)}
VOCAB, SEQ = 8192, 32


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


def torch_save(model: GPT, optim: torch.optim.Optimizer, path: str) -> None:
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_restore(model: GPT, optim: torch.optim.Optimizer, path: str) -> None:
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    optim.load_state_dict(saved["optim"])


def baton_restore(registry: StateRegistry, store: SnapshotStore, step: int,
                  ram: Any = None) -> bool:
    """Snapshotter.restore's data path, without its coordinator bookkeeping; True if every
    byte came from RAM."""
    manifest = store.load_manifest(step)
    source = ByteSource(store, step, ram=ram)
    tensors = read_tensors(manifest, plan_targets(manifest, registry.flatten().tensors), source)
    registry.load(tensors, manifest.state)
    return source.used_ram and not source.used_storage


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(size: float, rounds: int, workdir: str) -> dict[str, Any]:
    model, optim, registry = build(size)
    train_step(model, optim, 1)
    nbytes = state_bytes(registry)
    run = os.path.join(workdir, "run")
    snap = Snapshotter(run, registry, keep_last=2)
    store = SnapshotStore(run)
    rows: dict[str, list[float]] = {k: [] for k in (
        "capture", "persist", "save", "restore_disk", "restore_ram", "load")}
    # Steady state: the capture image and the recycled RAM-copy buffers exist (the first
    # two snapshots allocate them), and torch.save has written files before.
    for step in (2, 3):
        train_step(model, optim, step)
        snap.after_step(step, force=True)
        snap.persister.wait()
        torch_save(model, optim, os.path.join(workdir, f"state-{step}.pt"))
    for r in range(rounds):
        step = r + 4
        train_step(model, optim, step)
        # A new file per snapshot, the one before last deleted (keep_last=2, as Baton):
        # overwriting one file in place is not crash-safe, and on this machine's disk it
        # also measured 3-4x faster than writing a new file, so it would not compare like
        # with like.
        path = os.path.join(workdir, f"state-{step}.pt")
        old = os.path.join(workdir, f"state-{step - 2}.pt")
        if os.path.exists(old):
            os.remove(old)

        def baton_save(step: int = step) -> None:
            rows["capture"].append(timed(lambda: snap.after_step(step, force=True)))
            rows["persist"].append(timed(snap.persister.wait))

        def baseline_save(path: str = path) -> None:
            rows["save"].append(timed(lambda: torch_save(model, optim, path)))

        for fn in ((baton_save, baseline_save) if r % 2 == 0 else (baseline_save, baton_save)):
            fn()
        assert snap.persister.last_error is None, snap.persister.last_error
        assert step in snap.coordinator.committed_steps()

        def restores(step: int = step) -> None:
            rows["restore_disk"].append(timed(lambda: baton_restore(registry, store, step)))
            assert snap.ram_tier is not None
            ram = functools.partial(snap.ram_tier.read, step, snap.coordinator.ram_locations(step))
            from_ram: list[bool] = []
            rows["restore_ram"].append(timed(
                lambda: from_ram.append(baton_restore(registry, store, step, ram))))
            assert from_ram == [True], "the RAM copy did not serve the restore"

        def baseline_load(path: str = path) -> None:
            rows["load"].append(timed(lambda: torch_restore(model, optim, path)))

        for fn in ((restores, baseline_load) if r % 2 == 0 else (baseline_load, restores)):
            fn()
    snap.close()
    return {"state_bytes": nbytes, "times": rows}


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
    registry.flatten()  # materialise the optimizer's state (see the module docstring)
    nbytes = state_bytes(registry)
    # Reset the peak (building the model peaked higher than it holds now): Linux only.
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    before = rss_now()
    store = SnapshotStore(os.path.join(workdir, "run"))
    step = max(store.committed_steps())
    if mode == "baton":
        baton_restore(registry, store, step)
    else:
        torch_restore(model, optim, os.path.join(workdir, f"state-{step}.pt"))
    peak = peak_rss()
    return {"growth": (peak - before) / nbytes, "peak": peak / nbytes}


def ratio(num: list[float], den: list[float]) -> dict[str, float]:
    r = [a / b for a, b in zip(num, den, strict=True)]
    return {"median": statistics.median(r), "min": min(r), "max": max(r)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="0.3,1.2", help="state sizes in GB: 0.3, 1.2, 3.0")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/snapshot_scale.json"))
    parser.add_argument("--child", nargs=3, metavar=("MODE", "SIZE", "DIR"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, size, workdir = args.child
        print(json.dumps(rss_child(mode, float(size), workdir)))
        return
    results: dict[str, Any] = {}
    for size in (float(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory(dir=os.environ.get("BATON_BENCH_DIR")) as workdir:
            got = measure(size, args.rounds, workdir)
            t = got["times"]
            rss = {}
            for mode in ("baton", "torch"):
                out = subprocess.run([sys.executable, __file__, "--child", mode, str(size),
                                      workdir], capture_output=True, text=True, check=True)
                rss[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        gb = got["state_bytes"] / 1e9
        results[f"{size:g}"] = {
            "state_gb": gb, "times_s": t, "rss": rss,
            "capture_vs_save": ratio(t["capture"], t["save"]),
            "persist_vs_save": ratio(t["persist"], t["save"]),
            "restore_disk_vs_load": ratio(t["restore_disk"], t["load"]),
            "restore_ram_vs_load": ratio(t["restore_ram"], t["load"]),
            "save_gb_per_s": gb / statistics.median(t["save"]),
            "persist_gb_per_s": gb / statistics.median(t["persist"]),
        }
        print(f"[{size:g} GB done]", file=sys.stderr, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print_table(results)


def print_table(results: dict[str, Any]) -> None:
    def cell(r: dict[str, float]) -> str:
        return f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"

    sizes = list(results)
    head = "| | " + " | ".join(f"{results[s]['state_gb']:.2f} GB" for s in sizes) + " |"
    print(head)
    print("|---" * (len(sizes) + 1) + "|")
    for label, key in (("blocking capture / torch.save+fsync", "capture_vs_save"),
                       ("background persist / torch.save+fsync", "persist_vs_save"),
                       ("restore, local disk / torch.load+load_state_dict",
                        "restore_disk_vs_load"),
                       ("restore, RAM copy / torch.load+load_state_dict", "restore_ram_vs_load")):
        print(f"| {label} | " + " | ".join(cell(results[s][key]) for s in sizes) + " |")
    print("| persist, torch.save+fsync GB/s | " + " | ".join(
        f"{results[s]['persist_gb_per_s']:.2f}, {results[s]['save_gb_per_s']:.2f}"
        for s in sizes) + " |")
    for mode in ("baton", "torch"):
        print(f"| restore RSS growth, peak / state ({mode}) | " + " | ".join(
            f"{results[s]['rss'][mode]['growth']:.2f}x, {results[s]['rss'][mode]['peak']:.2f}x"
            for s in sizes) + " |")


if __name__ == "__main__":
    main()
