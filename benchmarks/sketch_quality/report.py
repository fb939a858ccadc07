"""The report of `benchmarks/sketch_quality/run.py`, from the saved runs and probes: the rows
(mean ± std over seeds, difference to exact against the noise, memory and time from the
probes), `benchmarks/results/sketch_quality.json`, `sketch_quality.png` (validation-loss curves
with ±std bands; memory vs quality) and Markdown tables on stdout.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, mean_std, versus, write_json
from benchmarks.sketch_quality.variants import (
    CORPUS_BYTES,
    D_MODEL,
    FINAL_EVAL_SEQS,
    LR,
    MEMORY_BASE,
    MICROBATCH,
    N_LAYERS,
    N_ROWS,
    PROBE_ONLY,
    RUNS,
    SEQ,
    STEPS,
    VARIANTS,
    WARMUP,
    Variant,
    derived_variants,
    probe_key,
)


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
        mean, std = mean_std(vals)
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
            row.update(versus(vals, exact_vals))
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


def report(probes: dict[str, dict[str, Any]]) -> None:
    """Write the JSON and the plot from the saved runs; print the tables."""
    rows = summarize(VARIANTS + derived_variants(probes), probes)
    grad_path = RUNS / "grad_error.json"
    result: dict[str, Any] = {
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
    write_json(RESULTS / "sketch_quality.json", result)
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
