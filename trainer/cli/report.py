"""`baton report` and `baton demo` (registered into `trainer.cli.main`).

Contract: `report RUN [--out PNG]` plots a run's metrics into a PNG (default `report.png` in
the current directory, `trainer.run.report`) and prints the summary table; a run without
metrics, or an `--out` that cannot be written, is one line on stderr, exit 2. `demo` runs the
elastic demo on a local multi-node cluster (`trainer.on_ray.demo`).
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape

from trainer.cli.main import one_line

console = Console(stderr=True, soft_wrap=True)  # never wrap: logs are parsed


def register(subparsers: argparse._SubParsersAction) -> None:
    report = subparsers.add_parser("report", help="plot a run's metrics into a PNG")
    report.add_argument("run_uri")
    report.add_argument("--out", help="PNG path (default: report.png in the current directory)")
    report.set_defaults(func=_cmd_report)

    demo = subparsers.add_parser("demo", help="the elastic demo on a local multi-node cluster")
    demo.add_argument("--recipe", default="recipes/default.toml")
    demo.add_argument("--run-dir", default="runs/demo")
    demo.set_defaults(func=_cmd_demo)


def _cmd_report(args: argparse.Namespace) -> int:
    from trainer.run import print_summary, write_report

    out = args.out or "report.png"
    try:
        summary = write_report(args.run_uri, out)
    except (ValueError, OSError) as err:  # no such run, no metrics, unwritable --out
        console.print(f"[red]error:[/red] {escape(one_line(err))}")
        return 2
    print_summary(summary.to_dict(), Console(soft_wrap=True))
    console.print(f"report written to {out}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from trainer.on_ray import run_demo

    return run_demo(args.recipe, args.run_dir)
