"""BASIS quality on real text: what sketching costs in validation loss, and what it buys (issue 6).

The built-in GPT (d_model 256, 4 layers, 4 heads, seq_len 256) is trained on the embedded
corpus (Python's standard library, prepared by `data_state.prepare_corpus`) through the
project's own loader, with the project's AdamW and warmup-cosine schedule. A microbatch of 8
sequences of 256 predicted tokens gives n = 2048 rows per linear layer. Every configuration
runs with several seeds (model init, data order and sketches all follow the seed) and is
reported as mean ± std of the final validation loss over a fixed held-out set.

Configurations (`VARIANTS`): exact backprop, full activation checkpointing, BASIS at several
R, and the ways of closing the gap — which layers are sketched, per-layer R from a memory
budget, the mean-centred estimator, the learning rate. Two comparisons:

1. equal steps and batch: every variant trains STEPS steps of one microbatch of 8;
2. equal peak memory: a BASIS variant spends the memory it saves on a larger microbatch
   (the largest whose measured step peak fits under exact backprop's at 8) and trains for the
   same wall time as exact backprop (steps = STEPS × exact step time / its step time, from the
   probe below) — and, for reference, for the same number of tokens.

Phases, each resumable (a finished run is a JSON file and is not redone):
- probe: per variant, in its own process on one thread, the step's peak memory above the
  resting process (`VmHWM` after resetting it, with glibc returning freed memory at once),
  the bytes autograd saves for backward, and the median step time; exact backprop is probed
  between the others so its step-time ratio comes from the same conditions;
- train: (variant, seed) runs, two at a time on one thread each;
- report: `benchmarks/results/sketch_quality.json`, `sketch_quality.png` (validation-loss
  curves with ±std bands; memory vs quality) and a Markdown table on stdout.

    python benchmarks/sketch_quality.py              # everything (~1 h on 2 cores)
    python benchmarks/sketch_quality.py --only exact,basis-r128 --seeds 0
    python benchmarks/sketch_quality.py --report     # re-print from the saved runs

Runs hold `/tmp/baton_cpu.lock` (flock) a batch at a time, so other timing-sensitive
benchmarks on the same machine do not overlap them.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
RUNS = RESULTS / "sketch_quality"
DATA = ROOT / "data" / "quality-corpus"
CPU_LOCK = "/tmp/baton_cpu.lock"

D_MODEL, N_LAYERS, N_HEADS, SEQ = 256, 4, 4, 256
MICROBATCH = 8
N_ROWS = MICROBATCH * SEQ  # 2048 rows per linear layer per microbatch
STEPS = 300
LR, WARMUP = 1e-3, 30
EVAL_EVERY, EVAL_SEQS, FINAL_EVAL_SEQS = 25, 128, 512
CORPUS_BYTES = 12_000_000
SEEDS = (0, 1, 2)
MEMORY_CANDIDATES = (12, 16, 24, 32)  # microbatches tried for the equal-memory comparison
# glibc: serve every allocation above 64 KiB by mmap and give it back on free, so the resident
# set follows live memory and VmHWM measures the real peak (not malloc's cached arenas).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One training configuration. rank 0 = exact backprop."""

    name: str
    label: str
    rank: int = 0
    include: tuple[str, ...] | None = None  # sketch_model's globs; None = its default
    estimator: str = "basis"
    budget_rank: int = 0  # > 0: per-layer ranks from the budget uniform R = budget_rank uses
    checkpoint: bool = False
    lr_scale: float = 1.0
    microbatch: int = MICROBATCH
    steps: int = STEPS
    group: str = "equal steps"


