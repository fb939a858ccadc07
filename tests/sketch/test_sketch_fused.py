"""The fused sketch path (`sketch_ops.fused_kernels`) against the torch reference, run by Triton's
CPU interpreter: each test runs one check of tests/sketch/fused_checks.py in a fresh subprocess
(`TRITON_INTERPRET` is read at import) with the layer forced onto the kernels.

- kernels: the plan's order, alone or a microbatch's drawn together, is the reference plan
  bitwise; dW and db from the kernels equal the reference estimate in fp32 and bf16, centred
  or not, strided inputs, one launch or bucket groups, with and without the invariant scalars;
- blocks: row blocks add up to the whole sketch; GELU and SiLU·up fused into the sketch write
  the hidden rows as torch does (to an ulp) and sketch those;
- layer: at R = n the layer's dW is exact backprop's; one step of a lone call launches 7
  device kernels (49 before the fused path; nn.Linear: 4) and reads nothing back on the host;
- model: inside `sketch_seed` a microbatch's plans are one keys launch and one sort for all
  its k sketched layers: a step launches exact's + k + 2 (5 + 2/k per sketched layer, against
  nn.Linear's 4); checkpoint recompute reuses the held plans; they are one microbatch's;
- mlps: the fused GELU and SwiGLU MLPs through the kernels equal the torch path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def _run(check: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "BATON_SKETCH_BACKEND": "triton"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    script = Path(__file__).with_name("fused_checks.py")
    proc = subprocess.run([sys.executable, str(script), check], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"{check} OK" in proc.stdout


@pytest.mark.parametrize("check", ["kernels", "blocks", "layer", "model", "mlps"])
def test_fused_path_under_interpreter(check: str) -> None:
    _run(check)


def test_the_gpu_benchmark_runs_at_toy_size_on_cpu(tmp_path: Path) -> None:
    """benchmarks/sketch_fused/run.py (a step of benchmarks/gpu_check.sh) end to end, at toy size
    on the CPU: every configuration, its ratio to exact and its kernel count are reported."""
    import json

    out = tmp_path / "fused.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.sketch_fused.run",
                           "--device", "cpu", "--tiny", "--dtype", "fp32", "--out", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads(out.read_text())["results"]}
    assert list(rows) == ["exact", "exact-recompute", "basis-default", "basis-all",
                          "basis-all-norecompute"]
    assert rows["exact"]["time_ratio"] == 1.0 and rows["exact"]["rank"] == 0
    assert rows["basis-default"]["rank"] == 2 * 16 // 16  # R = n / 16
    assert all(row["step_ms"] > 0 and row["kernels_per_step"] > 0 for row in rows.values())
    # More layers sketched, more kernels on the torch reference path.
    assert rows["basis-all"]["kernels_per_step"] > rows["basis-default"]["kernels_per_step"]
