"""Recovery after a node loss: Baton against Ray Train's standard checkpoint recipe (issue 5).

One run, on a local multi-node Ray cluster (`trainer.on_ray.local_cluster`: a head with no CPUs and
2 worker nodes of 1 logical CPU), trains the same model, data order, optimizer and schedule with
both tools on 2 workers (`num_workers=(1, 2)`), kills a worker node ungracefully once step LOSE_AT
is reached, and lets each run finish on 1 worker (no node comes back). Per tool, from
time-stamped per-step records:
- recovery_s: from `remove_worker()` to the first step completed after the restart (split into
  restart_s, until the new worker group has restored its state, and the rest);
- steps_redone: last step reached before the loss minus the step restored;
- warm: whether AdamW resumed with its moments (Baton: the final snapshot's step counters equal the
  total steps; standard: the restored counter equals the restored step), and the LR after restart;
- the loss curve around the failure (PNG).

The standard recipe (`benchmarks/recovery/standard.py`) is what a typical Ray Train user writes:
`prepare_model` (DDP), rank 0 `torch.save`s {model, optimizer, step} as a checkpoint every k =
snapshot_every steps and restores them on start, without the LR schedule or the data position. Its
`standard-model` variant saves just the model (AdamW restarts cold). Both use Baton's model builder,
optimizer, schedule and loader order: only what is saved and restored differs.

Ray's failure detection dominates recovery, so two settings are measured, each (setting, tool) in a
fresh process, cluster and environment (`benchmarks/recovery/worker.py`): "fast"
(`LocalCluster(fast_failure_detection=True)`, Baton's default: GCS health checks 1 s x 3,
worker-group start timeout 15 s) and "ray-defaults" (Ray's own; Baton there only with
`--baton-ray-defaults`). The table gives each tool on its own defaults and both under identical
settings (the model-only variant runs only there). Baton runs on `trainer.fit` as a user gets it,
the standard recipes on a plain `TorchTrainer`.

    python -m benchmarks.recovery.run           # writes benchmarks/results/recovery.{json,png}
    python -m benchmarks.recovery.run --quick   # fewer steps (a few minutes)
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, arg_parser, start_worker, write_json
from benchmarks.recovery.worker import PLANS, RECIPE, Plan


def run_in_fresh_process(setting: str, tool: str, plan: str, work: Path,
                         dataset: str) -> dict[str, Any]:
    """`tool` under `setting` in a `recovery.worker` process; its figures, or the error."""
    out = work / f"{setting}-{tool}.json"
    payload = {"setting": setting, "tool": tool, "plan": plan, "work": str(work),
               "data": dataset, "out": str(out)}
    started = time.monotonic()
    # Each run starts from Ray's defaults in a clean environment; LocalCluster adds its own.
    # Its output (Ray's, and its summary line) goes straight to ours.
    proc = start_worker("recovery.worker", "run", json.dumps(payload), capture_stdout=False,
                        drop_env=("RAY_TRAIN_",))
    proc.wait(timeout=3000)
    print(f"{tool} on {setting}: {time.monotonic() - started:.0f} s", flush=True)
    return json.loads(out.read_text()) if out.exists() else {"error": "the run wrote nothing"}


def _row(name: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"| {name} | failed: {r['error']} |"
    lr = r.get("lr_first_step_after")
    return (f"| {name} | {r['recovery_s']:.1f} | {r['restart_s']:.1f} | {r['kill_step']} -> "
            f"{r['restored_step']} | {r['steps_redone']} | {'yes' if r['warm'] else 'NO'} | "
            f"{lr:.2e} |")


def report(results: dict[str, Any], plan: Plan) -> str:
    fast, default = results["fast"], results["ray-defaults"]
    lines = [
        "| run | recovery s | restart s | step lost -> restored | steps redone | "
        "optimizer warm | lr after restart |",
        "|---|---|---|---|---|---|---|",
        _row("Baton (its defaults: fast detection)", fast.get("baton", {"error": "missing"})),
        _row("standard (Ray defaults)", default.get("standard", {"error": "missing"})),
        _row("standard (fast detection, as Baton)", fast.get("standard", {"error": "missing"})),
        _row("standard, model only (fast detection, as Baton)",
             fast.get("standard-model", {"error": "missing"})),
    ]
    if "baton" in default:
        lines.append(_row("Baton (Ray defaults)", default["baton"]))
    ratios = {}
    b = fast.get("baton", {})
    for key, other in (("own_defaults", default.get("standard", {})),
                       ("identical_settings", fast.get("standard", {})),
                       ("identical_settings_model_only", fast.get("standard-model", {}))):
        if "recovery_s" in b and "recovery_s" in other:
            ratios[key] = b["recovery_s"] / other["recovery_s"]
    results["recovery_ratio_baton_over_standard"] = ratios
    lines.append("")
    lines.append("recovery time ratio Baton / standard: "
                 + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())
                 + f" (target <= 0.5); steps redone target <= {plan.snapshot_every}")
    return "\n".join(lines)


def plot(results: dict[str, Any], plan: Plan, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fast, default = results["fast"], results["ray-defaults"]
    same = [("Baton", fast.get("baton"), "tab:blue"),
            ("standard", fast.get("standard"), "tab:red"),
            ("standard, model only", fast.get("standard-model"), "tab:orange")]
    around = (max(0, plan.lose_at - 20), min(plan.steps, plan.lose_at + 45))
    panels = [
        ("each tool with its own defaults", [("Baton", fast.get("baton"), "tab:blue"),
                                             ("standard", default.get("standard"), "tab:red")],
         None),
        ("identical Ray settings (fast detection)", same, None),
        # Step losses are noisy (each step its own batch): a 5-step moving average shows
        # the bump after a restart.
        ("identical settings, around the node loss (5-step mean)", same, around),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.4))
    for ax, (title, runs, xlim) in zip(axes, panels, strict=True):
        for name, r, color in runs:
            if not r or "curve" not in r:
                continue
            curve = r["curve"]
            for attempt in sorted({c[2] for c in curve}):
                pts = sorted((s, loss) for s, loss, a in curve if a == attempt)
                if xlim is not None:
                    pts = [(s, sum(p[1] for p in pts[max(0, i - 4):i + 1])
                            / len(pts[max(0, i - 4):i + 1]))
                           for i, (s, _) in enumerate(pts) if xlim[0] <= s <= xlim[1]]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, lw=1.2,
                        ls="-" if attempt == 0 else "--",
                        label=f"{name}" + (" (after restart)" if attempt else ""))
            ax.axvline(r["kill_step"], color=color, lw=0.8, ls=":")
        if xlim is not None:
            ax.set_xlim(*xlim)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("training loss")
    fig.suptitle(f"Node loss at step ~{plan.lose_at} (dotted), 2 -> 1 workers, "
                 f"checkpoint/snapshot every {plan.snapshot_every} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = arg_parser(__doc__, __spec__)
    parser.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    parser.add_argument("--baton-ray-defaults", action="store_true",
                        help="also run Baton under Ray's default failure detection")
    args = parser.parse_args()
    plan_name = "quick" if args.quick else "full"
    plan = PLANS[plan_name]
    from data_state import prepare_corpus
    from trainer.config import load_recipe

    recipe = load_recipe(RECIPE, ['snapshots.run_uri="unused"'])
    with tempfile.TemporaryDirectory(prefix="baton-recovery-") as tmp:
        work = Path(tmp)
        dataset = str(work / "data")
        prepare_corpus(None, dataset, seq_len=recipe.data.seq_len,
                       max_bytes=recipe.data.max_corpus_bytes or None, progress=False)
        results: dict[str, Any] = {"plan": dataclasses.asdict(plan)}
        results["fast"] = {t: run_in_fresh_process("fast", t, plan_name, work, dataset)
                           for t in ("baton", "standard", "standard-model")}
        tools = ("standard", "baton") if args.baton_ray_defaults else ("standard",)
        results["ray-defaults"] = {t: run_in_fresh_process("ray-defaults", t, plan_name, work,
                                                           dataset)
                                   for t in tools}
    table = report(results, plan)
    print(table)
    name = "recovery-quick" if args.quick else "recovery"
    write_json(RESULTS / f"{name}.json", results)
    plot(results, plan, RESULTS / f"{name}.png")
    print(f"wrote {RESULTS / (name + '.json')} and {RESULTS / (name + '.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