ALL_LINEARS = ("blocks.*.attn.qkv", "blocks.*.attn.proj", "blocks.*.mlp.*", "lm_head")
NO_FC = ("blocks.*.attn.*", "blocks.*.mlp.proj", "lm_head")  # the fused MLP keeps fc's input
MLP_HEAD = ("blocks.*.mlp.*", "lm_head")
VARIANTS: list[Variant] = [
    Variant("exact", "exact backprop"),
    Variant("ckpt", "activation checkpointing", checkpoint=True),
    Variant("basis-r512", "BASIS R=n/4 (512)", rank=512, include=ALL_LINEARS),
    Variant("basis-r128", "BASIS R=n/16 (128)", rank=128, include=ALL_LINEARS),
    Variant("basis-r32", "BASIS R=n/64 (32)", rank=32, include=ALL_LINEARS),
    # Ablations at R = n/16, one change at a time, then combined.
    Variant(
        "r128-mlp-head", "R=128, MLP + head only", rank=128, include=MLP_HEAD, group="ablation"
    ),
    Variant("r128-fc-exact", "R=128, fc exact (free)", rank=128, include=NO_FC, group="ablation"),
    Variant(
        "r128-centered",
        "R=128, centred estimator",
        rank=128,
        include=ALL_LINEARS,
        estimator="centered",
        group="ablation",
    ),
    Variant(
        "r128-policy",
        "R=128, centred + fc exact",
        rank=128,
        include=NO_FC,
        estimator="centered",
        group="ablation",
    ),
    Variant(
        "budget128-policy",
        "budget of R=128, per-layer R, centred + fc exact",
        budget_rank=128,
        include=NO_FC,
        estimator="centered",
        group="ablation",
    ),
    Variant(
        "r32-policy",
        "R=32, centred + fc exact",
        rank=32,
        include=NO_FC,
        estimator="centered",
        group="ablation",
    ),
    Variant(
        "r128-policy-lr0.5",
        "R=128 policy, lr x0.5",
        rank=128,
        include=NO_FC,
        estimator="centered",
        lr_scale=0.5,
        group="learning rate",
    ),
    Variant("exact-lr0.5", "exact, lr x0.5", lr_scale=0.5, group="learning rate"),
    Variant(
        "r128-policy-lr2",
        "R=128 policy, lr x2",
        rank=128,
        include=NO_FC,
        estimator="centered",
        lr_scale=2.0,
        group="learning rate",
    ),
    Variant("exact-lr2", "exact, lr x2", lr_scale=2.0, group="learning rate"),
]


