#!/usr/bin/env bash
# GPU readiness check (issue 16, point 7): the CUDA paths of Baton on one machine with an
# NVIDIA GPU, in under 10 minutes. Run it from anywhere after `make install TORCH_SPEC=torch`
# (a CUDA build of torch; the default TORCH_SPEC is the CPU build):
#
#   bash benchmarks/gpu_check.sh [--out PATH]   # default PATH: benchmarks/results/gpu_check.json
#   bash benchmarks/gpu_check.sh --dry-run      # print the steps, run nothing (no GPU needed)
#   bash benchmarks/gpu_check.sh --only bf16_fit,sketch_memory   # these steps (and cuda) only
#   bash benchmarks/gpu_check.sh --only gpu_scale --out benchmarks/results/gpu_scale_check.json
#
# Steps, each under its own `timeout` (the limits of the default steps add up to 600 s):
#   cuda            torch sees a CUDA device (name, memory, capability, bf16, triton version);
#                   if not, the other steps are not run
#   pytest_gpu      `pytest -m gpu` (on the files holding gpu tests) without the Triton tests:
#                   bf16 autocast and fused AdamW on CUDA, a Llama resumed on CUDA in bf16 and
#                   in fp16 (loss scaler), FSDP2 on one GPU (NCCL group of one, bf16 policy)
#                   resumed, snapshots saved on CUDA restored on CPU; with two GPUs or more
#                   also the multigpu tests (a DDP group restore over NCCL, each byte read once)
#   triton_kernels  `pytest -m gpu -k triton`: the Triton kernels compiled for the GPU (no
#                   TRITON_INTERPRET) against the torch reference, and the sketched layer and a
#                   Llama sketched with include="auto" through them against the reference
#   sketch_memory   python -m benchmarks.sketch_memory.run --device cuda (seq 2048): activation bytes,
#                   peak GPU memory and step time of BASIS vs exact backprop and checkpointing,
#                   and a profile of one step of each (top ops, launches, synchronisations)
#   sketch_fused    python -m benchmarks.sketch_fused.run (built-in GPT, d 1024 and 2048, 4 layers,
#                   8 x 1024 tokens, bf16 autocast, R = n/16): step time and peak memory of
#                   exact, exact with the MLP recomputed, BASIS's default plan, every linear
#                   sketched (with and without the MLP recompute), through the fused sketch
#                   kernels; kernels and host syncs per step
#   bf16_fit        `baton fit recipes/llama-tiny.toml` in bf16 on the GPU (local Ray, 1 worker,
#                   16 steps), uninterrupted, and a second run stopped at step 8 (--until 8) and
#                   continued (restore from its snapshot); the two must end at the same model and
#                   AdamW moments (relative difference <= 1e-3), with fp32 snapshots and a loss
#                   that went down
#   gpu_scale       (not run by default: only with --only gpu_scale, a separate invocation of
#                   cuda + this step, 500 s) python -m benchmarks.gpu_scale.run: a 1.1B Llama's
#                   snapshot stall, persist and restore against torch.save/load and DCP, BASIS
#                   at d 2048 and 4096 against exact, recompute and checkpointing, and BASIS's
#                   quality at 16k tokens per microbatch over 3 seeds; into gpu_scale.json
#
# It writes a JSON summary (per step: ok, exit code, seconds, limit, timed_out, log file and
# the step's figures) to PATH, each step's output to PATH without .json plus _logs/ (default
# benchmarks/results/gpu_check_logs/), sketch_memory's table to sketch_memory_cuda.json and
# sketch_fused's to sketch_fused_cuda.json beside PATH, and exits 1 if any step failed (2 for a
# bad argument).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT="$ROOT/benchmarks/results/gpu_check.json"
DRY_RUN=0
ONLY=""
usage() { echo "usage: bash benchmarks/gpu_check.sh [--dry-run] [--out PATH] [--only STEP,...]"; }
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --out) [ $# -ge 2 ] || { usage >&2; exit 2; }; OUT=$2; shift ;;
        --only) [ $# -ge 2 ] || { usage >&2; exit 2; }; ONLY=$2; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac
cd "$ROOT" || exit 2

PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)

