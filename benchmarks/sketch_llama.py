"""BASIS on a Hugging Face Llama: activation memory, step time and validation loss (issue 16).

The model is `transformers`' `LlamaForCausalLM` built from recipes/llama-tiny/config.json
scaled to d_model 256, 4 layers, 4 query / 2 key-value heads (head_dim 64), intermediate
688 (Llama's 8/3·d, rounded to a multiple of 16), random init, fp32, with the vocabulary of
the prepared corpus (the byte-level embedded corpus `benchmarks/sketch_quality.py` prepares:
`data_state.prepare_corpus`, 12 MB of Python's standard library, sequences of 256 predicted
tokens). Its loss is the model's own causal-LM loss (`trainer.hf.causal_lm_loss`).

Variants (`VARIANTS`), BASIS ones at R = n/16: exact backprop (the model as `transformers`
builds it); exact with the SwiGLU MLP recomputed and the RMSNorms fused (exact gradients: the
selective-recompute baseline at BASIS's memory); `include="auto"` (fusions, then the probe's
choice, with its defaults: `min_saving`, and the fused MLP keeping gate's output); the same
with the fused MLP keeping only its input (`keep_gate=False`); the fusions with only the
down-projections sketched, chosen by name (what "auto" should pick here); "auto" with
`min_saving=0` (q/k/v and the LM head sketched too); down_proj only without fusions; every
`nn.Linear` without fusions (the old default).
Trained: exact, auto, auto with min_saving=0; the others are probed only (memory, time).
Variants whose library pieces are missing (the fusions, the auto probe) are skipped with a
note.

Measured, the same way as `benchmarks/sketch_memory.py` and `benchmarks/sketch_quality.py`
(their helpers are imported, not copied):
- memory, one microbatch of 16 × 256 = 4 096 predicted tokens (n = 4 112 rows with the
  last position, R = n/16 = 257), each variant in a fresh single-thread process with glibc
  returning freed memory at once: bytes autograd saves for backward
  (`sketch_ops.memory.saved_bytes`, parameters excluded) and the step's peak resident set
  (VmHWM after resetting it) above the resting process, both as ratios to exact backprop;
- step time: every variant built in one single-thread process, one step of each per round in
  rotating order, CPU time of the compute thread; the ratio to exact in the same round, median
  and range over the rounds;
- quality: equal steps, 3 seeds (model init, data order and sketches follow the seed), final
  validation loss over a fixed held-out set, mean ± std, difference to exact. On this 2-core
  machine a 4 096-token step takes ~1.3 s of CPU on one thread, so the training runs use
  microbatches of 4 × 256 = 1 024 tokens (n = 1 028, R = n/16 = 64) unless
  `--train-microbatch 16` asks for the probes' 4 096 (~4x the time); memory and time stay
  at 4 096.

Resumable: probes and each (variant, seed) run are JSON files under
benchmarks/results/sketch_llama/ and are not redone; runs hold `/tmp/baton_cpu.lock`
(flock), one training run at a time on one thread.

    python benchmarks/sketch_llama.py                 # everything (~45 min on 2 cores)
    python benchmarks/sketch_llama.py --only exact,auto --seeds 0
    python benchmarks/sketch_llama.py --report        # re-print from the saved runs
    python benchmarks/sketch_llama.py --quick --out /tmp/x.json   # smoke run, in-process
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sketch_quality import (  # noqa: E402 - after the path set-up above
    DATA,
    MALLOC_ENV,
    CpuLock,
    _reset_peak,
    _saved_bytes,
    _status_kib,
    ensure_corpus,
    evaluate,
    train_step,
    val_indices,
)

RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_OUT = RESULTS / "sketch_llama.json"
DEFAULT_RUNS = RESULTS / "sketch_llama"
LLAMA_TINY = ROOT / "recipes" / "llama-tiny" / "config.json"
SEEDS = (0, 1, 2)
RANK_DIVISOR = 16  # R = n / 16
QUALITY_TARGET_PCT, MEMORY_TARGET, TIME_TARGET = 2.0, 0.55, 1.0  # issue 16, point 4


@dataclasses.dataclass(frozen=True)
class Size:
    """The model and the workload; FULL is the issue's, QUICK a smoke run's."""

    d_model: int = 256
    intermediate: int = 688
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    probe_microbatch: int = 16  # × seq predicted tokens: memory and time
    train_microbatch: int = 4  # × seq predicted tokens: the quality runs
    steps: int = 300
    lr: float = 1e-3
    warmup: int = 30
    eval_every: int = 50
    eval_seqs: int = 64
    final_eval_seqs: int = 512
    time_rounds: int = 8


FULL = Size()
QUICK = Size(
    d_model=32,
    intermediate=64,
    layers=1,
    heads=2,
    kv_heads=1,
    probe_microbatch=4,
    train_microbatch=2,
    steps=4,
    warmup=1,
    eval_every=2,
    eval_seqs=4,
    final_eval_seqs=8,
    time_rounds=2,
)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One configuration. sketched False = exact gradients."""

    name: str
    label: str
    sketched: bool = False
    include: str | tuple[str, ...] | None = None  # sketch_model's include; None = every linear
    fuse: bool = False  # apply the SwiGLU MLP and RMSNorm fusions ("auto" applies them itself)
    recompute: bool | None = None  # the fused MLP's mode: True recomputes around a plain down
    # The fused MLP keeps gate's output and recomputes only up (True) or keeps only its input
    # (False); None = the library's default (sketch_ops.swiglu.KEEP_GATE).
    keep_gate: bool | None = None
    min_saving: float | None = None  # "auto"'s threshold; None = its default (probe.MIN_SAVING)
    train: bool = True  # False: probed only (exact gradients, or a contrast not worth the time)