def variant(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise SystemExit(f"unknown variant {name!r}; known: {', '.join(v.name for v in VARIANTS)}")


# --------------------------------------------------------------------------- the worker side


def build(v: Variant, seed: int) -> tuple[Any, Any, Any]:
    """Model, optimizer and schedule for `v`, initialised from `seed`."""
    import torch

    from sketch_ops import sketch_model
    from trainer.config import OptimConfig
    from trainer.model import GPT, GPTConfig
    from trainer.optim import WarmupCosine, build_optimizer

    torch.manual_seed(seed)
    model = GPT(
        GPTConfig(
            d_model=D_MODEL,
            n_layers=N_LAYERS,
            n_heads=N_HEADS,
            seq_len=SEQ,
            checkpoint_blocks=v.checkpoint,
        )
    )
    include = list(v.include) if v.include else None
    if v.rank:
        sketch_model(model, rank=v.rank, include=include, estimator=v.estimator)
    elif v.budget_rank:
        # The bytes uniform R = budget_rank would spend on the same layers, shared out per layer.
        widths = [m.in_features for n, m in model.named_modules() if _selected(n, m, include)]
        budget = v.budget_rank * sum(widths) * 4
        sketch_model(
            model, memory_budget=budget, rows=N_ROWS, include=include, estimator=v.estimator
        )
    optim_cfg = OptimConfig(lr=LR * v.lr_scale, warmup_steps=WARMUP)
    optimizer = build_optimizer(model, optim_cfg)
    return model, optimizer, WarmupCosine(optimizer, optim_cfg, v.steps)


def _selected(name: str, module: Any, include: list[str] | None) -> bool:
    import fnmatch

    from torch import nn

    return (
        type(module) is nn.Linear
        and bool(name)
        and (include is None or any(fnmatch.fnmatchcase(name, p) for p in include))
    )


def train_step(
    model: Any, optimizer: Any, schedule: Any, tokens: Any, seed: int, step: int
) -> float:
    from sketch_ops import sketch_seed

    with sketch_seed(seed, step, 0):
        loss = model.loss(tokens)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    schedule.step()
    return float(loss.detach())


def val_indices(size: int, count: int) -> list[int]:
    """A fixed, evenly spread subset of the val split (it is ordered by file)."""
    count = min(count, size)
    return [i * size // count for i in range(count)]


def evaluate(model: Any, val: Any, indices: list[int]) -> float:
    import torch

    model.eval()
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(indices), 16):
            chunk = indices[start : start + 16]
            total += float(model.loss(val.batch(chunk))) * len(chunk)
    model.train()
    return total / len(indices)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set


def _saved_bytes(model: Any, tokens: Any, seed: int) -> int:
    """Bytes of the distinct storages autograd saves for one microbatch's backward."""
    import torch

    from sketch_ops import sketch_seed

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with sketch_seed(seed, 10**6, 0), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(tokens)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def probe(v: Variant) -> dict[str, Any]:
    """Step peak memory, saved bytes and step time of `v` (random tokens, seed 0)."""
    import torch

    torch.set_num_threads(1)
    model, optimizer, schedule = build(v, 0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (v.microbatch, SEQ + 1), generator=gen)
    saved = _saved_bytes(model, tokens, 0)
    for step in range(2):  # optimizer state and lazy buffers exist after this
        train_step(model, optimizer, schedule, tokens, 0, step)
    rest = _status_kib("VmRSS")
    _reset_peak()
    times = []
    for step in range(2, 9):
        start = time.perf_counter()
        train_step(model, optimizer, schedule, tokens, 0, step)
        times.append(time.perf_counter() - start)
    return {
        "step_peak_mib": (_status_kib("VmHWM") - rest) / 1024,
        "saved_mib": saved / 2**20,
        "step_s": statistics.median(times),
    }


def train(v: Variant, seed: int) -> dict[str, Any]:
    """Train `v` from `seed`; the validation curve, final loss, peak memory and timing."""
    import torch

    from data_state import ResumableLoader, TokenDataset

    torch.set_num_threads(1)
    train_set, val_set = TokenDataset(str(DATA), "train"), TokenDataset(str(DATA), "val")
    curve_idx = val_indices(len(val_set), EVAL_SEQS)
    final_idx = val_indices(len(val_set), FINAL_EVAL_SEQS)
    model, optimizer, schedule = build(v, seed)
    loader = ResumableLoader(
        train_set, global_batch=v.microbatch, microbatch_size=v.microbatch, seed=seed
    )
    curve: list[tuple[int, float]] = [(0, evaluate(model, val_set, curve_idx))]
    losses: list[float] = []
    train_s = 0.0
    _reset_peak()
    for step in range(v.steps):
        (mb,) = loader.next_step()
        start = time.perf_counter()
        losses.append(train_step(model, optimizer, schedule, mb.tokens, seed, step))
        train_s += time.perf_counter() - start
        loader.advance()
        if (step + 1) % EVAL_EVERY == 0 or step + 1 == v.steps:
            curve.append((step + 1, evaluate(model, val_set, curve_idx)))
    loader.close()
    return {
        "variant": v.name,
        "seed": seed,
        "steps": v.steps,
        "microbatch": v.microbatch,
        "tokens": v.steps * v.microbatch * SEQ,
        "val_curve": curve,
        "train_loss": losses,
        "final_val": evaluate(model, val_set, final_idx),
        "peak_rss_mib": _status_kib("VmHWM") / 1024,
        "train_s": train_s,
    }


# --------------------------------------------------------------------------- the driver side


def _spawn(args: list[str], *, exact_rss: bool = False) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(MALLOC_ENV if exact_rss else {})}
    return subprocess.Popen(
        [sys.executable, __file__, *args], env=env, stdout=subprocess.PIPE, text=True
    )


