"""BASIS quality on real text: what sketching costs in validation loss, and what it buys (issue 6).

The built-in GPT (d_model 256, 4 layers, 4 heads, seq_len 256) is trained on the embedded
corpus (Python's standard library, prepared by `data_state.prepare_corpus`) through the
project's own loader, with the project's AdamW and warmup-cosine schedule. A microbatch of 8
sequences of 256 predicted tokens gives n = 2048 rows per linear layer. Every configuration
runs with several seeds (model init, data order and sketches all follow the seed) and is
reported as mean ± std of the final validation loss over a fixed held-out set.

Configurations (`VARIANTS`): exact backprop, full activation checkpointing, exact backprop with
the MLP recomputed (the exact baseline at BASIS's memory), BASIS as docs/design.md §4 writes it at
several R, the ways of closing the gap — which layers are sketched, per-layer R from a memory
budget, the mean-centred estimator, the learning rate — and a speed mode (every block linear
sketched, nothing recomputed). Comparisons:

1. equal steps and batch: every variant trains STEPS steps of one microbatch of 8;
2. equal peak memory (at most exact backprop's step peak), at exact backprop's wall time:
   the BASIS default spends the memory it saves on a larger microbatch (the largest whose
   measured step peak fits; also run for exact's number of tokens), and the speed mode spends
   the time it saves on more steps (steps = STEPS / its step-time ratio); exact backprop given
   those extra steps is the reference (`derived_variants`).

Phases, each resumable (a finished run is a JSON file and is not redone):
- probe: per variant, in fresh processes on one thread: the step's peak memory above the
  resting process (`VmHWM` after resetting it, with glibc returning freed memory at once) and
  the bytes autograd saves for backward; then its step time and exact backprop's, alternating
  steps in one process (CPU time), whose ratio sizes the equal-wall-time runs;
- train: (variant, seed) runs, two at a time on one thread each (their measured training time
  is reported too, as a check on "equal wall time");
- report: `benchmarks/results/sketch_quality.json`, `sketch_quality.png` (validation-loss
  curves with ±std bands; memory vs quality) and Markdown tables on stdout.

    python benchmarks/sketch_quality.py              # everything (~3 h on 2 cores)
    python benchmarks/sketch_quality.py --only exact,basis-r128 --seeds 0
    python benchmarks/sketch_quality.py --only speed-r128-time   # a derived run, once probed
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
SEEDS = (0, 1, 2, 3, 4)  # a variant trains with the first `Variant.seeds` of them
MEMORY_CANDIDATES = (12, 14, 16, 20, 24)  # microbatches tried for the equal-memory comparison
# glibc: serve every allocation above 64 KiB by mmap and give it back on free, so the resident
# set follows live memory and VmHWM measures the real peak (not malloc's cached arenas).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One training configuration. rank 0 = exact backprop."""

    name: str
    label: str
    rank: int = 0
    include: tuple[str, ...] | None = None  # sketch_model's globs; None = every nn.Linear
    estimator: str = "basis"
    budget_rank: int = 0  # > 0: per-layer ranks from the budget uniform R = budget_rank uses
    checkpoint: bool = False
    mlp_recompute: str = "auto"  # trainer.config.ModelConfig.mlp_recompute
    fuse_norms: bool = True  # trainer.config.ModelConfig.fuse_norms
    lr_scale: float = 1.0
    microbatch: int = MICROBATCH
    steps: int = STEPS
    seeds: int = 3  # how many of SEEDS it trains with
    group: str = "equal steps"