VARIANTS = [
    Variant("exact", "exact backprop"),
    Variant(
        "exact-recompute",
        "exact, MLP recomputed + norms fused",
        fuse=True,
        recompute=True,
        keep_gate=False,  # exact gradients at the least memory: keeps only the MLP input
        train=False,
    ),
    Variant("auto", 'BASIS R=n/16, include="auto" (fusions + probe)', sketched=True,
            include="auto"),
    # The same, the fused MLP keeping only its input: one n x I tensor less per MLP, one matmul
    # more (its gradients are "auto"'s up to rounding: tests/test_sketch_swiglu.py).
    Variant("auto-keep-x", 'BASIS R=n/16, include="auto", keep_gate=False', sketched=True,
            include="auto", keep_gate=False, train=False),
    # What "auto" should choose on this Llama, by name: the built-in GPT's policy carried over
    # (the fusions, and only the down-projections sketched; the MLP recomputes around them).
    Variant("fused-down", "BASIS R=n/16, down_proj only + fusions (by name)", sketched=True,
            include=("*down_proj",), fuse=True, train=False),
    # "auto" without its threshold: every class that frees anything (q/k/v, the LM head too).
    Variant("auto-all", 'BASIS R=n/16, include="auto", min_saving=0', sketched=True,
            include="auto", min_saving=0.0),
    Variant("down-proj", "BASIS R=n/16, down_proj only, no fusion", sketched=True,
            include=("*down_proj",), train=False),
    Variant("all-linears", "BASIS R=n/16, every nn.Linear, no fusion (old default)",
            sketched=True, train=False),
]


