"""`baton runs ls DIR`: the runs under a directory, with lineage, progress and state.

Contract: `register(subparsers)` adds the `runs` group. `runs ls DIR [--json]` lists every
direct child of DIR (a local path or `s3://`) that holds a run (`run.json`, `snapshots/` or
`sessions.json`), one row each, by name: its parent (`run.json`'s `parent`: `URI@STEP` of
the run it was forked from, else `-`), the newest committed step over the run's last
`steps`, the last training loss in its metrics, and its state, derived from what is on
disk only:
- `running`: a live driver holds the lease (`lease.json` not expired, holder not known dead);
- `finished`: the newest committed step reached the run's `steps` (the last session's, else
  `run.json`'s);
- `failed`: the last session ended `failed`, or never recorded an end, or a dead driver left
  its lease behind;
- `stopped`: otherwise (ended by `--until`, `--time-limit` or Ctrl-C, or never started).
Everything read is untrusted: children that are symbolic links are skipped (a run listed
under DIR lies inside DIR), unreadable files make a field `-` (and the state is derived from
the rest), never a traceback. Bad input (an empty or missing DIR) is one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from elastic.store import SnapshotStore
from trainer.run import SESSIONS_NAME, read_sessions

_RUN_MARKERS = ("run.json", "snapshots", SESSIONS_NAME)


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("runs", help="list the runs under a directory")
    sub = group.add_subparsers(dest="runs_command", metavar="ACTION", required=True)
    ls = sub.add_parser("ls", help="runs with their parent, step, loss and state")
    ls.add_argument("dir", help="a directory of runs (local path or s3://bucket/prefix)")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(func=_cmd_ls)


def _fail(message: str) -> int:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def _cmd_ls(args: argparse.Namespace) -> int:
    if not args.dir:
        return _fail("runs ls: the directory is empty; pass a directory of runs")
    try:
        rows = list_runs(args.dir)
    except FileNotFoundError as err:
        return _fail(str(err))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"{args.dir}: no runs")
        return 0
    width = max(len("run"), *(len(r["run"]) for r in rows))
    print(f"{'run':<{width}}  {'state':<8}  {'step':>11}  {'loss':>8}  parent")
    for r in rows:
        progress = f"{r['step']}/{r['steps'] if r['steps'] is not None else '?'}"
        loss = f"{r['loss']:.4f}" if r["loss"] is not None else "-"
        print(f"{r['run']:<{width}}  {r['state']:<8}  {progress:>11}  {loss:>8}  "
              f"{r['parent'] or '-'}")
    return 0


def list_runs(directory: str, *, now: float | None = None) -> list[dict[str, Any]]:
    """One row per run under `directory` (module contract); FileNotFoundError if absent."""
    store = SnapshotStore(directory)
    if not store.isdir(store.root):
        raise FileNotFoundError(f"runs ls: {directory} is not a directory")
    rows = []
    for name in store.listdir(store.root):
        path = store.path(name)
        if name.startswith(".") or not store.isdir(path):
            continue  # a link is no directory here (elastic.storage): a run lies inside DIR
        run = SnapshotStore(f"{store.run_uri}/{name}")
        if not any(run.exists(run.path(m)) for m in _RUN_MARKERS):
            continue
        rows.append({"run": name, **describe_run(run, now=now)})
    return rows


def describe_run(run: SnapshotStore, *, now: float | None = None) -> dict[str, Any]:
    """Parent, newest committed step, target steps, last loss and state of one run."""
    run_json = _run_json(run)
    found = run_json.get("parent")
    parent: dict[str, Any] | None = found if isinstance(found, dict) else None
    parent_text = (f"{parent.get('uri')}@{parent.get('step')}"
                   if parent and isinstance(parent.get("uri"), str) else None)
    try:
        step = max(run.committed_steps(), default=0)
    except OSError:
        step = 0
    sessions = read_sessions(run)
    found_config = run_json.get("config")
    config: dict[str, Any] = found_config if isinstance(found_config, dict) else {}
    steps = sessions[-1]["schedule"]["steps"] if sessions else config.get("steps")
    steps = steps if isinstance(steps, int) and not isinstance(steps, bool) else None
    return {"parent": parent_text, "step": step, "steps": steps,
            "loss": _last_loss(run.run_uri),
            "state": _state(run, step, steps, sessions, now if now is not None else time.time())}


def _run_json(run: SnapshotStore) -> dict[str, Any]:
    try:
        value = run.read_run_json()
    except (ValueError, OSError):
        return {}
    return value if isinstance(value, dict) else {}


def _last_loss(run_uri: str) -> float | None:
    from trainer.run import read_records

    try:
        steps = [r for r in read_records(run_uri) if r["kind"] == "step"]
    except (ValueError, OSError):
        return None
    return float(steps[-1]["loss"]) if steps else None


def _lease(run: SnapshotStore, now: float) -> str:
    """"live", "dead" (left behind by a driver that is gone or stopped renewing) or "none"."""
    from elastic.lease import RunLease, holder_is_dead

    try:
        record = RunLease(run).read()
    except (ValueError, OSError, RuntimeError):
        return "none"
    if not isinstance(record, dict) or not record:  # none, or unreadable: not held against it
        return "none"
    expires = record.get("expires_at")
    found = record.get("holder")
    holder: dict[str, Any] = found if isinstance(found, dict) else {}
    if isinstance(expires, int | float) and expires > now and not holder_is_dead(holder):
        return "live"
    return "dead"


def _state(run: SnapshotStore, step: int, steps: int | None, sessions: list[dict[str, Any]],
           now: float) -> str:
    lease = _lease(run, now)
    if lease == "live":
        return "running"
    if steps is not None and step >= steps:
        return "finished"
    last = sessions[-1].get("outcome") if sessions else None
    if lease == "dead" or last == "failed" or (sessions and last is None):
        return "failed"
    return "stopped"
