"""Baton at real size on one GPU: snapshots of a ~1B Llama's state, BASIS at d 2048 and 4096,
and BASIS's quality on the GPU, against what a user would pick instead.

Three parts (`--parts`, default all), each printing its targets as ratios:

1. `snapshot` (`snapshot.py`): the Llama of `--config` (default
   `recipes/llama-gpu/config.json`, TinyLlama-1.1B's shape, random init) with fp32 master
   weights and AdamW on the GPU (12 bytes per parameter: 13.2 GB), saved and restored by
   Baton, `torch.save`/`torch.load` and DCP `async_save` (pinned stager) / `save` / `load`.
   Targets: stall ≤ DCP async_save's (until its staging is done), persist ≥ 0.8× the
   throughput of `torch.save` + fsync (time ≤ 1.25×), restore ≤ 1.0× `torch.load` +
   `load_state_dict`; host peak RSS per side. `--large` (a separate run, ~5 min more): the same
   for `--config-large` (default `benchmarks/gpu_scale/llama_3b.json`: d 3072, 28 layers, 3.0B
   parameters, 36 GB), one round, where the GPU has at least 3.5× and the disk and host RAM at
   least 3.2× that state free (a 139 GB H200 with a large disk; otherwise it says why not).
2. `basis` (`basis.py`): the built-in GPT at d 2048 (4 blocks) and 4096 (2 blocks),
   2 × 4096-token sequences, bf16 autocast: step time, peak memory and saved activation
   bytes of exact, exact with the MLP recomputed, block checkpointing and BASIS's default
   (R = n/16). Target: the default ≤ 0.95× exact's step time at ≤ 0.55× its activation
   bytes, and faster than the exact recompute at equal memory.
3. `quality`: exact against the default on the embedded corpus (Python's standard library,
   bytes), 64 × 256 = 16 384 tokens per microbatch, 3 seeds; target: the default's mean
   final validation loss within 2 % of exact's.

    python -m benchmarks.gpu_scale.run --out benchmarks/results/gpu_scale.json      # a GPU
    python -m benchmarks.gpu_scale.run --parts snapshot --large --out /tmp/gpu_scale_3b.json
    python -m benchmarks.gpu_scale.run --tiny --device cpu --out /tmp/gpu_scale.json   # dry run

`--tiny` runs every part at toy size (a 2-layer Llama of d 64 written beside the output,
d 32 GPTs, 2 steps of quality on a small corpus) anywhere; its figures say nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import ROOT, arg_parser, ratios, utc_now, write_json
from benchmarks.common_training import QUALITY_CORPUS, QUALITY_SEQ, ensure_quality_corpus
from benchmarks.gpu_scale.basis import measure_quality, measure_steps
from benchmarks.gpu_scale.snapshot import measure_snapshots

LLAMA_1B = ROOT / "recipes" / "llama-gpu" / "config.json"
LLAMA_3B = ROOT / "benchmarks" / "gpu_scale" / "llama_3b.json"
TOY_LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "vocab_size": 256}


def snapshot_targets(got: dict[str, Any]) -> dict[str, Any]:
    """The part's ratios, per round: Baton over each baseline."""
    t = got["times_s"]
    persist = [a + b for a, b in zip(t["baton_stall"], t["baton_persist"], strict=True)]
    out = {"stall_vs_dcp_staged": ratios(t["baton_stall"], t["dcp_staged"]),
           "stall_vs_dcp_return": ratios(t["baton_stall"], t["dcp_return"]),
           "persist_vs_torch_save": ratios(t["baton_persist"], t["torch_save"]),
           "capture_and_persist_vs_torch_save": ratios(persist, t["torch_save"]),
           "persist_vs_dcp_done": ratios(t["baton_persist"], t["dcp_done"]),
           "restore_vs_torch_load": ratios(t["baton_restore"], t["torch_load"]),
           "restore_vs_dcp_load": ratios(t["baton_restore"], t["dcp_load"])}
    out["met"] = {"stall": out["stall_vs_dcp_staged"]["median"] <= 1.0,
                  "persist": out["persist_vs_torch_save"]["median"] <= 1.25,
                  "restore": out["restore_vs_torch_load"]["median"] <= 1.0}
    gb = got["state_bytes"] / 1e9
    print(f"snapshot, {got['parameters'] / 1e9:.2f}B parameters, {gb:.1f} GB of state, "
          f"{got['rounds']} rounds:", flush=True)
    for key, value in out.items():
        if key != "met":
            print(f"  {key}: {value['median']:.2f}x ({value['min']:.2f}-{value['max']:.2f})")
    print(f"  host RSS growth / state: {got['rss_growth_vs_state']}; met: {out['met']}",
          flush=True)
    return out


