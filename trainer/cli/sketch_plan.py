"""`baton sketch-plan RECIPE`: what `sketch.include = "auto"` sketches in a recipe's model, and
what that does to the activation memory of one step (registered into `trainer.cli.main`;
`trainer.train.sketch_measure` builds and measures).

Contract: builds the recipe's model on CPU (no Ray, no dataset read: token id 0 stands in for
data, since what autograd saves depends on shapes only), exactly as a run builds it before
sketching (`trainer.train.model_build.build_model`, seeded), and measures one training step of
it through the run's loss on a microbatch of `--rows` tokens (default: `data.microbatch_size ×
data.seq_len`). Then it applies "auto" (`sketch_ops.model.auto_plan`: the structural fusions,
then the probe), prints one row per linear layer (sketched / recomputed / kept, its input's
bytes, the bytes its sketch frees, why) and the activation bytes of exact backprop, the
prediction for the plan and the plan as measured (`sketch_ops.memory.saved_bytes` on one step
of the sketched model), with their ratios. R is `sketch.rank`, else `--rank`; a recipe with
`sketch.memory_budget_mib` gets its per-layer ranks from the budget (the probe prices each
sketch at R = 1); the recipe's `sketch.min_saving` and `sketch.keep_gate` are auto's
threshold and SwiGLU mode, as in a run. It also builds exact backprop with the MLPs recomputed
(`mlp_recompute = "always"`, or a Hugging Face model's SwiGLU MLPs fused with `recompute=True`)
and prints, for exact, exact recompute and the plan, the activation bytes (measured) and the
step time predicted by `sketch_ops.cost` (GEMM and attention FLOPs counted on the probe step,
passes over the activation bytes, each sketch's passes and launches) with this machine's
measured rates, or a GPU's modelled ones (`--target h100`), in the recipe's dtype; the output
says which. With `sketch.max_quality_cost > 0` "auto" also sketches for speed on those rates
(`sketch_ops.speed_plan`), as a run does on its device. `--set KEY=VALUE` overrides the recipe
as in `baton fit`. A bad recipe, a missing extra or a bad flag is one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from trainer.cli.main import one_line
from trainer.config import ConfigError, FitConfig, load_recipe
from trainer.train import MIB, PlanReport, plan_and_measure, train_dtype


def register(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser(
        "sketch-plan", help='which layers sketch.include = "auto" sketches, and the memory it '
                            "saves (CPU, one step)")
    plan.add_argument("recipe", help="TOML recipe, e.g. recipes/llama-tiny.toml")
    plan.add_argument("--rows", type=int, metavar="N",
                      help="tokens per microbatch to probe (default: data.microbatch_size x "
                           "data.seq_len)")
    plan.add_argument("--rank", type=int, metavar="R",
                      help="sketch rank when the recipe sets none (sketch.rank wins)")
    plan.add_argument("--set", dest="overrides", action="append", default=[],
                      metavar="KEY=VALUE", help="override a recipe value, e.g. sketch.rank=64")
    plan.add_argument("--target", metavar="GPU",
                      help="predict the step time (and plan sketch.max_quality_cost's speed "
                           "rule) for this GPU (h100, h200, a100; modelled rates) instead of "
                           "this machine (measured)")
    plan.set_defaults(func=_cmd_sketch_plan)


def _fail(message: str) -> int:
    print(f"error: {one_line(message)}", file=sys.stderr)
    return 2


def _cmd_sketch_plan(args: argparse.Namespace) -> int:
    from elastic.errors import FatalRunError

    try:
        # The run directory is never touched here; the recipe just must be complete.
        cfg = load_recipe(args.recipe, ['snapshots.run_uri="sketch-plan"', *args.overrides])
        batch = _probe_tokens(cfg, args.rows)
        rank = _rank(cfg, args.rank)
        report = plan_and_measure(cfg, batch, rank, _rates(cfg, args.target))
    except (ConfigError, FatalRunError, ValueError, OSError) as err:
        return _fail(str(err))
    except (RuntimeError, MemoryError) as err:  # torch's allocation failure: a model too big
        return _fail(f"the probe could not run this model on this machine ({err}); try "
                     "fewer --rows, or a smaller model to plan with")
    print_report(report)
    return 0


MAX_PROBE_ROWS = 1 << 22  # tokens per probe microbatch: 4 Mi (a 128 Ki context x 32)


def _probe_tokens(cfg: FitConfig, rows: int | None) -> torch.Tensor:
    """A microbatch of token id 0: `rows` tokens as sequences of at most `data.seq_len`."""
    seq = cfg.data.seq_len
    if rows is None:
        return torch.zeros(cfg.data.microbatch_size, seq, dtype=torch.long)
    if not 2 <= rows <= MAX_PROBE_ROWS:
        raise ValueError(f"--rows {rows}: must be between 2 and {MAX_PROBE_ROWS} (tokens per "
                         "microbatch)")
    if rows <= seq:
        return torch.zeros(1, rows, dtype=torch.long)
    if rows % seq:
        raise ValueError(f"--rows {rows}: must be at most data.seq_len ({seq}) or a multiple "
                         f"of it (whole sequences), e.g. {rows // seq * seq}")
    return torch.zeros(rows // seq, seq, dtype=torch.long)


def _rank(cfg: FitConfig, flag: int | None) -> int | None:
    """One R for every layer, or None when the recipe's memory budget sets the ranks."""
    if cfg.sketch.rank:
        return cfg.sketch.rank
    if cfg.sketch.memory_budget_mib:
        return None
    if flag is None:
        raise ValueError("sketch.rank: the recipe does not sketch (rank 0, no memory budget); "
                         "pass --rank R or --set sketch.rank=R")
    if flag < 1:
        raise ValueError(f"--rank {flag}: must be >= 1")
    return flag


