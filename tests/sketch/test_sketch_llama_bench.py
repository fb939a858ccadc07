"""benchmarks/sketch_llama/run.py's smoke mode (`--quick`: a tiny Llama, in this process) runs its
three phases and writes the ratios and validation figures its report's table is made of
(benchmarks/reports/2026-12-05-sketch-llama.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")


def test_quick_run_writes_memory_time_and_quality_ratios(tmp_path: Path,
                                                         tiny_dataset: str) -> None:
    from benchmarks.sketch_llama import run as bench

    out = tmp_path / "llama.json"
    argv = ["--quick", "--data", tiny_dataset, "--out", str(out), "--only",
            "exact,auto,auto-all,down-proj"]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"exact", "auto", "auto-all", "down-proj"} and not result["skipped"]
    assert rows["exact"]["saved_ratio"] == 1.0 and rows["exact"]["time_ratio"] == 1.0
    # Unfused, down_proj's input (the gated product) is kept for its weight gradient alone:
    # its R x I sketch replaces it.
    # include="auto" (fusions + probe) keeps less than that.
    assert 0 < rows["auto"]["saved_ratio"] < rows["down-proj"]["saved_ratio"] < 1
    # Without its threshold "auto" sketches whatever frees anything: no more bytes.
    assert rows["auto-all"]["saved_ratio"] <= rows["auto"]["saved_ratio"]
    for name in ("auto", "auto-all", "down-proj"):
        low, high = rows[name]["time_ratio_range"]
        assert 0 < low <= rows[name]["time_ratio"] <= high
    # Trained: exact, auto and auto-all (down-proj is probed only), one seed in the smoke run.
    assert "final_val" not in rows["down-proj"]
    for name in ("exact", "auto", "auto-all"):
        assert len(rows[name]["final_val"]) == 1 and math.isfinite(rows[name]["val_mean"])
    assert math.isfinite(rows["auto"]["delta_pct"])
    assert set(result["targets"]) == {"saved_ratio<=0.55", "time_ratio<=1.0", "val_within_2pct"}
    # Resumable: a second call finds every probe and run on disk and only reports.
    runs = tmp_path / "llama"
    stamps = {p.name: p.stat().st_mtime_ns for p in runs.glob("*.json")}
    assert bench.main(argv) == 0
    assert {p.name: p.stat().st_mtime_ns for p in runs.glob("*.json")} == stamps