def large_fits(config: Path, device: torch.device, workdir: str) -> str:
    """'' when the large model's state fits this machine (module docstring), else why not."""
    from trainer.config import ModelConfig
    from trainer.train.hf import build_hf_model

    with torch.device("meta"):
        params = sum(p.numel() for p in build_hf_model(ModelConfig(hf_config=str(config)))
                     .parameters())
    state = 12 * params
    gpu = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    disk = shutil.disk_usage(workdir).free
    ram = _available_ram()
    short = [f"{name} has {have / 1e9:.0f} GB free, needs {need * state / 1e9:.0f}"
             for name, have, need in (("the GPU", gpu, 3.5), ("the disk", disk, 3.2),
                                      ("host RAM", ram, 3.2)) if have < need * state]
    return "; ".join(short)


def _available_ram() -> int:
    with open("/proc/meminfo") as info:
        for line in info:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def run_snapshot(args: argparse.Namespace, device: torch.device, workdir: str
                 ) -> dict[str, Any]:
    config = args.config
    if args.tiny:
        config = Path(workdir) / "llama-toy" / "config.json"
        config.parent.mkdir(parents=True, exist_ok=True)
        base = json.loads(LLAMA_1B.read_text())
        config.write_text(json.dumps({**base, **TOY_LLAMA}))
    out: dict[str, Any] = {}
    got = measure_snapshots(config, device, workdir, args.snapshot_rounds,
                            args.snapshot_budget_s)
    out["main"] = {**got, "targets": snapshot_targets(got)}
    if args.tiny or not args.large:
        return out
    why = large_fits(args.config_large, device, workdir)
    if why:
        print(f"snapshot, large model: not run ({why})", flush=True)
        out["large"] = {"skipped": why}
        return out
    torch.cuda.empty_cache()
    got = measure_snapshots(args.config_large, device, workdir, 1, args.snapshot_budget_s)
    out["large"] = {**got, "targets": snapshot_targets(got)}
    return out


def run_basis(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    widths, layers, seq, batch = ([32], [1], 16, 2) if args.tiny else ([2048, 4096], [4, 2],
                                                                       4096, 2)
    rows = measure_steps(widths, layers, seq, batch, 1 if args.tiny else args.rounds, device,
                         args.dtype)
    by = {(r["d_model"], r["name"]): r for r in rows}
    met = {}
    for d in widths:
        default, recompute = by[(d, "basis-default")], by[(d, "exact-recompute")]
        met[str(d)] = {"time_le_0.95": default["time_ratio"] <= 0.95,
                       "saved_le_0.55": default["saved_ratio"] <= 0.55,
                       "faster_than_recompute": default["step_ms"] < recompute["step_ms"]}
    print(f"basis targets met: {met}", flush=True)
    return {"rows": rows, "met": met}


def run_quality(args: argparse.Namespace, device: torch.device, workdir: str
                ) -> dict[str, Any]:
    if args.tiny:
        from data_state import prepare_corpus

        corpus = str(Path(workdir) / "corpus")
        prepare_corpus(None, corpus, seq_len=QUALITY_SEQ + 1, max_bytes=400_000)
        shape, steps, microbatch, seeds = {"d_model": 32, "n_layers": 1, "n_heads": 2}, 2, 4, [0]
    else:
        ensure_quality_corpus()
        corpus = str(QUALITY_CORPUS)
        shape, steps, microbatch = {"d_model": 512, "n_layers": 4, "n_heads": 4}, 300, 64
        seeds = [0, 1, 2]
    got = measure_quality(corpus, seeds, steps, microbatch, shape, device, args.dtype)
    got["met"] = abs(got["default_over_exact"] - 1) <= 0.02
    print(f"quality: default / exact mean validation loss {got['default_over_exact']:.4f} "
          f"(exact {statistics.fmean(got['final_val']['exact']):.4f}); within 2 %: "
          f"{got['met']}", flush=True)
    return got


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__, __spec__)
    parser.add_argument("--parts", default="snapshot,basis,quality")
    parser.add_argument("--config", type=Path, default=LLAMA_1B)
    parser.add_argument("--large", action="store_true",
                        help="snapshot: also --config-large, where the machine holds it")
    parser.add_argument("--config-large", type=Path, default=LLAMA_3B)
    parser.add_argument("--snapshot-rounds", type=int, default=2)
    parser.add_argument("--snapshot-budget-s", type=float, default=240.0)
    parser.add_argument("--rounds", type=int, default=5, help="basis: timed rounds")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dir", default=None, help="where snapshots are written (a disk)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes: a dry run")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device (use --device cpu --tiny for a dry run)", file=sys.stderr)
        return 2
    if args.device == "cpu" and args.dtype == "bf16":
        args.dtype = "fp32"  # the sketch's CPU reference has no bf16 sparse product
    device = torch.device(args.device)
    parts = args.parts.split(",")
    summary: dict[str, Any] = {
        "date_utc": utc_now(), "torch": torch.__version__, "args": {
            k: str(v) for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name() if device.type == "cuda" else
        platform.processor() or "cpu"}
    with tempfile.TemporaryDirectory(dir=args.dir) as workdir:
        if "snapshot" in parts:
            summary["snapshot"] = run_snapshot(args, device, workdir)
        if "basis" in parts:
            summary["basis"] = run_basis(args, device)
        if "quality" in parts:
            summary["quality"] = run_quality(args, device, workdir)
    write_json(args.out, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