def _rates(cfg: FitConfig, target: str | None) -> Any:
    """The rates the step time is predicted with: --target's modelled, else this CPU's."""
    from sketch_ops import device_rates, target_rates

    dtype = train_dtype(cfg)
    if target is not None:
        return target_rates(target, dtype)
    return device_rates(torch.device("cpu"), dtype)


def print_report(report: PlanReport) -> None:
    plan = report.plan
    word = {"sketch": "sketched", "keep": "kept", "recomputed": "recomputed"}
    rows = [(layer.name, f"{layer.in_features}->{layer.out_features}", word[layer.decision],
             f"{report.ranks[layer.name]}" if layer.name in report.ranks else "-",
             _size(layer.input_bytes) if layer.input_bytes else "-",
             _size(layer.freed_bytes) if layer.freed_bytes else "-",
             layer.reason) for layer in plan.layers]
    header = ("layer", "in->out", "decision", "R", "input", "freed", "why")
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    speed = (f", max_quality_cost {report.max_quality_cost:g}" if report.max_quality_cost
             else "")
    print(f"sketch plan (include = \"auto\", min_saving {report.min_saving:g}"
          f", keep_gate {str(report.keep_gate).lower()}{speed}), {report.rows} tokens per "
          "microbatch")
    if plan.fused:
        print(f"fused first: {len(plan.fused)} modules ({_summarise(plan.fused)})")
    for row in (header, *rows):
        print("  ".join(cell.ljust(width) if i in (0, 1, 2, 6) else cell.rjust(width)
                        for i, (cell, width) in enumerate(zip(row, widths, strict=True))).rstrip())
    counts = {w: sum(1 for layer in plan.layers if word[layer.decision] == w)
              for w in word.values()}
    print(", ".join(f"{n} {w}" for w, n in counts.items()))
    exact = report.exact_bytes
    print(f"activation bytes per microbatch: exact {_mib(exact)} MiB (as built), "
          f"{_mib(plan.exact_bytes)} MiB with the fusions")
    print(f"planned: predicted {_mib(plan.predicted_bytes)} MiB "
          f"({plan.predicted_bytes / exact:.2f}x exact), measured {_mib(report.measured_bytes)} "
          f"MiB ({report.measured_bytes / exact:.2f}x exact); measured / predicted "
          f"{report.measured_bytes / max(1, plan.predicted_bytes):.2f}")
    if report.rates is not None:
        print_times(report)
    if report.recipe_layers is not None and sorted(report.recipe_layers) != sorted(plan.sketched):
        print(f"note: the recipe's sketch.include selects {len(report.recipe_layers)} other "
              f"layer(s) ({_summarise(report.recipe_layers)}); set sketch.include = \"auto\" "
              "for this plan")


def print_times(report: PlanReport) -> None:
    """Predicted step time and activation bytes of exact, exact recompute and the plan."""
    from sketch_ops import (
        FUSED_PLAN_LAUNCHES,
        FUSED_SKETCH_LAUNCHES,
        activation_traffic,
        sketch_overhead_s,
        step_time_s,
    )

    rates, plan, scale = report.rates, report.plan, report.itemsize / 4
    sketched = [layer for layer in plan.layers if layer.name in report.ranks]
    overhead = sum(sketch_overhead_s(report.rows, layer.in_features, layer.out_features,
                                     report.itemsize, rates, launches=False)
                   for layer in sketched)
    # The probe ran the sketches on the torch path; the fused path launches its own instead.
    planned = report.steps["plan"]
    assert planned is not None
    launch_fix = (len(sketched) * FUSED_SKETCH_LAUNCHES + FUSED_PLAN_LAUNCHES * bool(sketched)
                  - planned.sketch_launches if rates.fused_path else 0)
    print(f"predicted step ({rates.describe()}; activation bytes of the fp32 probe x {scale:g} "
          "for the training dtype):")
    base = report.steps["exact"]
    assert base is not None
    exact_bytes = base.saved_bytes * scale
    base_s = step_time_s(base.flops, activation_traffic(exact_bytes, exact_bytes), rates,
                         launches=base.launches)
    for name, step in report.steps.items():
        if step is None:
            print(f"  {name:<16} n/a (a model_factory model)")
            continue
        traffic = activation_traffic(exact_bytes, step.saved_bytes * scale)
        plan_step = name == "plan"
        seconds = step_time_s(step.flops, traffic, rates, overhead if plan_step else 0.0,
                              step.launches + (launch_fix if plan_step else 0))
        print(f"  {name:<16} {seconds * 1e3:9.3f} ms {seconds / base_s:6.2f}x exact   "
              f"activation {_mib(step.saved_bytes)} MiB {step.saved_bytes / base.saved_bytes:.2f}"
              f"x exact")
    print("  (time: GEMM and attention FLOPs counted on the probe step at the GEMM rate; "
          "passes over exact's activation bytes, and twice over the bytes not kept, at the "
          "bandwidth; the step's kernel launches, counted; each sketch's passes; no "
          "optimizer, loss or communication)")


def _mib(n: int) -> str:
    return f"{n / MIB:.2f}"


def _size(n: int) -> str:
    """Bytes in KiB or MiB, whichever reads better."""
    return f"{n / MIB:.2f} MiB" if abs(n) >= MIB else f"{n / 1024:.1f} KiB"


def _summarise(names: list[str]) -> str:
    """Names with block indices folded: model.layers.#.mlp x4."""
    import re

    folded: dict[str, int] = {}
    for name in names:
        key = re.sub(r"\.\d+\.", ".#.", name)
        folded[key] = folded.get(key, 0) + 1
    return ", ".join(k if n == 1 else f"{k} x{n}" for k, n in folded.items())
