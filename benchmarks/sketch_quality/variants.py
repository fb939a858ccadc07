"""The configurations of `benchmarks/sketch_quality/run.py`: the model and run constants, the
variants, and the runs whose shape the probes decide.

Contract: `VARIANTS` (trained), `PROBE_ONLY` (memory and time only), `variant(name)`;
`derived_variants(probes)` the equal-memory runs sized from the probes; `probe_key(v)` the
probe that measured `v`'s step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from benchmarks.common import RESULTS, malloc_env
from benchmarks.common_training import QUALITY_CORPUS, QUALITY_CORPUS_BYTES, QUALITY_SEQ

RUNS = RESULTS / "sketch_quality"
DATA = QUALITY_CORPUS

D_MODEL, N_LAYERS, N_HEADS, SEQ = 256, 4, 4, QUALITY_SEQ
MICROBATCH = 8
N_ROWS = MICROBATCH * SEQ  # 2048 rows per linear layer per microbatch
STEPS = 300
LR, WARMUP = 1e-3, 30
EVAL_EVERY, EVAL_SEQS, FINAL_EVAL_SEQS = 25, 128, 512
CORPUS_BYTES = QUALITY_CORPUS_BYTES
SEEDS = (0, 1, 2, 3, 4)  # a variant trains with the first `Variant.seeds` of them
MEMORY_CANDIDATES = (12, 14, 16, 20, 24)  # microbatches tried for the equal-memory comparison
TIME_ROUNDS = 12  # alternating steps of the time probe
# glibc: serve every allocation above 64 KiB by mmap and give it back on free, so the resident
# set follows live memory and VmHWM measures the real peak (not malloc's cached arenas).
MALLOC_ENV = malloc_env(65536, trim=True)


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
POLICY = ("blocks.*.mlp.proj",)  # trainer.train.model.SKETCH_LAYERS
VARIANTS: list[Variant] = [
    Variant("exact", "exact backprop", group="baseline"),
    # Exact gradients by construction (torch's checkpointing; the recomputed MLP is checked by
    # tests/sketch/test_sketch_fusions.py): each seed must end at exact's loss for that seed, which
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


def probe_key(v: Variant) -> str:
    """The probe that measured `v`'s step: its own, or its base's for a derived variant."""
    if v.name.startswith("mem-"):
        return f"{MEMORY_BASE}-mb{v.microbatch}"
    if v.name.startswith("exact-steps"):
        return "exact"
    # More steps ("-time") or another learning rate ("-lr…", with_lr) change neither the
    # step's memory nor its time.
    return v.name.removesuffix("-time").split("-lr")[0]