# name, time limit (s): run in this order.
# Measured on an H200 (4 December): 6, 29 (4 tests), 25, 34 and 214 s; sketch_fused not yet.
STEPS=("cuda 20" "pytest_gpu 100" "triton_kernels 60" "sketch_memory 60" "sketch_fused 80"
       "bf16_fit 280")
# Steps only --only runs (each fits the 600 s of one invocation with cuda).
EXTRA_STEPS=("gpu_scale 480")
if [ -n "$ONLY" ]; then  # --only: the named steps, after cuda (which gates the others)
    ALL_STEPS=("${STEPS[@]}" "${EXTRA_STEPS[@]}")
    selected=("cuda 20")
    for entry in "${ALL_STEPS[@]:1}"; do
        if [[ ",$ONLY," == *",${entry%% *},"* ]]; then selected+=("$entry"); fi
    done
    known=" ${ALL_STEPS[*]%% *} "  # the step names, space-separated (no pipe: under
    # pipefail, `printf | grep -q` fails at random when grep's early exit cuts printf off)
    for name in ${ONLY//,/ }; do
        [[ "$known" == *" $name "* ]] || {
            echo "gpu_check.sh: --only: no step named $name (steps:" \
                "${ALL_STEPS[*]%% *})" >&2
            exit 2; }
    done
    STEPS=("${selected[@]}")
fi

step_cuda() {
    "$PY" - <<'EOF'
import json, os
import torch
assert torch.cuda.is_available(), ("torch.cuda.is_available() is False: no CUDA device, or a "
                                   "CPU build of torch (make install TORCH_SPEC=torch)")
props = torch.cuda.get_device_properties(0)
figures = {"device": props.name, "devices": torch.cuda.device_count(),
           "memory_gib": round(props.total_memory / 2**30, 1),
           "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
           "cuda": torch.version.cuda, "bf16": torch.cuda.is_bf16_supported()}
try:
    import triton
    figures["triton"] = triton.__version__
except ImportError:
    figures["triton"] = None
print(figures)
json.dump(figures, open(os.environ["FIGURES"], "w"))
EOF
}

# pytest's counts from its JUnit XML into $FIGURES; fails when nothing ran or a test skipped
# (on a GPU machine a skipped gpu test is a CUDA path that was not checked).
pytest_figures() {
    "$PY" - "$1" <<'EOF'
import json, os, sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
counts["seconds"] = float(suite.get("time", 0))
json.dump(counts, open(os.environ["FIGURES"], "w"))
print(counts)
sys.exit(0 if counts["tests"] > 0 and counts["skipped"] == 0 else 1)
EOF
}

# The test files holding `gpu` tests: collecting only these keeps the step independent of the
# test-only extras (moto, boto3, mlflow) that other test modules import.
gpu_test_files() { grep -l "pytest.mark.gpu" tests/*/test_*.py; }

step_pytest_gpu() {
    # multigpu tests (the group read over NCCL) only where there are two GPUs or more.
    local marks="gpu and not multigpu"
    [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ] && marks=gpu
    env -u TRITON_INTERPRET -u BATON_SKETCH_BACKEND "$PY" -m pytest -q -rs -p no:cacheprovider \
        -m "$marks" -k "not triton" --junitxml="$WORK/pytest_gpu.xml" $(gpu_test_files)
    local rc=$?
    pytest_figures "$WORK/pytest_gpu.xml" && return $rc
}

step_triton_kernels() {
    env -u TRITON_INTERPRET -u BATON_SKETCH_BACKEND "$PY" -m pytest -q -rs -p no:cacheprovider \
        -m gpu -k triton --junitxml="$WORK/triton.xml" tests/sketch/test_sketch_triton.py \
        tests/gpu/test_gpu_paths.py
    local rc=$?
    pytest_figures "$WORK/triton.xml" && return $rc
}

step_sketch_memory() {
    local out="$RESULTS/sketch_memory_cuda.json"
    "$PY" -m benchmarks.sketch_memory.run --device cuda --seq-lens 2048 --ranks 64 256 \
        --combined-ranks 64 --rounds 3 --profile 12 --out "$out" || return 1
    "$PY" - "$out" <<'EOF'
import json, os, sys
rows = json.load(open(sys.argv[1]))["results"]
keys = ("saved_ratio", "peak_ratio", "time_ratio", "step_s", "saved_bytes", "peak_bytes")
figures = {f"{r['name']}@{r['seq_len']}": {k: r[k] for k in keys} for r in rows}
json.dump({"results": sys.argv[1], **figures}, open(os.environ["FIGURES"], "w"))
EOF
}

step_sketch_fused() {
    local out="$RESULTS/sketch_fused_cuda.json"
    env -u TRITON_INTERPRET -u BATON_SKETCH_BACKEND "$PY" -m benchmarks.sketch_fused.run \
        --d-models 1024 2048 --rounds 5 --out "$out" || return 1
    "$PY" - "$out" <<'EOF'
import json, os, sys
summary = json.load(open(sys.argv[1]))
keys = ("time_ratio", "step_ms", "peak_ratio", "kernels_per_step", "host_syncs_per_step")
figures = {f"{r['name']}@d{r['d_model']}": {k: r[k] for k in keys} for r in summary["results"]}
json.dump({"results": sys.argv[1], "device": summary["device"], **figures},
          open(os.environ["FIGURES"], "w"))
EOF
}

step_gpu_scale() {
    local out="$RESULTS/gpu_scale.json"
    env -u TRITON_INTERPRET -u BATON_SKETCH_BACKEND "$PY" -m benchmarks.gpu_scale.run \
        --dir "$WORK" --out "$out" || return 1
    "$PY" - "$out" <<'EOF'
import json, os, sys
summary = json.load(open(sys.argv[1]))
snapshot = summary["snapshot"]
large = snapshot.get("large", {})
figures = {"results": sys.argv[1], "device": summary["device"],
           "snapshot_targets": snapshot["main"]["targets"],
           "snapshot_rss_vs_state": snapshot["main"]["rss_growth_vs_state"],
           "snapshot_large": large.get("targets", large),
           "basis_met": summary["basis"]["met"],
           "quality_default_over_exact": summary["quality"]["default_over_exact"]}
json.dump(figures, open(os.environ["FIGURES"], "w"))
print(figures)
EOF
}

step_bf16_fit() {
    local sets=(--set 'precision.dtype="bf16"' --set scaling.use_gpu=true
                --set scaling.min_workers=1 --set scaling.max_workers=1
                --set scaling.cpus_per_worker=2 --set steps=16 --set snapshots.snapshot_every=4
                --set eval.every=8)
    local fit=("$PY" -m trainer.cli fit recipes/llama-tiny.toml)
    "${fit[@]}" --run-dir "$WORK/fit/whole" "${sets[@]}" || return 1
    "${fit[@]}" --run-dir "$WORK/fit/resumed" "${sets[@]}" --until 8 || return 1
    "${fit[@]}" --run-dir "$WORK/fit/resumed" "${sets[@]}" || return 1
    "$PY" - "$WORK/fit" <<'EOF'
import json, math, os, statistics, sys
import torch
from safetensors.torch import load_file
from elastic.catalog import export_model
from elastic.store.snapshot_store import SnapshotStore
from trainer.run.metrics import read_records

work, steps = sys.argv[1], 16
def final(run):
    store = SnapshotStore(os.path.join(work, run))
    assert max(store.committed_steps()) == steps, store.committed_steps()
    manifest, state = store.load_manifest(steps), {}
    for component in ("model", "optim"):
        path = os.path.join(work, f"{run}-{component}.safetensors")
        export_model(store, steps, path, component=component)
        state.update({f"{component}.{k}": v for k, v in load_file(path).items()})
    return state, manifest
(a, whole), (b, resumed) = final("whole"), final("resumed")
figures, ok = {}, True
for component in ("model", "optim"):
    keys = [k for k in a if k.startswith(component + ".") and a[k].is_floating_point()]
    x = torch.cat([a[k].double().flatten() for k in keys])
    y = torch.cat([b[k].double().flatten() for k in keys])
    figures[f"{component}_relative_difference"] = rel = ((x - y).norm() / x.norm()).item()
    ok &= rel <= 1e-3
floats = sorted({r.dtype for m in (whole, resumed) for r in m.tensors.values()
                 if r.dtype in ("F64", "F32", "BF16", "F16")})
figures["snapshot_float_dtypes"] = floats
ok &= floats == ["F32"]
records = read_records(os.path.join(work, "whole"))
losses = [r["loss"] for r in records if r["kind"] == "step"]
rates = [r["tokens_per_s"] for r in records if r["kind"] == "step"][1:]
starts = [r["step"] for r in read_records(os.path.join(work, "resumed")) if r["kind"] == "start"]
figures.update(first_loss=losses[0], last_loss=losses[-1], steps=len(losses),
               tokens_per_s_median=statistics.median(rates) if rates else None,
               resumed_sessions_started_at=starts,
               val_loss=[r["val_loss"] for r in records
                         if r["kind"] == "step" and r.get("val_loss") is not None])
ok &= all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
ok &= starts == [0, 8]
figures["ok"] = bool(ok)
print(figures)
json.dump(figures, open(os.environ["FIGURES"], "w"))
sys.exit(0 if ok else 1)
EOF
}

if [ "$DRY_RUN" = 1 ]; then
    total=0
    echo "gpu_check.sh --dry-run: would run ${#STEPS[@]} steps from $ROOT with $PY, summary to $OUT"
    for entry in "${STEPS[@]}"; do
        read -r name limit <<<"$entry"
        total=$((total + limit))
        echo "step $name (timeout ${limit}s):"
        declare -f "step_$name" | sed -e '1,2d' -e '$d' -e 's/^/    /'
    done
    echo "total time limit: ${total}s"
    exit 0
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
RESULTS=$(dirname "$OUT")
LOGS="${OUT%.json}_logs"
mkdir -p "$LOGS" "$RESULTS"
export PY WORK ROOT RESULTS PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export -f pytest_figures gpu_test_files
: >"$WORK/steps.tsv"
have_cuda=1
for entry in "${STEPS[@]}"; do
    read -r name limit <<<"$entry"
    log="$LOGS/$name.log"
    figures="$WORK/$name.figures.json"
    if [ "$have_cuda" = 0 ]; then
        printf '%s\t%s\t%s\t%s\t%s\n' "$name" "not run" 0 "$limit" "$log" >>"$WORK/steps.tsv"
        echo "[gpu_check] $name: not run (no CUDA)"
        continue
    fi
    echo "[gpu_check] $name (timeout ${limit}s) ..."
    export -f "step_$name"
    start_ns=$(date +%s%N)
    # timeout signals the step's whole process group; --kill-after ends what ignores TERM.
    FIGURES="$figures" timeout --kill-after=15 "$limit" bash -c "step_$name" >"$log" 2>&1
    rc=$?
    ms=$((($(date +%s%N) - start_ns) / 1000000))
    seconds="$((ms / 1000)).$(printf '%03d' $((ms % 1000)))"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$seconds" "$limit" "$log" >>"$WORK/steps.tsv"
    if [ "$rc" = 0 ]; then
        echo "[gpu_check] $name: ok (${seconds%.*}s)"
    else
        echo "[gpu_check] $name: FAILED (exit $rc); last lines of $log:"
        tail -n 15 "$log" | sed 's/^/    /'
        [ "$name" = cuda ] && have_cuda=0
    fi
done

"$PY" - "$WORK" "$OUT" <<'EOF'
import json, os, socket, subprocess, sys, time
work, out = sys.argv[1], sys.argv[2]
steps = []
for line in open(os.path.join(work, "steps.tsv")):
    name, rc, seconds, limit, log = line.rstrip("\n").split("\t")
    path = os.path.join(work, f"{name}.figures.json")
    try:
        figures = json.load(open(path))
    except (OSError, ValueError):
        figures = {}
    ran = rc != "not run"
    steps.append({"name": name, "ok": ran and rc == "0", "ran": ran,
                  "exit_code": int(rc) if ran else None,
                  "timed_out": rc in ("124", "137"), "seconds": round(float(seconds or 0), 1),
                  "limit_s": int(limit), "log": log, "figures": figures})
try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip() or None
except OSError:
    commit = None
summary = {"ok": all(s["ok"] for s in steps), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
           time.gmtime()), "host": socket.gethostname(), "commit": commit,
           "seconds": round(sum(s["seconds"] for s in steps), 1), "steps": steps}
with open(out, "w") as f:
    json.dump(summary, f, indent=2)
    f.write("\n")
print(f"[gpu_check] {'all steps ok' if summary['ok'] else 'FAILED'}; summary: {out}")
sys.exit(0 if summary["ok"] else 1)
EOF
status=$?
rm -rf "$WORK"
exit $status
