"""What a node loss costs the survivors: in-process recovery against a group restart and torchft.

One run of this script trains the same 21k-parameter MLP, data and AdamW with three workers on
a fresh local multi-node Ray cluster per run (`benchmarks/recovery/survivors_worker.py`: a head
and 3 worker nodes, fast failure detection), kills a worker's node once step 25 is reached and
adds a node 2 s later, in three modes:

- in-process: Baton with in-process recovery (`ElasticTorchTrainer`, the default): the
  survivors re-form their group and train on at 2, the replacement joins at a step boundary;
- restart: Baton with `RecoveryConfig(in_process=False)`: Ray Train restarts the whole group,
  which restores the newest snapshot (every 10 steps, RAM tier);
- torchft: the same model on torchft under Ray 2.60's `TorchftConfig` (the outside baseline:
  `benchmarks/recovery/survivors_loops.py` writes its loop as Ray's torchft example does).

Modes alternate in every round (each round starts with the next one). Per run, from every
worker's per-step log: the kill to the next step a survivor completes, the longest gap between
two steps of a survivor (the loss and the replacement's join both fall in it; no survivors: the
group's gap), the kill to the replacement's first step, the steps redone, and which samples of
the epoch were trained once, never or twice. One uninterrupted run per tool gives the reference
for the final parameters and both Adam moments (relative L2 difference, the largest over the
tensors). The table prints medians [min, max] over the rounds and the targets of issue 37.

    python -m benchmarks.recovery.survivors             # 3 rounds (~15 min); writes
                                                        # benchmarks/results/recovery-survivors*
    python -m benchmarks.recovery.survivors --rounds 1  # one of each (~6 min)
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, arg_parser, spread, start_worker, write_json

MODES = ("in-process", "restart", "torchft")
PACE_S = 0.15


def run(mode: str, kill: bool, work: Path, grow: bool = False) -> dict[str, Any]:
    """One run in a fresh process (`survivors_worker`): `kill` loses a node, `grow` adds one."""
    out = work.with_suffix(".json")
    payload = {"mode": mode, "kill": kill, "grow": grow, "work": str(work), "out": str(out),
               "pace_s": PACE_S}
    started = time.monotonic()
    proc = start_worker("recovery.survivors_worker", "run", json.dumps(payload),
                        capture_stdout=False, drop_env=("RAY_TRAIN_",))
    proc.wait(timeout=1800)
    result = json.loads(out.read_text()) if out.exists() else {"error": "the run wrote nothing"}
    result["wall_s"] = time.monotonic() - started
    result["final"] = str(work / "final.safetensors")
    result["log"] = str(work / "steps.jsonl")
    event = " (node lost)" if kill else " (node added)" if grow else ""
    print(f"{mode}{event}: {result['wall_s']:.0f} s", flush=True)
    return result


def state_difference(path: str, reference: str) -> dict[str, float]:
    """The largest relative L2 difference, over the parameters and each Adam moment."""
    import torch
    from safetensors.torch import load_file

    mine, ref = load_file(path), load_file(reference)
    out: dict[str, float] = {}
    for kind, suffix in (("params", None), ("exp_avg", ".exp_avg"),
                         ("exp_avg_sq", ".exp_avg_sq")):
        keys = [k for k in ref if (k.startswith("model.") if suffix is None
                                   else k.endswith(suffix))]
        out[kind] = max((float(torch.linalg.norm(mine[k] - ref[k]) / torch.linalg.norm(ref[k]))
                         for k in keys), default=float("nan"))
    return out


def step_time(log: str) -> float:
    """The median time between two steps of one worker before the node loss."""
    records = [json.loads(line) for line in Path(log).read_text().splitlines() if line.strip()]
    first = records[0]["pid"]
    times = sorted(r["time"] for r in records if r["pid"] == first)[:20]
    return statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


def _cell(values: list[float | None], fmt: str = "{:.2f}") -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "-"
    s = spread(present)
    text = fmt.format(s["median"])
    return text if len(present) == 1 else f"{text} [{fmt.format(s['min'])}, {fmt.format(s['max'])}]"


def state_cell(runs: list[dict[str, Any]]) -> str:
    """The worst final parameters / m / v difference over `runs`, as a table cell."""
    diffs = [r["difference"] for r in runs if "difference" in r]
    return " / ".join(f"{max(d[k] for d in diffs):.1e}"
                      for k in ("params", "exp_avg", "exp_avg_sq")) if diffs else "-"


def report(results: dict[str, Any]) -> str:
    lines = ["| mode | survivor's next step s | longest survivor gap s | replacement's first "
             "step s | steps redone | samples never / twice | final params / m / v vs "
             "uninterrupted (rel. L2) |", "|---|---|---|---|---|---|---|"]
    for mode in MODES:
        runs = [r for r in results["runs"][mode] if "error" not in r]
        errors = [r["error"] for r in results["runs"][mode] if "error" in r]
        if not runs:
            lines.append(f"| {mode} | failed: {'; '.join(errors)} | | | | | |")
            continue
        state = state_cell(runs)
        lines.append(
            f"| {mode} | {_cell([r['survivor_first'] for r in runs])} | "
            f"{_cell([r['longest_gap'] for r in runs])} | "
            f"{_cell([r['replacement_first'] for r in runs])} | "
            f"{_cell([r['steps_redone'] for r in runs], '{:.0f}')} | "
            f"{_cell([r['samples']['never'] for r in runs], '{:.0f}')} / "
            f"{_cell([r['samples']['more_than_once'] for r in runs], '{:.0f}')} | {state} |")
    ours = [r for r in results["runs"]["in-process"] if "error" not in r]
    restart = [r for r in results["runs"]["restart"] if "error" not in r]
    if ours and restart:
        gap = statistics.median(r["longest_gap"] for r in ours)
        results["targets"] = {
            "step_time_s": results["step_time_s"],
            "longest_gap_within_one_step_plus_1s": max(r["longest_gap"] for r in ours)
            <= results["step_time_s"] + 1.0,
            "redo_at_most_the_interrupted_step": max(r["steps_redone"] for r in ours) <= 1,
            "state_within_1e-5": all(max(r["difference"].values()) <= 1e-5
                                     for r in ours if "difference" in r),
            "every_sample_once": all(r["samples"]["never"] == r["samples"]["more_than_once"]
                                     == 0 for r in ours),
            "longest_gap_ratio_in_process_over_restart": gap / statistics.median(
                r["longest_gap"] for r in restart),
        }
        lines += ["", "targets: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float)
                                              else f"{k} {v}"
                                              for k, v in results["targets"].items())]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4), sharey=True)
    for ax, mode in zip(axes, MODES, strict=True):
        first = next((r for r in results["runs"][mode] if "error" not in r), None)
        if first is None or not Path(first["log"]).exists():
            continue
        records = [json.loads(x) for x in Path(first["log"]).read_text().splitlines() if x]
        killed = first.get("killed_at") or min(r["time"] for r in records)
        pids = sorted({r["pid"] for r in records}, key=lambda p: min(
            r["time"] for r in records if r["pid"] == p))
        for i, pid in enumerate(pids):  # one lane per process, a tick per step it completed
            times = [r["time"] - killed for r in records if r["pid"] == pid]
            ax.plot(times, [i + 1] * len(times), "|", ms=9)
        ax.axvline(0, color="k", lw=0.8, ls=":")
        ax.set_title(mode)
        ax.set_xlabel("seconds after the node loss")
        ax.set_yticks(range(1, len(pids) + 1))
    axes[0].set_ylabel("worker process (in order of start)")
    fig.suptitle("Each worker process's steps around a node loss (3 workers; a node is added "
                 "2 s after; a tick per step)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def recompute() -> int:
    """The figures of the last run again, from its logs (after a change to `analyse`)."""
    from benchmarks.recovery.survivors_worker import analyse

    results = json.loads((RESULTS / "recovery-survivors.json").read_text())
    for runs in results["runs"].values():
        for r in runs:
            if "error" in r or not Path(r["log"]).exists():
                continue
            records = sorted((json.loads(x) for x in Path(r["log"]).read_text().splitlines()
                              if x.strip()), key=lambda x: x["time"])
            r.update(analyse(records, r["killed_at"]))
    print(report(results))
    plot(results, RESULTS / "recovery-survivors.png")
    write_json(RESULTS / "recovery-survivors.json", results)
    return 0


def main() -> int:
    parser = arg_parser(__doc__, __spec__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--recompute", action="store_true",
                        help="recompute the figures from the kept logs of the last run")
    args = parser.parse_args()
    if args.recompute:
        return recompute()
    results: dict[str, Any] = {"rounds": args.rounds, "pace_s": PACE_S,
                               "runs": {m: [] for m in MODES}}
    # The runs' logs stay beside the results (not kept in git): the figures can be recomputed.
    work = RESULTS / "recovery-survivors"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    references = {"baton": run("in-process", False, work / "ref-baton"),
                  "torchft": run("torchft", False, work / "ref-torchft")}
    results["step_time_s"] = step_time(references["baton"]["log"])
    for r in range(args.rounds):
        for mode in MODES[r % 3:] + MODES[:r % 3]:
            result = run(mode, True, work / f"{mode}-{r}")
            reference = references["torchft" if mode == "torchft" else "baton"]
            if "error" not in result and Path(result["final"]).exists():
                result["difference"] = state_difference(result["final"], reference["final"])
            results["runs"][mode].append(result)
    table = report(results)
    plot(results, RESULTS / "recovery-survivors.png")
    print(table)
    write_json(RESULTS / "recovery-survivors.json", results)
    print(f"wrote {RESULTS / 'recovery-survivors.json'} and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