ALL_LINEARS = ("blocks.*.attn.qkv", "blocks.*.attn.proj", "blocks.*.mlp.*", "lm_head")
BLOCK_LINEARS = ("blocks.*.attn.*", "blocks.*.mlp.*")
NO_FC = ("blocks.*.attn.*", "blocks.*.mlp.proj", "lm_head")  # the fused MLP keeps fc's input
MLP_HEAD = ("blocks.*.mlp.*", "lm_head")
OLD_POLICY = ("blocks.*.attn.*", "blocks.*.mlp.proj")  # the default before the norm fusion
POLICY = ("blocks.*.mlp.proj",)  # trainer.model.SKETCH_LAYERS
VARIANTS: list[Variant] = [
    Variant("exact", "exact backprop", group="baseline"),
    # Exact gradients by construction (torch's checkpointing; the recomputed MLP is checked by
    # tests/test_sketch_fusions.py): each seed must end at exact's loss for that seed, which
    # checks the benchmark as much as them.
    Variant("ckpt", "activation checkpointing", checkpoint=True, group="baseline"),
    Variant("exact-recompute", "exact, MLP recomputed", mlp_recompute="always", group="baseline"),
    Variant("basis-r512", "BASIS R=n/4 (512)", rank=512, include=ALL_LINEARS),
    Variant("basis-r128", "BASIS R=n/16 (128)", rank=128, include=ALL_LINEARS),
    Variant("basis-r32", "BASIS R=n/64 (32)", rank=32, include=ALL_LINEARS),
    # Ablations at R = n/16, one change at a time, then combined.
    Variant(
        "r128-mlp-head", "R=128, MLP + head only", rank=128, include=MLP_HEAD, group="ablation"
    ),
    Variant(
        "r128-centered",
        "R=128, centred estimator",
        rank=128,
        include=ALL_LINEARS,
        estimator="centered",
        group="ablation",
    ),
    Variant(
        "r128-old-policy",
        "R=128, centred, attention + MLP proj (previous default)",
        rank=128,
        include=OLD_POLICY,
        estimator="centered",
        group="ablation",
    ),
    Variant(
        "r128-mlp-proj",
        "R=128, centred, MLP proj only (default)",
        rank=128,
        include=POLICY,
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
    # Speed: every block linear sketched and no MLP recompute, so each sketched layer saves its
    # weight-gradient matmul and nothing is recomputed (GELU keeps its input).
    Variant(
        "speed-r128",
        "R=128, all block linears, no recompute",
        rank=128,
        include=BLOCK_LINEARS,
        estimator="centered",
        mlp_recompute="never",
        group="speed",
    ),
]


def with_lr(v: Variant, scale: float) -> Variant:
    """`v` at `scale` × its peak learning rate (same schedule); named `<v>-lr<scale>`, the
    suffix probe_key drops, since a learning rate changes neither memory nor step time."""
    return dataclasses.replace(
        v,
        name=f"{v.name}-lr{scale:g}",
        label=f"{v.label}, lr x{scale:g}",
        lr_scale=scale,
        group="learning rate",
    )


MEMORY_BASE = "r128-mlp-proj"  # the BASIS default that spends its savings on the batch
# The learning-rate interaction: the default and exact backprop at other peak learning rates
# (x0.25 only for the default, whose best is lower than exact's).
LR_SCALES = {MEMORY_BASE: (0.25, 0.5, 2.0), "exact": (0.5, 2.0)}
VARIANTS += [with_lr(v, scale) for v in VARIANTS for scale in LR_SCALES.get(v.name, ())]
HEADLINE = ("exact", "basis-r128", MEMORY_BASE)  # trained first: the targets need them

# Probed for memory and time only: its values and gradients are exact backprop's.
PROBE_ONLY = [
    Variant(
        "exact-unfused",
        "exact, plain modules (no norm fusion)",
        fuse_norms=False,
        mlp_recompute="never",
        group="baseline",
    )
]


def variant(name: str) -> Variant:
    for v in VARIANTS + PROBE_ONLY:
        if v.name == name:
            return v
    raise SystemExit(f"unknown variant {name!r}; known: {', '.join(v.name for v in VARIANTS)}")


# --------------------------------------------------------------------------- the worker side


def build(v: Variant, seed: int) -> tuple[Any, Any, Any]:
    """Model, optimizer and schedule for `v`, initialised from `seed`."""
    import torch

    from sketch_ops import sketch_model
    from trainer.config import ModelConfig, OptimConfig
    from trainer.model import GPT
    from trainer.optim import WarmupCosine, build_optimizer

    torch.manual_seed(seed)
    model = GPT(
        ModelConfig(
            d_model=D_MODEL,
            n_layers=N_LAYERS,
            n_heads=N_HEADS,
            checkpoint_blocks=v.checkpoint,
            mlp_recompute=v.mlp_recompute,
            fuse_norms=v.fuse_norms,
        ),
        seq_len=SEQ,
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
    # The warmup is the same fraction of every run (runs of the memory comparison are shorter).
    warmup = max(1, round(WARMUP * v.steps / STEPS))
    optim_cfg = OptimConfig(lr=LR * v.lr_scale, warmup_steps=warmup)
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
    from sketch_ops import sketch_seed
    from sketch_ops.memory import saved_bytes

    with sketch_seed(seed, 10**6, 0):
        saved = saved_bytes(lambda: model.loss(tokens), model)
    model.zero_grad(set_to_none=True)
    return saved


def probe(v: Variant) -> dict[str, Any]:
    """Step peak memory and saved bytes of `v` (random tokens, seed 0). Run with MALLOC_ENV."""
    import torch

    torch.set_num_threads(1)
    model, optimizer, schedule = build(v, 0)
    tokens = _probe_tokens(v)
    saved = _saved_bytes(model, tokens, 0)
    for step in range(2):  # optimizer state and lazy buffers exist after this
        train_step(model, optimizer, schedule, tokens, 0, step)
    rest = _status_kib("VmRSS")
    _reset_peak()
    for step in range(2, 4):
        train_step(model, optimizer, schedule, tokens, 0, step)
    return {"step_peak_mib": (_status_kib("VmHWM") - rest) / 1024, "saved_mib": saved / 2**20}


TIME_ROUNDS = 12


def time_probe(v: Variant) -> dict[str, Any]:
    """`v`'s step time and exact backprop's, measured in one process, alternating steps, as CPU
    time of the one compute thread (steadier than wall time on a shared machine). Their ratio
    is what equal-wall-time runs are sized by."""
    import torch

    torch.set_num_threads(1)
    runs = [(*build(spec, 0), _probe_tokens(spec)) for spec in (v, variant("exact"))]
    times: list[list[float]] = [[], []]
    for step in range(2 + TIME_ROUNDS):
        order = (0, 1) if step % 2 else (1, 0)  # ABBA: neither always runs first
        for i in order:
            model, optimizer, schedule, tokens = runs[i]
            start = time.thread_time()
            train_step(model, optimizer, schedule, tokens, 0, step)
            if step >= 2:  # the first two steps create optimizer state and lazy buffers
                times[i].append(time.thread_time() - start)
    step_s, exact_s = (statistics.median(t) for t in times)
    return {"step_s": step_s, "exact_step_s": exact_s, "step_time_ratio": step_s / exact_s}


def _probe_tokens(v: Variant) -> Any:
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (v.microbatch, SEQ + 1), generator=gen)


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
    """Memory and time probes of every variant not probed yet, each in a fresh process."""
    path = RUNS / "probe.json"
    probes: dict[str, dict[str, Any]] = json.loads(path.read_text()) if path.exists() else {}
    todo = [v for v in variants if v.name not in probes and probe_key(v) == v.name]
    with CpuLock():
        for v in todo:
            # Memory with glibc giving memory back at once (which slows steps), time without.
            memory = _probe_once("--probe", v, exact_rss=True)
            probes[v.name] = {**memory, **_probe_once("--time", v, exact_rss=False)}
            print(f"probe {v.name}: {probes[v.name]}", flush=True)
            path.write_text(json.dumps(probes, indent=1))
    return probes


def _probe_once(mode: str, spec: Variant, *, exact_rss: bool) -> dict[str, Any]:
    proc = _spawn([mode, json.dumps(dataclasses.asdict(spec))], exact_rss=exact_rss)
    out, _ = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{mode} probe of {spec.name} failed (exit {proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def run_training(variants: list[Variant], seeds: tuple[int, ...] | None = None) -> None:
    """Train every (variant, seed) not on disk yet: `seeds`, or each variant's own."""
    jobs = [
        (v, s)
        for v in variants
        for s in (seeds if seeds is not None else SEEDS[: v.seeds])
        if not (RUNS / f"{v.name}-s{s}.json").exists()
    ]
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


# --------------------------------------------------------------------------- gradient error

GRAD_STEPS, GRAD_DRAWS = 100, 8


def grad_error() -> dict[str, dict[str, float]]:
    """Relative squared error ‖dW_est − dW‖² / ‖dW‖² of each estimator, per layer, averaged
    over GRAD_DRAWS sketches, on one real microbatch after GRAD_STEPS exact training steps.

    Besides the library's estimators ("basis", "centered") it measures two candidates from the
    literature that keep the O(R·N) bound, implemented here only (kept out of the library
    unless they help): "top-rows" keeps the R/2 rows of largest ‖x_i‖ exactly and sketches the
    rest into R/2 buckets (as column-row-sampling methods keep their heaviest pairs), and
    "seq-centered" centres each sequence on its own mean (b means instead of one).
    """
    import torch

    from data_state import ResumableLoader, TokenDataset
    from sketch_ops import reference
    from sketch_ops.seeds import make_plan

    torch.set_num_threads(1)
    # Unfused norms: the forward hooks below must see every linear layer's input.
    model, optimizer, schedule = build(dataclasses.replace(variant("exact"), fuse_norms=False), 0)
    loader = ResumableLoader(
        TokenDataset(str(DATA), "train"),
        global_batch=MICROBATCH,
        microbatch_size=MICROBATCH,
        seed=0,
    )
    for step in range(GRAD_STEPS):
        (mb,) = loader.next_step()
        train_step(model, optimizer, schedule, mb.tokens, 0, step)
        loader.advance()
    (mb,) = loader.next_step()
    loader.close()
    pairs: dict[str, list[torch.Tensor]] = {}

    def capture(name: str) -> Any:
        def hook(module: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
            pairs[name] = [inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()]
            output.register_hook(lambda g: pairs[name].append(g.reshape(-1, g.shape[-1]).double()))

        return hook

    for name, module in model.named_modules():
        if _selected(name, module, None):
            module.register_forward_hook(capture(name))
    model.loss(mb.tokens).backward()

    def scaled(sketch: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
        return sketch * reference.invariant_scale(sq, sketch)

    def estimate(kind: str, x: torch.Tensor, dy: torch.Tensor, rank: int, seed: int) -> Any:
        n = x.shape[0]
        if kind == "top-rows":
            keep = x.norm(dim=1).topk(rank // 2).indices
            rest = torch.ones(n, dtype=torch.bool)
            rest[keep] = False
            exact_part = dy[keep].T @ x[keep]
            plan = make_plan(int(rest.sum()), rank - rank // 2, seed)
            sx, sdy = reference.bucket_sum(x[rest], plan), reference.bucket_sum(dy[rest], plan)
            return exact_part + scaled(*sdy).T @ scaled(*sx)
        plan = make_plan(n, rank, seed)
        if kind == "seq-centered":
            groups = torch.arange(n) // SEQ
            x_means = torch.zeros(n // SEQ, x.shape[1], dtype=x.dtype).index_add_(0, groups, x)
            dy_means = torch.zeros(n // SEQ, dy.shape[1], dtype=x.dtype).index_add_(0, groups, dy)
            x_means, dy_means = x_means / SEQ, dy_means / SEQ
            xc, dyc = x - x_means[groups], dy - dy_means[groups]
            sx, sdy = reference.bucket_sum(xc, plan), reference.bucket_sum(dyc, plan)
            return scaled(*sdy).T @ scaled(*sx) + SEQ * dy_means.T @ x_means
        sx, sdy = reference.bucket_sum(x, plan), reference.bucket_sum(dy, plan)
        if kind == "basis":
            return scaled(*sdy).T @ scaled(*sx)
        counts = reference.signed_counts(plan).double()
        x_mean, dy_mean = x.mean(0), dy.mean(0)
        sx = reference.center(*sx, x_mean, counts, n)
        sdy = reference.center(*sdy, dy_mean, counts, n)
        return scaled(*sdy).T @ scaled(*sx) + reference.mean_outer(dy_mean, x_mean, n)

    table: dict[str, dict[str, float]] = {}
    for kind in ("basis", "centered", "seq-centered", "top-rows"):
        for rank in (N_ROWS // 16, N_ROWS // 64):
            row = {}
            for name, (x, dy) in pairs.items():
                exact = dy.T @ x
                errors = [
                    float((estimate(kind, x, dy, rank, seed) - exact).square().sum())
                    for seed in range(GRAD_DRAWS)
                ]
                row[name] = statistics.fmean(errors) / float(exact.square().sum())
            row["mean"] = statistics.fmean(row.values())
            table[f"{kind} R={rank}"] = row
            print(f"grad error {kind} R={rank}: mean {row['mean']:.3f}", flush=True)
    return table


# --------------------------------------------------------------------------- equal memory

SPEED_BASES = ("speed-r128",)  # BASIS spending saved time on steps
# "At most exact's step peak" allows this much over it: peaks are measured to about 1 %, and a
# variant that keeps what exact backprop keeps plus its small sketches should still count.
MEMORY_TOLERANCE = 1.02
# The learning rate sketched training does best with here, relative to exact backprop's (the
# "learning rate" runs: x0.5 beats x1 and x2 for BASIS, while exact is best at x1).
SKETCH_LR_SCALE = 0.5


def derived_variants(probes: dict[str, dict[str, Any]]) -> list[Variant]:
    """The runs whose shape depends on the probes, all at most exact backprop's step peak:

    - MEMORY_BASE at the largest candidate microbatch that fits under exact's peak at
      MICROBATCH, trained for exact's wall time and for exact's number of tokens (the issue's
      "spend the saved memory on a larger microbatch");
    - each SPEED_BASES variant at MICROBATCH, trained for exact's wall time (more steps), at
      exact's learning rate and at SKETCH_LR_SCALE of it;
    - exact backprop trained for the most steps of those, to show what the steps alone buy.
    Exact's wall time is STEPS × its step time; the others' step time relative to exact's
    comes from probes taken side by side."""
    exact_peak = probes["exact"]["step_peak_mib"] * MEMORY_TOLERANCE
    derived: list[Variant] = []
    base = variant(MEMORY_BASE)
    fits = [
        m
        for m in MEMORY_CANDIDATES
        if f"{MEMORY_BASE}-mb{m}" in probes
        and probes[f"{MEMORY_BASE}-mb{m}"]["step_peak_mib"] <= exact_peak
    ]
    if fits:
        mb = max(fits)
        ratio = probes[f"{MEMORY_BASE}-mb{mb}"]["step_time_ratio"]
        derived += [
            dataclasses.replace(
                base,
                name=f"mem-time-mb{mb}",
                label=f"{base.label}, microbatch {mb}, exact's wall time",
                microbatch=mb,
                steps=round(STEPS / ratio),
                seeds=3,
                group="equal memory",
            ),
            dataclasses.replace(
                base,
                name=f"mem-tokens-mb{mb}",
                label=f"{base.label}, microbatch {mb}, exact's tokens",
                microbatch=mb,
                steps=STEPS * MICROBATCH // mb,
                seeds=3,
                group="equal memory",
            ),
        ]
    most_steps = 0
    for name in SPEED_BASES:
        speed = variant(name)
        if name not in probes or probes[name]["step_peak_mib"] > exact_peak:
            continue
        steps = round(STEPS / probes[name]["step_time_ratio"])
        most_steps = max(most_steps, steps)
        derived += [
            dataclasses.replace(
                base,
                name=f"{base.name}-time",
                label=f"{base.label}, exact's wall time",
                steps=steps,
                group="equal memory",
            )
            for base in (speed, with_lr(speed, SKETCH_LR_SCALE))
        ]
    if most_steps > STEPS:
        derived.append(
            dataclasses.replace(
                variant("exact"),
                name=f"exact-steps{most_steps}",
                label=f"exact backprop, {most_steps} steps (more wall time)",
                steps=most_steps,
                group="reference",
            )
        )
    return derived


def probe_candidates() -> dict[str, dict[str, Any]]:
    """Probe MEMORY_BASE at growing MEMORY_CANDIDATES microbatches until one no longer fits
    under exact backprop's step peak; the probes, with those candidates added."""
    base = variant(MEMORY_BASE)
    probes = run_probes([])
    for m in MEMORY_CANDIDATES:
        probes = run_probes([dataclasses.replace(base, name=f"{MEMORY_BASE}-mb{m}", microbatch=m)])
        if probes[f"{MEMORY_BASE}-mb{m}"]["step_peak_mib"] > (
            probes["exact"]["step_peak_mib"] * MEMORY_TOLERANCE
        ):
            break
    return probes


# --------------------------------------------------------------------------- report


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def saved_runs(name: str) -> list[dict[str, Any]]:
    """The saved seeds of one variant. The digit after "-s" keeps "exact" from also
    collecting "exact-steps356"."""
    return [json.loads(p.read_text()) for p in sorted(RUNS.glob(f"{name}-s[0-9]*.json"))]


def summarize(variants: list[Variant], probes: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant with runs: final val mean ± std, difference to exact and whether it
    is outside the noise (|Δ| > 2 standard errors), memory and time from the probes."""
    runs = {v.name: saved_runs(v.name) for v in variants}
    exact_vals = [r["final_val"] for r in runs.get("exact", [])]
    rows = []
    for v in variants:
        if not runs[v.name]:
            continue
        vals = [r["final_val"] for r in runs[v.name]]
        mean, std = _mean_std(vals)
        row: dict[str, Any] = {
            "variant": v.name,
            "label": v.label,
            "group": v.group,
            "seeds": len(vals),
            "steps": v.steps,
            "microbatch": v.microbatch,
            "final_val": vals,
            "val_mean": mean,
            "val_std": std,
            "peak_rss_mib": statistics.fmean(r["peak_rss_mib"] for r in runs[v.name]),
        }
        if exact_vals and v.name != "exact":
            e_mean, e_std = _mean_std(exact_vals)
            se = (std**2 / len(vals) + e_std**2 / len(exact_vals)) ** 0.5
            row["delta_pct"] = 100 * (mean - e_mean) / e_mean
            row["significant"] = abs(mean - e_mean) > 2 * se
        exact_runs = runs.get("exact", [])
        if exact_runs and v.name != "exact":
            per_step = statistics.fmean(r["train_s"] / r["steps"] for r in runs[v.name])
            exact_step = statistics.fmean(r["train_s"] / r["steps"] for r in exact_runs)
            row["run_time_ratio"] = per_step * v.steps / (exact_step * STEPS)
        probe_name = probe_key(v)
        if probe_name in probes:
            p = probes[probe_name]
            row.update(
                step_peak_mib=p["step_peak_mib"],
                saved_mib=p["saved_mib"],
                step_time_ratio=p.get("step_time_ratio"),
                memory_ratio=p["step_peak_mib"] / probes["exact"]["step_peak_mib"],
            )
        rows.append(row)
    return rows


def probe_key(v: Variant) -> str:
    """The probe that measured `v`'s step: its own, or its base's for a derived variant."""
    if v.name.startswith("mem-"):
        return f"{MEMORY_BASE}-mb{v.microbatch}"
    if v.name.startswith("exact-steps"):
        return "exact"
    # More steps ("-time") or another learning rate ("-lr…", with_lr) change neither the
    # step's memory nor its time.
    return v.name.removesuffix("-time").split("-lr")[0]


def markdown(rows: list[dict[str, Any]]) -> str:
    """The report's table (benchmarks/reports/2026-12-03-sketch-quality.md). Run time is the
    training time of the runs themselves (two at a time on the two cores) relative to exact's
    300 steps: the check on "equal wall time"."""
    lines = [
        "| configuration | steps × microbatch | val loss (mean ± std) | vs exact | step peak MiB "
        "(× exact) | step time × exact | run time × exact |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        delta = ""
        if "delta_pct" in r:
            delta = f"{r['delta_pct']:+.1f} %" + ("" if r["significant"] else " (noise)")
        mem = f"{r['step_peak_mib']:.0f} ({r['memory_ratio']:.2f})" if "step_peak_mib" in r else ""
        time_ratio = f"{r['step_time_ratio']:.2f}" if r.get("step_time_ratio") else ""
        run_time = f"{r['run_time_ratio']:.2f}" if "run_time_ratio" in r else ""
        lines.append(
            f"| {r['label']} | {r['steps']} × {r['microbatch']} | {r['val_mean']:.3f} ± "
            f"{r['val_std']:.3f} (n={r['seeds']}) | {delta} | {mem} | {time_ratio} | {run_time} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (curves, scatter) = plt.subplots(1, 2, figsize=(13, 5))
    shown = {"exact", "basis-r128", "basis-r32", MEMORY_BASE, "speed-r128"}
    shown |= {r["variant"] for r in rows if r["group"] in ("equal memory", "reference")}
    for r in rows:
        if r["variant"] not in shown:
            continue
        runs = saved_runs(r["variant"])
        tokens_per_step = r["microbatch"] * SEQ
        steps = np.array([s for s, _ in runs[0]["val_curve"]])
        vals = np.array([[v for _, v in run["val_curve"]] for run in runs])
        mean, std = vals.mean(0), vals.std(0)
        x = steps * tokens_per_step / 1e3
        curves.plot(x, mean, label=r["label"])
        curves.fill_between(x, mean - std, mean + std, alpha=0.2)
    curves.set(xlabel="training tokens (thousands)", ylabel="validation loss", ylim=(2.3, 3.3))
    curves.set_title("Validation loss (mean ± std over seeds)")
    curves.legend(fontsize=7)
    for r in rows:
        if "step_peak_mib" not in r:
            continue
        scatter.errorbar(r["step_peak_mib"], r["val_mean"], yerr=r["val_std"], fmt="o")
        scatter.annotate(r["variant"], (r["step_peak_mib"], r["val_mean"]), fontsize=6)
    scatter.set(
        xlabel="training-step peak memory above the resting process (MiB)",
        ylabel="final validation loss",
    )
    scatter.set_title("Memory vs quality")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated variant names")
    parser.add_argument("--seeds", default="", help="comma-separated; default: each variant's")
    parser.add_argument("--report", action="store_true", help="only aggregate saved runs")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--time", help=argparse.SUPPRESS)
    parser.add_argument("--train", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(Variant(**json.loads(args.probe)))))
        return
    if args.time:
        print(json.dumps(time_probe(Variant(**json.loads(args.time)))))
        return
    if args.train:
        print(json.dumps(train(Variant(**json.loads(args.train)), args.seed)))
        return
    RUNS.mkdir(parents=True, exist_ok=True)
    probe_path = RUNS / "probe.json"
    if args.only:  # derived variants can be named too, once the probes that shape them exist
        saved = json.loads(probe_path.read_text()) if probe_path.exists() else {}
        derived = {v.name: v for v in derived_variants(saved)} if "exact" in saved else {}
        chosen = [derived[n] if n in derived else variant(n) for n in args.only.split(",") if n]
    else:
        chosen = VARIANTS
    seeds = tuple(int(s) for s in args.seeds.split(",")) if args.seeds else None
    if not args.report:
        ensure_corpus()
        probes = run_probes(chosen + ([] if args.only else PROBE_ONLY))
        # Headline figures first (the two targets), refinements after: each phase resumes.
        run_training([v for v in chosen if v.name in HEADLINE], seeds)
        if not args.only:
            run_training(derived_variants(probe_candidates()), seeds)
        run_training([v for v in chosen if v.group != "learning rate"], seeds)
        grad_path = RUNS / "grad_error.json"
        if not args.only and not grad_path.exists():
            with CpuLock():
                grad_path.write_text(json.dumps(grad_error(), indent=1))
        run_training([v for v in chosen if v.group == "learning rate"], seeds)
    probes = json.loads(probe_path.read_text())
    everything = VARIANTS + derived_variants(probes)
    rows = summarize(everything, probes)
    grad_path = RUNS / "grad_error.json"
    result = {
        "setup": {
            "d_model": D_MODEL,
            "n_layers": N_LAYERS,
            "seq_len": SEQ,
            "microbatch": MICROBATCH,
            "rows_per_microbatch": N_ROWS,
            "steps": STEPS,
            "lr": LR,
            "warmup": WARMUP,
            "corpus_bytes": CORPUS_BYTES,
            "final_eval_sequences": FINAL_EVAL_SEQS,
        },
        "rows": rows,
        "probes": probes,
        "grad_error": json.loads(grad_path.read_text()) if grad_path.exists() else None,
    }
    (RESULTS / "sketch_quality.json").write_text(json.dumps(result, indent=1))
    plot(rows, RESULTS / "sketch_quality.png")
    print(markdown(rows))
    print(
        "\n| probed only | step peak MiB (× exact) | saved for backward MiB | step time × exact |"
    )
    print("|---|---|---|---|")
    for v in PROBE_ONLY:
        if v.name in probes:
            p = probes[v.name]
            ratio = p["step_peak_mib"] / probes["exact"]["step_peak_mib"]
            print(
                f"| {v.label} | {p['step_peak_mib']:.0f} ({ratio:.2f}) | {p['saved_mib']:.0f} | "
                f"{p['step_time_ratio']:.2f} |"
            )
    if result["grad_error"]:
        print("\n| estimator | mean relative dW error over layers |\n|---|---|")
        for name, row in result["grad_error"].items():
            print(f"| {name} | {row['mean']:.3f} |")
    print(f"wrote {RESULTS / 'sketch_quality.json'} and sketch_quality.png")


if __name__ == "__main__":
    main()
