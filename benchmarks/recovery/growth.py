"""What a node that arrives costs the running workers: in-place growth against a restart.

One run of this script trains the model, data and AdamW of `benchmarks/recovery/survivors.py`
on a fresh local Ray cluster per run that starts with 2 worker nodes (the run at 2 workers, at
most 3); once step 10 is reached a third node is added (`survivors_worker`, `grow`). Two modes,
alternating:

- in-process: Baton's default (`ElasticTorchTrainer`, replica groups): the running group grows
  in place, the new worker joins at a step boundary with a live worker's state;
- restart: `RecoveryConfig(in_process=False)`: Ray Train's resize, a snapshot on demand and a
  restart of the whole group at 3.

Per run, from every worker's per-step log (seconds after the node was added): the longest gap
between two steps of a worker that trained before and until the end (with none, from the old
group's last step to the new group's first), the new worker's first step, the first step at 3
workers, the steps redone and which samples were trained once, never or twice; and the final
parameters and both Adam moments against an uninterrupted 3-worker run. Medians [min, max].

    python -m benchmarks.recovery.growth              # 3 rounds (~8 min); writes
                                                      # benchmarks/results/recovery-growth.json
    python -m benchmarks.recovery.growth --rounds 1
"""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, arg_parser, write_json
from benchmarks.recovery.survivors import (
    PACE_S,
    _cell,
    run,
    state_cell,
    state_difference,
    step_time,
)

MODES = ("in-process", "restart")


def report(results: dict[str, Any]) -> str:
    lines = ["| mode | longest gap of a running worker s | new worker's first step s | first "
             "step at 3 workers s | processes kept | steps redone | samples never / twice | "
             "final params / m / v vs uninterrupted (rel. L2) |",
             "|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        runs = [r for r in results["runs"][mode] if "error" not in r]
        if not runs:
            errors = "; ".join(r["error"] for r in results["runs"][mode])
            lines.append(f"| {mode} | failed: {errors} | | | | | | |")
            continue
        state = state_cell(runs)
        lines.append(
            f"| {mode} | {_cell([r['longest_gap'] for r in runs])} | "
            f"{_cell([r['joined_first'] for r in runs])} | "
            f"{_cell([r['at_three'] for r in runs])} | "
            f"{_cell([r['kept_processes'] for r in runs], '{:.0f}')} | "
            f"{_cell([r['steps_redone'] for r in runs], '{:.0f}')} | "
            f"{_cell([r['samples']['never'] for r in runs], '{:.0f}')} / "
            f"{_cell([r['samples']['more_than_once'] for r in runs], '{:.0f}')} | {state} |")
    ours = [r for r in results["runs"]["in-process"] if "error" not in r]
    restart = [r for r in results["runs"]["restart"] if "error" not in r]
    if ours and restart:
        results["ratios"] = {
            "step_time_s": results["step_time_s"],
            "longest_gap_in_process_over_restart":
                statistics.median(r["longest_gap"] for r in ours)
                / statistics.median(r["longest_gap"] for r in restart),
            "at_three_in_process_over_restart":
                statistics.median(r["at_three"] for r in ours)
                / statistics.median(r["at_three"] for r in restart),
        }
        lines += ["", "ratios: " + ", ".join(f"{k} {v:.3g}"
                                             for k, v in results["ratios"].items())]
    return "\n".join(lines)


def main() -> int:
    parser = arg_parser(__doc__, __spec__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, Any] = {"rounds": args.rounds, "pace_s": PACE_S,
                               "runs": {m: [] for m in MODES}}
    work = RESULTS / "recovery-growth"  # the runs' logs, beside the results (not in git)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    reference = run("in-process", False, work / "reference")
    results["step_time_s"] = step_time(reference["log"])
    for r in range(args.rounds):
        for mode in MODES[r % 2:] + MODES[:r % 2]:
            result = run(mode, False, work / f"{mode}-{r}", grow=True)
            if "error" not in result and Path(result["final"]).exists():
                result["difference"] = state_difference(result["final"], reference["final"])
            results["runs"][mode].append(result)
    table = report(results)
    print(table)
    write_json(RESULTS / "recovery-growth.json", results)
    print(f"wrote {RESULTS / 'recovery-growth.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
