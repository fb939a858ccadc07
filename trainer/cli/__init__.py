"""Every `baton` command: one module per command group, each with `register(subparsers)`.

The room's modules
------------------
* ``main``: ``main(argv)``, the ``baton`` console script; wires the groups together and turns
  an escaped ``ValueError``/``OSError`` into one line (its docstring is the CLI's contract).
* ``fit``: ``baton fit`` (sessions, forks, the run lease, the progress display);
  ``report``: ``baton report`` and ``baton demo``.
* ``runs``: ``baton runs ls``; ``snapshots``: ``baton snapshots ls|show|verify|export|rewind|
  restore-quarantined``; ``data``: ``baton data prepare|inspect``; ``sketch_plan``: ``baton
  sketch-plan``.

Import rule (``tests/project/test_imports.py``): the top layer. A command parses, calls one
room below (``trainer.on_ray`` to train, ``trainer.run`` for a run directory, ``elastic`` for
snapshots, ``data_state`` for datasets) and prints; nothing below imports a command. A
command module imports Ray and the S3 stack only inside the command that needs them, so
``baton --help`` starts no Ray and a local-only install runs every command.
"""

from __future__ import annotations

from trainer.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
