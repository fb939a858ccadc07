"""benchmarks/gpu_check.sh without a GPU: valid bash, a --dry-run that lists its steps and
runs nothing, selections and settings that exist, and a real run that fails cleanly at its
first step (no CUDA) with a JSON summary saying so."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.config import load_recipe

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STEPS = ["cuda", "pytest_gpu", "triton_kernels", "sketch_memory", "sketch_fused", "bf16_fit"]


def _bash(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def _dry_run(tmp_path: Path) -> str:
    out = tmp_path / "summary.json"
    proc = _bash(str(SCRIPT), "--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert not out.exists() and not (tmp_path / "summary_logs").exists(), "a dry run ran"
    return proc.stdout


def test_the_script_is_valid_bash_and_its_dry_run_lists_the_steps(tmp_path: Path) -> None:
    assert _bash("-n", str(SCRIPT)).returncode == 0
    text = _dry_run(tmp_path)
    steps = re.findall(r"^step (\w+) \(timeout (\d+)s\):$", text, flags=re.M)
    assert [name for name, _ in steps] == STEPS
    total = sum(int(limit) for _, limit in steps)
    assert total <= 600 and f"total time limit: {total}s" in text  # under 10 minutes
    for needle in ("-m \"$marks\" -k \"not triton\"", "local marks=\"gpu and not multigpu\"",
                   "-m gpu -k triton",
                   "-m benchmarks.sketch_memory.run --device cuda", "fit recipes/llama-tiny.toml",
                   "-m benchmarks.sketch_fused.run --d-models 1024 2048",
                   "--until 8", "precision.dtype=\"bf16\"", "scaling.use_gpu=true"):
        assert needle in text, needle
    bad = _bash(str(SCRIPT), "--no-such-flag")
    assert bad.returncode == 2 and "usage:" in bad.stderr


def test_what_the_steps_select_exists(tmp_path: Path) -> None:
    """The fit's overrides make a valid bf16 GPU recipe; sketch_memory takes the flags; the
    two pytest selections are disjoint and both find gpu tests."""
    text = _dry_run(tmp_path)
    sets = re.search(r"local sets=\((.*?)\);", text, flags=re.S)
    assert sets is not None
    words = shlex.split(sets.group(1))
    overrides = [w for i, w in enumerate(words) if i and words[i - 1] == "--set"]
    cfg = load_recipe(ROOT / "recipes" / "llama-tiny.toml",
                      [*overrides, f'snapshots.run_uri="{tmp_path / "run"}"'])
    assert (cfg.precision.dtype, cfg.scaling.use_gpu, cfg.steps) == ("bf16", True, 16)
    assert cfg.scaling.max_workers == 1 and 8 % cfg.snapshots.snapshot_every == 0

    help_text = subprocess.run([sys.executable, "-m", "benchmarks.sketch_memory.run", "--help"],
                               capture_output=True, text=True, cwd=ROOT, timeout=60).stdout
    for flag in ("--device", "--seq-lens", "--ranks", "--combined-ranks", "--rounds", "--profile",
                 "--out"):
        assert flag in help_text, flag
    help_text = subprocess.run([sys.executable, "-m", "benchmarks.sketch_fused.run", "--help"],
                               capture_output=True, text=True, cwd=ROOT, timeout=60).stdout
    for flag in ("--d-models", "--rounds", "--out"):
        assert flag in help_text, flag

    def collected(*args: str) -> set[str]:
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                               "-p", "no:cacheprovider", "-m", "gpu", *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
        # A plain (not xdist) run, as the check's: conftest's hooks must work there too.
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return {line for line in proc.stdout.splitlines() if "::" in line}

    gpu_files = ["tests/elastic/test_elastic_format.py",
                 "tests/elastic/test_elastic_group_read.py",
                 "tests/gpu/test_gpu_paths.py",
                 "tests/sketch/test_sketch_triton.py"]
    listed = _bash("-c", f"source <(sed -n '/^gpu_test_files()/p' {SCRIPT}); gpu_test_files")
    assert listed.stdout.split() == gpu_files, listed.stdout + listed.stderr
    triton = collected("-k", "triton", *gpu_files)
    others = collected("-k", "not triton", *gpu_files)
    assert triton and others and not triton & others
    assert any("test_gpu_paths.py::test_triton_kernels" in t for t in triton)
    assert any("test_sketch_triton.py" in t for t in triton)
    resumes = "on_cuda_resumes_where_the_whole_run_ends"
    for name in ("bf16_autocast", "adamw_is_fused", f"{resumes}[bf16]", f"{resumes}[fp16]",
                 "fsdp2_on_one_gpu", "saved_on_cuda"):
        assert any(name in t for t in others), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_it_fails_at_the_first_step_with_a_summary(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = _bash(str(SCRIPT), "--out", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    assert summary["ok"] is False
    assert [s["name"] for s in summary["steps"]] == STEPS
    first, *rest = summary["steps"]
    assert first["ran"] and not first["ok"] and first["exit_code"] == 1
    assert "torch.cuda.is_available() is False" in Path(first["log"]).read_text()
    assert all(not s["ran"] and not s["ok"] for s in rest)
    assert "cuda: FAILED" in proc.stdout and "bf16_fit: not run (no CUDA)" in proc.stdout


def test_only_runs_the_named_steps_after_cuda(tmp_path: Path) -> None:
    proc = _bash(str(SCRIPT), "--dry-run", "--only", "bf16_fit,sketch_memory")
    assert proc.returncode == 0, proc.stderr
    steps = re.findall(r"^step (\w+) \(timeout", proc.stdout, flags=re.M)
    assert steps == ["cuda", "sketch_memory", "bf16_fit"]  # the script's order, cuda first
    bad = _bash(str(SCRIPT), "--dry-run", "--only", "bf16,sketch_memory")
    assert bad.returncode == 2 and "--only: no step named bf16" in bad.stderr


def test_gpu_scale_is_its_own_invocation_within_the_limit(tmp_path: Path) -> None:
    """gpu_scale is not a default step (the default ones use the 600 s); `--only gpu_scale`
    runs cuda and it, within 600 s, and the step runs the benchmark that has a dry run."""
    proc = _bash(str(SCRIPT), "--dry-run", "--only", "gpu_scale")
    assert proc.returncode == 0, proc.stderr
    steps = re.findall(r"^step (\w+) \(timeout (\d+)s\):$", proc.stdout, flags=re.M)
    assert [name for name, _ in steps] == ["cuda", "gpu_scale"]
    assert sum(int(limit) for _, limit in steps) <= 600
    assert "-m benchmarks.gpu_scale.run" in proc.stdout
    default = re.findall(r"^step (\w+) \(timeout", _dry_run(tmp_path), flags=re.M)
    assert default == STEPS and "benchmarks.gpu_scale" not in _dry_run(tmp_path)
