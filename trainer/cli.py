"""The `baton` command line.

Contract: `main(argv)` parses `argv` (default `sys.argv[1:]`), runs one subcommand and returns
its exit code. Each package that owns a command group exposes `register(subparsers)`, which
adds its parsers and sets `func` (a callable taking the parsed namespace and returning an exit
code). This module only wires the groups together, so every command is defined next to the
code it drives.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, what it adds). Imported lazily so `baton --help` stays fast and a broken optional
# group does not take the whole CLI down.
_COMMAND_GROUPS: tuple[str, ...] = (
    "data_state.cli",  # baton data prepare|inspect
    "elastic.cli",  # baton snapshots ls|show|verify|export
    "trainer.fit_cli",  # baton fit|report|demo
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
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
