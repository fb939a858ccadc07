"""benchmarks/gpu_scale/run.py dry-run on the CPU at toy size: every part runs and writes the
figures its GPU run reports (snapshot sides and targets, BASIS rows, quality per seed); each
side's restore was checked to bring the saved weights back."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_tiny_dry_run_measures_every_part(tmp_path: Path) -> None:
    out = tmp_path / "gpu_scale.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_scale.run", "--tiny", "--device",
                           "cpu", "--dir", str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())

    snap = summary["snapshot"]["main"]
    assert snap["rounds"] >= 1 and snap["parameters"] > 0 and snap["state_bytes"] > 0
    for name in ("baton_stall", "baton_persist", "baton_restore", "torch_save", "torch_load",
                 "dcp_return", "dcp_staged", "dcp_done", "dcp_load", "dcp_save"):
        times = snap["times_s"][name]
        assert len(times) == snap["rounds"] and all(t > 0 for t in times), name
    targets = snap["targets"]
    for key in ("stall_vs_dcp_staged", "persist_vs_torch_save", "restore_vs_torch_load"):
        assert math.isfinite(targets[key]["median"]) and targets[key]["median"] > 0, key
    assert set(targets["met"]) == {"stall", "persist", "restore"}
    assert set(snap["rss_growth_vs_state"]) == {"baton", "torch", "dcp"}
    assert "large" not in summary["snapshot"]  # only with --large, never at toy size

    rows = summary["basis"]["rows"]
    assert [r["name"] for r in rows] == ["exact", "exact-recompute", "checkpoint",
                                         "basis-default"]
    by = {r["name"]: r for r in rows}
    assert by["exact"]["saved_ratio"] == 1.0 and by["exact"]["time_ratio"] == 1.0
    # Recomputation and checkpointing keep less than exact backprop: the sides are real.
    assert by["checkpoint"]["saved_ratio"] < by["exact-recompute"]["saved_ratio"] < 1.0
    assert by["basis-default"]["rank"] > 0 and by["basis-default"]["saved_ratio"] < 1.0

    quality = summary["quality"]
    assert set(quality["final_val"]) == {"exact", "basis-default"}
    assert all(math.isfinite(v) for vals in quality["final_val"].values() for v in vals)
    assert quality["default_over_exact"] > 0
