"""`baton fit`, `baton report` and `baton demo` (registered into `trainer.cli`).

Contract: bad recipes, overrides and run directories exit with code 2 and one line naming
the field and the fix, before Ray starts; so does a run directory whose lease another live
driver holds (`elastic.lease`; `--force-takeover` takes it anyway); a run that gives up (an
error no restart can fix, or `scaling.max_failures` restarts) exits with code 1 and one
line, `error: <the worker's message> (after N restarts)`; `fit` prints one progress line per
second (step, loss, tokens/s, world size) and a summary at the end; `report` writes a PNG and
prints the summary table.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.markup import escape

from trainer.cli import one_line
from trainer.config import ConfigError, load_recipe
from trainer.run_dir import RunDirError, check_run_dir

console = Console(stderr=True, soft_wrap=True)  # never wrap: logs are parsed


def register(subparsers: argparse._SubParsersAction) -> None:
    fit = subparsers.add_parser("fit", help="train a recipe (continues the run if it exists)")
    fit.add_argument("recipe", help="TOML recipe, e.g. recipes/default.toml")
    fit.add_argument("--run-dir", help="run directory (path or s3://...); sets snapshots.run_uri")
    fit.add_argument("--set", dest="overrides", action="append", default=[],
                     metavar="KEY=VALUE", help="override a recipe value, e.g. optim.lr=1e-3")
    fit.add_argument("--pace", type=float, default=0.0, metavar="SECONDS",
                     help="sleep this long after every step (demos and fault-injection tests)")
    fit.add_argument("--force-takeover", action="store_true",
                     help="take the run over even if another driver holds its lease; that "
                          "driver's snapshots are refused from then on")
    fit.set_defaults(func=_cmd_fit)

    report = subparsers.add_parser("report", help="plot a run's metrics into a PNG")
    report.add_argument("run_uri")
    report.add_argument("--out", help="PNG path (default: report.png in the current directory)")
    report.set_defaults(func=_cmd_report)

    demo = subparsers.add_parser("demo", help="the elastic demo on a local multi-node cluster")
    demo.add_argument("--recipe", default="recipes/default.toml")
    demo.add_argument("--run-dir", default="runs/demo")
    demo.set_defaults(func=_cmd_demo)


def _print_progress(record: dict[str, Any]) -> None:
    val = f" val {record['val_loss']:.4f}" if record.get("val_loss") is not None else ""
    console.print(
        f"step {record['step']:>6}  loss {record['loss']:.4f}{val}  "
        f"{record['tokens_per_s']:>8.0f} tok/s  workers {record['world_size']}  "
        f"lr {record['lr']:.2e}  last commit {record.get('last_commit', '-')}"
    )
    if record.get("warning"):
        console.print(f"[yellow]warning:[/yellow] {escape(record['warning'])}")


def _cmd_fit(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"snapshots.run_uri={json.dumps(args.run_dir)}")
    try:
        cfg = load_recipe(args.recipe, overrides)
        resumed = check_run_dir(cfg)
    except (ConfigError, RunDirError) as err:
        console.print(f"[red]error:[/red] {escape(one_line(err))}")
        return 2
    from elastic.lease import LeaseHeldError, LeaseLostError, RunLease
    from elastic.store import SnapshotStore

    # One driver per run directory: take the lease before Ray starts (and before importing
    # it), so a second driver fails in a second instead of after a cluster start-up.
    lease = RunLease(SnapshotStore(cfg.snapshots.run_uri))
    try:
        record = lease.acquire(force=args.force_takeover)
    except LeaseHeldError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        return 2
    from trainer.commit_watch import FinalCommitError
    from trainer.ray_fit import fit  # imports Ray: only once the input is known to be good
    from trainer.scaling import RunFailedError

    try:
        if record["epoch"] > 1:
            console.print(f"took over the run lease of {cfg.snapshots.run_uri} "
                          f"(epoch {record['epoch']})")
        if resumed:
            console.print(f"continuing run {cfg.snapshots.run_uri} from committed step {resumed}")
        else:
            console.print(f"starting run {cfg.snapshots.run_uri}")
        result = fit(cfg, on_progress=_print_progress, pace_s=args.pace, lease=lease)
    except (LeaseLostError, RunFailedError, FinalCommitError) as err:
        # One line each: the lease was taken over; the worker's message and the restarts;
        # trained to the end, but the end is not committed (and why).
        console.print(f"[red]error:[/red] {escape(str(err))}")
        return 1
    finally:
        lease.release()  # only if still ours
    _print_summary(result.summary.to_dict())
    return 0


def _print_summary(summary: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="run summary")
    table.add_column("what")
    table.add_column("value")
    for key, value in summary.items():
        table.add_row(key.replace("_", " "), str(value))
    Console().print(table)


def _cmd_report(args: argparse.Namespace) -> int:
    from trainer.report import write_report

    out = args.out or "report.png"
    try:
        summary = write_report(args.run_uri, out)
    except (ValueError, OSError) as err:  # no such run, no metrics, unwritable --out
        console.print(f"[red]error:[/red] {escape(one_line(err))}")
        return 2
    _print_summary(summary.to_dict())
    console.print(f"report written to {out}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from trainer.demo import run_demo

    return run_demo(args.recipe, args.run_dir)