def variant(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    known = ", ".join(v.name for v in VARIANTS)
    raise SystemExit(f"--only: unknown variant {name!r}; known: {known}")


# --------------------------------------------------------------------------- the model


class CausalLM:
    """A Hugging Face causal LM seen through the built-in GPT's `loss(tokens)`, so the quality
    benchmark's `train_step`, `evaluate` and `_saved_bytes` apply unchanged."""

    def __init__(self, hf_model: Any) -> None:
        self.hf = hf_model

    def loss(self, tokens: Any) -> Any:
        from trainer.hf import causal_lm_loss

        return causal_lm_loss(self.hf, tokens)

    def __getattr__(self, name: str) -> Any:  # parameters(), train(), eval(), zero_grad()
        return getattr(self.hf, name)


def llama(size: Size, vocab: int, seq: int) -> Any:
    """recipes/llama-tiny/config.json at `size`, random init from torch's global RNG."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    raw = json.loads(LLAMA_TINY.read_text())
    raw.update(
        hidden_size=size.d_model,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.d_model // size.heads,
        vocab_size=vocab,
        max_position_embeddings=seq + 1,
        use_cache=False,
    )
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING["llama"].from_dict(raw))
    return model.float()


def missing_pieces(v: Variant) -> str | None:
    """Why `v` cannot be built with the sketch_ops of this checkout (None: it can)."""
    import importlib.util

    needs = []
    if v.fuse or v.include == "auto":  # "auto" applies the fusions itself, when they exist
        needs += ["sketch_ops.swiglu", "sketch_ops.rms_norm"]
    if v.include == "auto":
        needs.append("sketch_ops.probe")
    absent = [name for name in needs if importlib.util.find_spec(name) is None]
    return f"needs {', '.join(absent)}" if absent else None


def build(v: Variant, size: Size, vocab: int, seq: int, microbatch: int, seed: int,
          probe_tokens: Any) -> tuple[CausalLM, Any, Any]:
    """Model (fusions and sketches applied), optimizer and schedule of `v`, from `seed`.
    `probe_tokens` is the microbatch `include="auto"` probes (random tokens: what is saved
    for backward does not depend on their values)."""
    import torch

    from sketch_ops import sketch_model
    from trainer.config import OptimConfig
    from trainer.hf import causal_lm_loss
    from trainer.optim import WarmupCosine, build_optimizer

    torch.manual_seed(seed)
    hf = llama(size, vocab, seq)
    if v.fuse:
        from sketch_ops.rms_norm import fuse_rms_norms
        from sketch_ops.swiglu_find import fuse_swiglu_mlps

        mode = {} if v.keep_gate is None else {"keep_gate": v.keep_gate}
        fuse_swiglu_mlps(hf, recompute=v.recompute, **mode)
        fuse_rms_norms(hf)
    if v.sketched:
        rank = microbatch * (seq + 1) // RANK_DIVISOR  # n = rows of every linear layer
        include = list(v.include) if isinstance(v.include, tuple) else v.include
        auto: dict[str, Any] = {}
        if include == "auto":
            auto = {"probe_batch": probe_tokens, "loss_fn": causal_lm_loss}
            if v.keep_gate is not None:
                auto["keep_gate"] = v.keep_gate
            if v.min_saving is not None:
                auto["min_saving"] = v.min_saving
        sketched = sketch_model(hf, rank=rank, include=include, **auto)
        if os.environ.get("SKETCH_LLAMA_VERBOSE"):
            print(f"{v.name}: R={rank}, sketched {sketched}", file=sys.stderr)
    model = CausalLM(hf)
    cfg = OptimConfig(lr=size.lr, warmup_steps=size.warmup)
    optimizer = build_optimizer(hf, cfg)
    return model, optimizer, WarmupCosine(optimizer, cfg, size.steps)


def random_tokens(vocab: int, microbatch: int, seq: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (microbatch, seq + 1), generator=gen)


# --------------------------------------------------------------------------- measurements


def memory_probe(v: Variant, size: Size, vocab: int, seq: int) -> dict[str, Any]:
    """Saved-for-backward bytes and the step's peak resident memory above the resting process,
    at the probe microbatch. Run in a fresh process with MALLOC_ENV (see sketch_quality)."""
    import torch

    torch.set_num_threads(1)
    tokens = random_tokens(vocab, size.probe_microbatch, seq)
    model, optimizer, schedule = build(v, size, vocab, seq, size.probe_microbatch, 0, tokens)
    saved = _saved_bytes(model, tokens, 0)
    for step in range(2):  # optimizer state and lazy buffers exist after this
        train_step(model, optimizer, schedule, tokens, 0, step)
    rest = _status_kib("VmRSS")
    _reset_peak()
    for step in range(2, 4):
        train_step(model, optimizer, schedule, tokens, 0, step)
    return {"saved_bytes": saved, "step_peak_bytes": (_status_kib("VmHWM") - rest) * 1024}


def time_probe(variants: list[Variant], size: Size, vocab: int, seq: int) -> dict[str, Any]:
    """Every variant's step time as CPU time of one compute thread, one step of each per round
    in rotating order (none always first), after two warm-up rounds; per variant the median
    step and the median and range over rounds of its ratio to exact (variants[0])."""
    import torch

    torch.set_num_threads(1)
    tokens = random_tokens(vocab, size.probe_microbatch, seq)
    runs = [build(v, size, vocab, seq, size.probe_microbatch, 0, tokens) for v in variants]
    times: list[list[float]] = [[] for _ in variants]
    for step in range(2 + size.time_rounds):
        shift = step % len(variants)
        for i in [*range(shift, len(variants)), *range(shift)]:
            model, optimizer, schedule = runs[i]
            start = time.thread_time()
            train_step(model, optimizer, schedule, tokens, 0, step)
            if step >= 2:
                times[i].append(time.thread_time() - start)
    result = {}
    for v, row in zip(variants, times, strict=True):
        ratios = [t / e for t, e in zip(row, times[0], strict=True)]
        result[v.name] = {
            "step_s": statistics.median(row),
            "time_ratio": statistics.median(ratios),
            "time_ratio_range": [min(ratios), max(ratios)],
        }
    return result


def train(v: Variant, size: Size, data: str, seed: int) -> dict[str, Any]:
    """Train `v` from `seed` for size.steps microbatches of the corpus; the validation curve
    and the final validation loss over a fixed subset of the val split."""
    import torch

    from data_state import ResumableLoader, TokenDataset

    torch.set_num_threads(1)
    train_set, val_set = TokenDataset(data, "train"), TokenDataset(data, "val")
    seq = train_set.seq_len - 1
    mb = size.train_microbatch
    model, optimizer, schedule = build(
        v, size, train_set.vocab_size, seq, mb, seed, random_tokens(train_set.vocab_size, mb, seq)
    )
    curve_idx = val_indices(len(val_set), size.eval_seqs)
    loader = ResumableLoader(train_set, global_batch=mb, microbatch_size=mb, seed=seed)
    curve = [(0, evaluate(model, val_set, curve_idx))]
    train_s = 0.0
    for step in range(size.steps):
        (batch,) = loader.next_step()
        start = time.perf_counter()
        train_step(model, optimizer, schedule, batch.tokens, seed, step)
        train_s += time.perf_counter() - start
        loader.advance()
        if (step + 1) % size.eval_every == 0 or step + 1 == size.steps:
            curve.append((step + 1, evaluate(model, val_set, curve_idx)))
    loader.close()
    final_idx = val_indices(len(val_set), size.final_eval_seqs)
    return {
        "variant": v.name,
        "seed": seed,
        "steps": size.steps,
        "tokens_per_step": mb * seq,
        "val_curve": curve,
        "final_val": evaluate(model, val_set, final_idx),
        "train_s": train_s,
    }


# --------------------------------------------------------------------------- the driver


@dataclasses.dataclass
class Plan:
    size: Size
    data: str
    runs: Path
    in_process: bool  # --quick: no child processes (a smoke run; its figures mean nothing)

    def child(self, mode: str, payload: dict[str, Any], *, exact_rss: bool) -> Any:
        """Run `mode` in a fresh single-thread interpreter (or here, in-process)."""
        if self.in_process:
            return CHILD_MODES[mode](payload)
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(MALLOC_ENV if exact_rss else {})}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        proc = subprocess.run([sys.executable, __file__, mode, json.dumps(payload)], env=env,
                              stdout=subprocess.PIPE, text=True, check=False)
        if proc.returncode:
            raise SystemExit(f"{mode} {payload.get('variant', '')} failed (exit {proc.returncode})")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def payload(self, **more: Any) -> dict[str, Any]:
        return {"size": dataclasses.asdict(self.size), "data": self.data, **more}

    def lock(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if self.in_process else CpuLock()


def _payload_parts(p: dict[str, Any]) -> tuple[Size, int, int]:
    from data_state.dataset import read_manifest

    manifest = read_manifest(p["data"])
    return Size(**p["size"]), manifest.vocab_size, manifest.seq_len - 1


def _memory_child(p: dict[str, Any]) -> Any:
    size, vocab, seq = _payload_parts(p)
    return memory_probe(Variant(**_variant_fields(p["variant"])), size, vocab, seq)


def _time_child(p: dict[str, Any]) -> Any:
    size, vocab, seq = _payload_parts(p)
    return time_probe([Variant(**_variant_fields(v)) for v in p["variants"]], size, vocab, seq)


def _train_child(p: dict[str, Any]) -> Any:
    return train(Variant(**_variant_fields(p["variant"])), Size(**p["size"]), p["data"], p["seed"])


def _variant_fields(fields: dict[str, Any]) -> dict[str, Any]:
    include = fields.get("include")  # JSON turned the glob tuple into a list
    return {**fields, "include": tuple(include) if isinstance(include, list) else include}


CHILD_MODES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "--child-memory": _memory_child,
    "--child-time": _time_child,
    "--child-train": _train_child,
}


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def run_probes(plan: Plan, variants: list[Variant], *, retime: bool = False) -> dict[str, Any]:
    """Memory probes of variants not probed yet; then, if any has no step time yet (or
    `retime`), the time probe of all of them together (ratios come from one process), merged
    into the saved times of other variants."""
    path = plan.runs / "probe.json"
    probes = _load(path)
    memory = probes.setdefault("memory", {})
    timing = probes.setdefault("time", {})
    todo = [v for v in variants if v.name not in memory]
    with plan.lock():
        for v in todo:
            fields = dataclasses.asdict(v)
            memory[v.name] = plan.child("--child-memory", plan.payload(variant=fields),
                                        exact_rss=True)
            print(f"memory {v.name}: {memory[v.name]}", flush=True)
            path.write_text(json.dumps(probes, indent=1))
        if retime or any(v.name not in timing for v in variants):
            payload = plan.payload(variants=[dataclasses.asdict(v) for v in variants])
            timing.update(plan.child("--child-time", payload, exact_rss=False))
            probes["time_rounds"] = plan.size.time_rounds
            print(f"time: {timing}", flush=True)
            path.write_text(json.dumps(probes, indent=1))
    return probes


def run_training(plan: Plan, variants: list[Variant], seeds: tuple[int, ...]) -> None:
    """Each (variant, seed) run not on disk yet, one at a time (one thread each)."""
    for v in variants:
        for seed in seeds:
            path = plan.runs / f"{v.name}-s{seed}.json"
            if path.exists():
                continue
            with plan.lock():
                payload = plan.payload(variant=dataclasses.asdict(v), seed=seed)
                result = plan.child("--child-train", payload, exact_rss=False)
            path.write_text(json.dumps(result))
            print(f"{v.name} seed {seed}: val {result['final_val']:.4f} "
                  f"({result['train_s']:.0f} s)", flush=True)


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(plan: Plan, variants: list[Variant], probes: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per probed or trained variant: ratios to exact and validation mean ± std."""
    memory, timing = probes.get("memory", {}), probes.get("time", {})
    exact_vals = [json.loads(p.read_text())["final_val"]
                  for p in sorted(plan.runs.glob("exact-s[0-9]*.json"))]
    rows = []
    for v in variants:
        row: dict[str, Any] = {"variant": v.name, "label": v.label}
        if v.name in memory and "exact" in memory:
            mem, ex = memory[v.name], memory["exact"]
            row.update(mem)
            row["saved_ratio"] = mem["saved_bytes"] / ex["saved_bytes"]
            # A smoke run's peak can be below the resident set's page granularity: no ratio.
            if ex["step_peak_bytes"] > 0:
                row["peak_ratio"] = mem["step_peak_bytes"] / ex["step_peak_bytes"]
        row.update(timing.get(v.name, {}))
        vals = [json.loads(p.read_text())["final_val"]
                for p in sorted(plan.runs.glob(f"{v.name}-s[0-9]*.json"))]
        if vals:
            row["final_val"] = vals
            row["val_mean"], row["val_std"] = _mean_std(vals)
            if exact_vals and v.name != "exact":
                e_mean, e_std = _mean_std(exact_vals)
                row["delta_pct"] = 100 * (row["val_mean"] - e_mean) / e_mean
                se = (row["val_std"] ** 2 / len(vals) + e_std**2 / len(exact_vals)) ** 0.5
                row["significant"] = abs(row["val_mean"] - e_mean) > 2 * se
        rows.append(row)
    return rows


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 16's targets for the auto variant (None where it was not measured)."""
    auto = next((r for r in rows if r["variant"] == "auto"), {})

    def check(key: str, limit: float) -> bool | None:
        return None if key not in auto else bool(auto[key] <= limit)

    quality = None if "delta_pct" not in auto else bool(auto["delta_pct"] <= QUALITY_TARGET_PCT)
    return {
        "saved_ratio<=0.55": check("saved_ratio", MEMORY_TARGET),
        "time_ratio<=1.0": check("time_ratio", TIME_TARGET),
        "val_within_2pct": quality,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| configuration | saved for backward MB (× exact) | step peak MB (× exact) "
        "| step time × exact (range) | val loss, mean ± std | vs exact |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        saved = (f"{r['saved_bytes'] / 1e6:.0f} ({r['saved_ratio']:.2f})"
                 if "saved_ratio" in r else "")
        peak = (f"{r['step_peak_bytes'] / 1e6:.0f} ({r['peak_ratio']:.2f})"
                if "peak_ratio" in r else "")
        step = ""
        if "time_ratio" in r:
            low, high = r["time_ratio_range"]
            step = f"{r['time_ratio']:.2f} ({low:.2f}–{high:.2f})"
        val = (f"{r['val_mean']:.3f} ± {r['val_std']:.3f} (n={len(r['final_val'])})"
               if "val_mean" in r else "")
        delta = ""
        if "delta_pct" in r:
            delta = f"{r['delta_pct']:+.1f} %" + ("" if r["significant"] else " (noise)")
        lines.append(f"| {r['label']} | {saved} | {peak} | {step} | {val} | {delta} |")
    return "\n".join(lines)


@contextlib.contextmanager
def _quick_data(plan_runs: Path, data: str | None) -> Iterator[str]:
    """The smoke run's corpus: `data` if given, else a small slice prepared under its runs."""
    if data:
        yield data
        return
    from data_state import prepare_corpus

    out = plan_runs / "corpus"
    if not (out / "dataset.json").exists():
        prepare_corpus(None, str(out), seq_len=33, max_bytes=300_000, progress=False)
    yield str(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated variant names")
    parser.add_argument("--seeds", default="", help="comma-separated; default 0,1,2")
    parser.add_argument("--report", action="store_true", help="only aggregate saved runs")
    parser.add_argument("--no-train", action="store_true", help="probes only")
    parser.add_argument("--retime", action="store_true",
                        help="redo the step-time probe (e.g. on a quieter machine)")
    parser.add_argument("--rounds", type=int, help=f"timed rounds (default {FULL.time_rounds})")
    parser.add_argument("--train-microbatch", type=int,
                        help=f"sequences per training step (default {FULL.train_microbatch}; "
                        "16 = the probes' 4 096 tokens, ~4x the time)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny model, 4 steps, 1 seed, in this process")
    parser.add_argument("--data", help="prepared dataset (default: sketch_quality's corpus)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--runs", type=Path, help="probe and run files (default beside --out)")
    for mode in CHILD_MODES:
        parser.add_argument(mode, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for mode, handler in CHILD_MODES.items():
        raw = getattr(args, mode.lstrip("-").replace("-", "_"))
        if raw:
            print(json.dumps(handler(json.loads(raw))))
            return 0
    runs = args.runs or (DEFAULT_RUNS if args.out == DEFAULT_OUT else args.out.with_suffix(""))
    runs.mkdir(parents=True, exist_ok=True)
    chosen = [variant(n) for n in args.only.split(",") if n] or VARIANTS
    skipped = {v.name: why for v in chosen if (why := missing_pieces(v))}
    chosen = [v for v in chosen if v.name not in skipped]
    if "exact" not in {v.name for v in chosen}:
        chosen.insert(0, variant("exact"))  # the reference of every ratio
    seeds = tuple(int(s) for s in args.seeds.split(",")) if args.seeds else SEEDS
    with contextlib.ExitStack() as stack:
        if args.quick:
            data = stack.enter_context(_quick_data(runs, args.data))
            plan = Plan(QUICK, data, runs, in_process=True)
            seeds = seeds[:1]
        else:
            if not args.data and not args.report:
                ensure_corpus()
            rounds = FULL.time_rounds if args.rounds is None else args.rounds
            size = dataclasses.replace(FULL, time_rounds=rounds)
            if args.train_microbatch is not None:
                if args.train_microbatch < 1:
                    raise SystemExit("--train-microbatch: must be >= 1 (sequences per step)")
                size = dataclasses.replace(size, train_microbatch=args.train_microbatch)
            plan = Plan(size, args.data or str(DATA), runs, in_process=False)
        if not args.report:
            run_probes(plan, chosen, retime=args.retime)
            if not args.no_train:
                run_training(plan, [v for v in chosen if v.train], seeds)
        probes = _load(runs / "probe.json")
        rows = summarize(plan, chosen, probes)
    import torch

    result = {
        "setup": {
            **dataclasses.asdict(plan.size),
            "time_rounds": probes.get("time_rounds", plan.size.time_rounds),
            "rank_divisor": RANK_DIVISOR,
            "data": plan.data,
            "quick": args.quick,
            "note": "memory and time at probe_microbatch x seq tokens, quality at "
            "train_microbatch x seq tokens (a 4 096-token step is ~2 s on one CPU thread)",
        },
        "meta": {
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "cpus": os.cpu_count(),
            "argv": sys.argv[1:] if argv is None else argv,
        },
        "skipped": skipped,
        "rows": rows,
        "targets": targets(rows),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(rows))
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    print(f"targets (auto): {result['targets']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
