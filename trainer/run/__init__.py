"""The driver: what `baton fit` (or `trainer.fit`) does around the workers, before, during and
after Ray.

The room's modules
------------------
* ``run_dir``: the run directory's checks before Ray starts (reachable, writable, a run this
  recipe may continue: ``check_run_dir``); ``preflight``: the dataset and a place for the
  workers; ``fork``: a new run from a committed snapshot of another (``--from``).
* ``session_log``: the sessions a run was trained in (``RUN/sessions.json``), ``--time-limit``
  and its budget.
* ``commit_watch``: the newest committed step as the driver sees it; ``metrics``: the
  run's metric records; ``sinks``: where they go (JSONL, TensorBoard, W&B).
* ``terminal``: the progress display; ``report``: a run's metrics as a PNG and a summary.

Import rule (``tests/project/test_imports.py``): the driver imports the worker
(``trainer.train``), ``trainer.config`` and the layers below, never Ray or a command: the
Ray side (``trainer.on_ray``) and the commands (``trainer.cli``) call into it, through the
names below (loaded on first use, so one command loads only the modules it needs).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.run.commit_watch import CommitWatch, FinalCommitError, final_commit_error
    from trainer.run.fork import make_fork, parse_source, plan_fork
    from trainer.run.metrics import MetricsWriter, RunSummary, read_records, summarize
    from trainer.run.preflight import check_worker_fits, ensure_dataset
    from trainer.run.report import write_report
    from trainer.run.run_dir import RunDirError, check_run_dir
    from trainer.run.session_log import (
        SESSIONS_NAME,
        TimeBudget,
        begin_session,
        end_session,
        parse_duration,
        read_sessions,
    )
    from trainer.run.sinks import SinkSet, open_sinks
    from trainer.run.terminal import (
        ProgressDisplay,
        RestartTracker,
        fmt_mib,
        fmt_ratio,
        print_summary,
        snapshot_has_optimizer_state,
    )

# Loaded on first use (PEP 562): the module that defines each name.
_LAZY = {
    "CommitWatch": "trainer.run.commit_watch",
    "FinalCommitError": "trainer.run.commit_watch",
    "final_commit_error": "trainer.run.commit_watch",
    "make_fork": "trainer.run.fork",
    "parse_source": "trainer.run.fork",
    "plan_fork": "trainer.run.fork",
    "MetricsWriter": "trainer.run.metrics",
    "RunSummary": "trainer.run.metrics",
    "read_records": "trainer.run.metrics",
    "summarize": "trainer.run.metrics",
    "check_worker_fits": "trainer.run.preflight",
    "ensure_dataset": "trainer.run.preflight",
    "write_report": "trainer.run.report",
    "RunDirError": "trainer.run.run_dir",
    "check_run_dir": "trainer.run.run_dir",
    "SESSIONS_NAME": "trainer.run.session_log",
    "TimeBudget": "trainer.run.session_log",
    "begin_session": "trainer.run.session_log",
    "end_session": "trainer.run.session_log",
    "parse_duration": "trainer.run.session_log",
    "read_sessions": "trainer.run.session_log",
    "SinkSet": "trainer.run.sinks",
    "open_sinks": "trainer.run.sinks",
    "ProgressDisplay": "trainer.run.terminal",
    "RestartTracker": "trainer.run.terminal",
    "fmt_mib": "trainer.run.terminal",
    "fmt_ratio": "trainer.run.terminal",
    "print_summary": "trainer.run.terminal",
    "snapshot_has_optimizer_state": "trainer.run.terminal",
}

__all__ = ["CommitWatch", "FinalCommitError", "MetricsWriter", "ProgressDisplay", "RestartTracker",
           "RunDirError", "RunSummary", "SESSIONS_NAME", "SinkSet", "TimeBudget", "begin_session",
           "check_run_dir", "check_worker_fits", "end_session", "ensure_dataset",
           "final_commit_error", "fmt_mib", "fmt_ratio", "make_fork", "open_sinks",
           "parse_duration", "parse_source", "plan_fork", "print_summary", "read_records",
           "read_sessions", "snapshot_has_optimizer_state", "summarize", "write_report"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer.run' has no attribute {name!r}")
    # Looked up each time, not cached here: the name stays its module's (a patch is seen).
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