class CpuLock:
    """`flock` on CPU_LOCK, held while benchmark processes run (see the module docstring)."""

    def __enter__(self) -> CpuLock:
        self._file = open(CPU_LOCK, "w")  # noqa: SIM115 - released in __exit__
        fcntl.flock(self._file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()
        time.sleep(2)  # let a waiting benchmark of someone else take its turn


def ensure_corpus() -> None:
    from data_state import prepare_corpus

    if not (DATA / "dataset.json").exists():
        # seq_len + 1 tokens per sequence: SEQ inputs and SEQ shifted targets.
        prepare_corpus(None, str(DATA), seq_len=SEQ + 1, max_bytes=CORPUS_BYTES)


def run_probes(variants: list[Variant]) -> dict[str, dict[str, Any]]:
    path = RUNS / "probe.json"
    probes: dict[str, dict[str, Any]] = json.loads(path.read_text()) if path.exists() else {}
    todo = [v for v in variants if v.name not in probes]
    if not todo:
        return probes
    exact = variant("exact")
    with CpuLock():
        for v in todo:
            for name, spec in ((v.name, v), (f"{v.name}@exact", exact)):
                # Memory with glibc giving memory back at once (which slows steps), time without.
                memory, timing = (_probe_once(name, spec, exact_rss=flag) for flag in (True, False))
                probes[name] = {**memory, "step_s": timing["step_s"]}
            probes[v.name]["step_time_ratio"] = (
                probes[v.name]["step_s"] / probes[f"{v.name}@exact"]["step_s"]
            )
            print(f"probe {v.name}: {probes[v.name]}", flush=True)
            path.write_text(json.dumps(probes, indent=1))
    return probes


def _probe_once(name: str, spec: Variant, *, exact_rss: bool) -> dict[str, Any]:
    proc = _spawn(["--probe", json.dumps(dataclasses.asdict(spec))], exact_rss=exact_rss)
    out, _ = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"probe of {name} failed (exit {proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def run_training(variants: list[Variant], seeds: tuple[int, ...]) -> None:
    jobs = [(v, s) for v in variants for s in seeds if not (RUNS / f"{v.name}-s{s}.json").exists()]
    for i in range(0, len(jobs), 2):
        batch = jobs[i : i + 2]
        with CpuLock():
            procs = [
                (v, s, _spawn(["--train", json.dumps(dataclasses.asdict(v)), "--seed", str(s)]))
                for v, s in batch
            ]
            for v, s, proc in procs:
                out, _ = proc.communicate()
                if proc.returncode:
                    print(f"run {v.name} seed {s} failed (exit {proc.returncode})", flush=True)
                    continue
                result = json.loads(out.strip().splitlines()[-1])
                (RUNS / f"{v.name}-s{s}.json").write_text(json.dumps(result))
                print(
                    f"[{i + len(batch)}/{len(jobs)}] {v.name} seed {s}: "
                    f"val {result['final_val']:.4f} ({result['train_s']:.0f} s)",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated variant names")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    parser.add_argument("--report", action="store_true", help="only aggregate saved runs")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--train", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(Variant(**json.loads(args.probe)))))
        return
    if args.train:
        print(json.dumps(train(Variant(**json.loads(args.train)), args.seed)))
        return
    RUNS.mkdir(parents=True, exist_ok=True)
    chosen = [variant(n) for n in args.only.split(",") if n] or VARIANTS
    seeds = tuple(int(s) for s in args.seeds.split(","))
    if not args.report:
        ensure_corpus()
        run_probes(chosen)
        run_training(chosen, seeds)


if __name__ == "__main__":
    main()
