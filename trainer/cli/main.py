"""The `baton` command line.

Contract: `main(argv)` parses `argv` (default `sys.argv[1:]`), runs one subcommand and returns
its exit code. Each command module of `trainer.cli` exposes `register(subparsers)`, which
adds its parsers and sets `func` (a callable taking the parsed namespace and returning an exit
code). This module only wires the groups together.

Errors: commands report bad input themselves (one line on stderr, exit 2). As a safety net, a
`ValueError` that still escapes a command prints `error: <message>` on one line and exits 2,
an `OSError` the same with exit 1; `BATON_DEBUG=1` re-raises instead, for the traceback.
`KeyboardInterrupt` and other exceptions are not caught.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# (module, what it adds). Imported lazily so `baton --help` stays fast and a broken optional
# group does not take the whole CLI down.
_COMMAND_GROUPS: tuple[str, ...] = (
    "trainer.cli.data",  # baton data prepare|inspect
    "trainer.cli.snapshots",  # baton snapshots ls|show|verify|export|rewind|restore-quarantined
    "trainer.cli.fit",  # baton fit
    "trainer.cli.report",  # baton report|demo
    "trainer.cli.runs",  # baton runs ls
    "trainer.cli.sketch_plan",  # baton sketch-plan
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton",
        description="Elastic, resumable PyTorch training on Ray.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _COMMAND_GROUPS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            # Only tolerate the group module itself not existing yet; a missing dependency
            # inside an existing module is a real error and must surface.
            if err.name == module_name:
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as err:
        if os.environ.get("BATON_DEBUG") == "1":
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2 if isinstance(err, ValueError) else 1


def one_line(err: BaseException | str) -> str:
    """`err`'s message on one line (logs are parsed line by line), never empty."""
    text = " ".join(str(err).split())
    if isinstance(err, BaseException):
        return text or type(err).__name__
    return text


if __name__ == "__main__":
    sys.exit(main())
