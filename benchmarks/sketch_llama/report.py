"""The report of `benchmarks/sketch_llama/run.py`, from its saved probes and runs: one row per
variant (ratios to exact, validation mean ± std and its difference to exact against the noise),
issue 16's targets for "auto", and the Markdown table of
benchmarks/reports/2026-12-05-sketch-llama.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.common import mean_std, versus
from benchmarks.sketch_llama.variants import MEMORY_TARGET, QUALITY_TARGET_PCT, TIME_TARGET, Variant


def summarize(runs: Path, variants: list[Variant], probes: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per probed or trained variant: ratios to exact and validation mean ± std."""
    memory, timing = probes.get("memory", {}), probes.get("time", {})
    exact_vals = [json.loads(p.read_text())["final_val"]
                  for p in sorted(runs.glob("exact-s[0-9]*.json"))]
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
                for p in sorted(runs.glob(f"{v.name}-s[0-9]*.json"))]
        if vals:
            row["final_val"] = vals
            row["val_mean"], row["val_std"] = mean_std(vals)
            if exact_vals and v.name != "exact":
                row.update(versus(vals, exact_vals))
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
