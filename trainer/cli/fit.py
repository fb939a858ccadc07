"""`baton fit` (registered into `trainer.cli.main`).

Contract: bad recipes, overrides and run directories exit with code 2 and one line naming
the field and the fix, before Ray starts; so does a run directory whose lease another live
driver holds (`elastic.lease.run_lease`; `--force-takeover` takes it anyway); a run that gives up
(an error no restart can fix, or `scaling.max_failures` restarts) exits with code 1 and one line,
`error: <the worker's message> (after N restarts)`; `fit` shows a progress bar with ETA on a
terminal (one plain line per second elsewhere: step/total, loss, tokens/s, workers, last commit,
ETA), each restart as one event line, Ray's own messages in RUN/logs/ray.log
(`trainer.run.terminal`, `trainer.on_ray.monitor.RunFeed`, `trainer.on_ray.ray_messages`),
and a summary with formatted numbers at the end.

Sessions (`trainer.run.session_log`): `--until STEP` and `--time-limit 2h30m` end the session
early with that step committed, exit 0 and print `stopped at step N; continue with: <the
command>`; so does the first Ctrl-C (SIGINT) on the driver ("stopping after the current
step"); a second Ctrl-C aborts at once (exit 130; the steps since the last commit are lost).
The time limit stops early enough for the final commit (`TimeBudget`'s rule). Continuing
with another learning-rate schedule (`steps`, `optim.lr`, `optim.warmup_steps`,
`optim.min_lr_ratio`) is refused unless `--reschedule`, which prints what the schedule does
from there. Each session is recorded in `RUN/sessions.json` with its outcome.
Forks (`trainer.run.fork`): `--from RUN[@STEP]` starts the new run `--run-dir` from a committed
snapshot of RUN, optimizer warm (`--data-cursor auto|keep|reset`); refusals are one line,
exit 2, before Ray starts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.markup import escape

from trainer.cli.main import one_line
from trainer.config import ConfigError, load_recipe
from trainer.run import RunDirError, TimeBudget, check_run_dir, parse_duration

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
    fit.add_argument("--until", metavar="STEP",
                     help="end this session at STEP with a committed snapshot (exit 0); the "
                          "run continues later from there")
    fit.add_argument("--time-limit", metavar="DURATION",
                     help="end this session within DURATION (e.g. 2h30m, 45m, 90s), leaving "
                          "time to commit the last step")
    fit.add_argument("--reschedule", action="store_true",
                     help="continue with a changed learning-rate schedule (steps, optim.lr, "
                          "optim.warmup_steps, optim.min_lr_ratio)")
    fit.add_argument("--from", dest="fork_from", metavar="RUN[@STEP]",
                     help="fork: start this new run (--run-dir) from a committed snapshot of "
                          "RUN (its newest without @STEP), optimizer warm")
    fit.add_argument("--data-cursor", metavar="auto|keep|reset",
                     help="with --from: keep the parent's data position, restart the data at "
                          "epoch 0, or auto (keep it when the dataset and seed are the same)")
    fit.set_defaults(func=_cmd_fit)


class _FitTerminal:
    """What a fit shows (`trainer.run.terminal`): a progress bar with ETA (one plain line per
    update off a terminal) and each worker-group start and restart as an event line
    (`RunFeed`), with Ray's own messages sent to a log file whose path is printed once
    (`ray_messages_to`). The `[logging]` sinks are fed by the run's monitor, not here.
    Call it with each progress record; `close()` once the fit has ended."""

    def __init__(self, cfg: Any) -> None:
        from trainer.on_ray import RunFeed, ray_log_path, ray_log_root, ray_messages_to
        from trainer.run import ProgressDisplay

        self.feed = RunFeed(cfg, ProgressDisplay(cfg.steps, console))
        self._ray_messages = contextlib.ExitStack()
        self._ray_messages.enter_context(ray_messages_to(
            ray_log_path(cfg), lambda text: console.print(escape(text), highlight=False),
            ray_log_root(cfg)))

    def __call__(self, record: dict[str, Any]) -> None:
        self.feed(record)

    def close(self) -> None:
        try:
            self.feed.close()
        finally:
            self._ray_messages.close()


@dataclasses.dataclass
class _Session:
    """What this `baton fit` session was asked to do, checked before Ray starts."""

    until: int | None = None
    time_limit_s: float | None = None
    fork: Any = None  # trainer.run.fork.ForkPlan


MAX_PACE_S = 3600.0  # --pace: seconds of sleep per step (demos and tests)


def _parse_session(args: argparse.Namespace, cfg: Any, resumed: int | None) -> _Session:
    """Check the session flags (one-line `ValueError`s naming the flag)."""
    session = _Session()
    if not (math.isfinite(args.pace) and 0 <= args.pace <= MAX_PACE_S):
        raise ValueError(f"--pace {args.pace:g}: must be a number of seconds between 0 and "
                         f"{MAX_PACE_S:g}")
    if resumed is not None and resumed > cfg.steps:
        raise ValueError(f"steps: the run is at committed step {resumed}, past steps = "
                         f"{cfg.steps}; set steps above {resumed}, e.g. --set "
                         f"steps={resumed + 100} --reschedule")
    if args.time_limit is not None:
        session.time_limit_s = parse_duration(args.time_limit)
    if args.until is not None:
        text = str(args.until).strip()
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"--until {args.until!r}: must be a step number >= 1")
        session.until = int(text)
        if session.until > cfg.steps:
            raise ValueError(f"--until {session.until}: past the run's last step (steps = "
                             f"{cfg.steps}); to train longer, --set steps=N --reschedule")
        if resumed is not None and session.until <= resumed:
            raise ValueError(f"--until {session.until}: the run is already at committed step "
                             f"{resumed}; pick a later step")
    return session


def _check_before_lease(args: argparse.Namespace) -> tuple[Any, _Session, int]:
    """The recipe, this session's flags, the fork's plan and the run directory's checks, all
    before the lease and Ray: (the config, the session, the newest committed step). Raises
    `ConfigError`, `RunDirError` or `ValueError` (one line each)."""
    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"snapshots.run_uri={json.dumps(args.run_dir)}")
    cfg = load_recipe(args.recipe, overrides)
    if args.data_cursor is not None and not args.fork_from:
        raise ValueError("--data-cursor: only with --from RUN[@STEP] (a fork); a continued "
                         "run always keeps its data cursor")
    _parse_session(args, cfg, None)  # flag syntax first: no storage touched for a typo
    plan = None
    if args.fork_from:
        from trainer.run import parse_source, plan_fork

        plan = plan_fork(cfg, *parse_source(args.fork_from), args.data_cursor or "auto")
    resumed = check_run_dir(cfg, reschedule=args.reschedule)
    session = _parse_session(args, cfg, plan.step if plan is not None else resumed)
    session.fork = plan
    return cfg, session, resumed


def _cmd_fit(args: argparse.Namespace) -> int:
    started = time.monotonic()  # a --time-limit counts from here: the whole command
    try:
        cfg, session, resumed = _check_before_lease(args)
    except (ConfigError, RunDirError, ValueError) as err:
        console.print(f"[red]error:[/red] {escape(one_line(err))}")
        return 2
    from elastic.lease import LeaseHeldError, LeaseLostError, held_lease
    from elastic.store import SnapshotStore

    # One driver per run directory: take the lease before Ray starts (and before importing
    # it), so a second driver fails in a second instead of after a cluster start-up.
    # Renewed from now on, and only here (the fit and the trainer use this lease as it is):
    # making a fork (preparing its corpus, copying its shards) may take longer than the
    # lease's ttl, and a lease left to expire meanwhile could be taken over.
    store = SnapshotStore(cfg.snapshots.run_uri)
    held = contextlib.ExitStack()
    try:
        lease = held.enter_context(held_lease(store, force=args.force_takeover))
    except LeaseHeldError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        return 2
    from trainer.on_ray import RunFailedError
    from trainer.run import FinalCommitError, begin_session, end_session

    outcome, step, began = "failed", None, False
    with held:  # released on leaving (only if still ours), after the session's end is recorded
        try:
            if lease.epoch > 1:
                console.print(f"took over the run lease of {cfg.snapshots.run_uri} "
                              f"(epoch {lease.epoch})")
            try:
                resumed = _start_session(args, cfg, store, session, resumed)
            except (ConfigError, RunDirError, ValueError) as err:
                console.print(f"[red]error:[/red] {escape(one_line(err))}")
                return 2
            begin_session(store, cfg, resumed, rescheduled=args.reschedule,
                          forked_from=args.fork_from)
            began = True
            if session.time_limit_s is not None:
                session.time_limit_s -= time.monotonic() - started
            result = _fit_interruptibly(cfg, args, session, lease, resumed)
        except (KeyboardInterrupt, SystemExit):  # a second Ctrl-C; SIGTERM
            outcome = "aborted"
            if sys.exc_info()[0] is SystemExit:
                raise
            console.print("[red]aborted[/red]: the steps since the last committed snapshot are "
                          f"lost; continue with: {_continue_command(args)}")
            return 130
        except (LeaseLostError, RunFailedError, FinalCommitError) as err:
            # One line each: the lease was taken over; the worker's message and the restarts;
            # trained to the end, but the end is not committed (and why).
            console.print(f"[red]error:[/red] {escape(one_line(err))}")
            if isinstance(err, LeaseLostError):
                outcome = ""  # not ours to record any more
            return 1
        else:
            stopped_at = getattr(result, "stopped_at", None)
            outcome = ("stopped" if stopped_at is not None and stopped_at < cfg.steps
                       else "finished")
            step = stopped_at if outcome == "stopped" else cfg.steps
        finally:
            if began and outcome and lease.token is not None and not lease.lost:
                _record_end(store, outcome, step, end_session)
    _print_summary(result.summary.to_dict())
    if outcome == "stopped":
        console.print(f"stopped at step {step}; continue with: {_continue_command(args)}")
    return 0


def _start_session(args: argparse.Namespace, cfg: Any, store: Any, session: _Session,
                   resumed: int) -> int:
    """Under the lease: make the fork, say what this session starts from; returns the step."""
    from trainer.train import describe_schedule, saved_schedule, schedule_changes

    if session.fork is not None:
        from trainer.run import make_fork

        fork = make_fork(session.fork, cfg)
        console.print(
            f"forked {fork.parent['uri']} at step {fork.step} into {cfg.snapshots.run_uri}: "
            f"{fork.files} shard file(s), {fork.bytes / 2**20:.1f} MiB verified, optimizer "
            f"warm, data cursor {'kept' if fork.cursor_kept else 'reset to epoch 0'}")
        resumed = fork.step
    elif resumed:
        console.print(f"continuing run {cfg.snapshots.run_uri} from committed step {resumed}")
    else:
        console.print(f"starting run {cfg.snapshots.run_uri}")
    changes = [] if session.fork is not None else schedule_changes(
        saved_schedule(store, resumed), cfg)
    if changes:
        console.print("rescheduled: " + ", ".join(f"{name} {json.dumps(old)} -> "
                                                  f"{json.dumps(new)}"
                                                  for name, old, new in changes))
    if changes or (resumed and session.fork is not None):
        console.print(f"schedule from here: {describe_schedule(cfg.optim, cfg.steps, resumed)}")
    return resumed


def _record_end(store: Any, outcome: str, step: int | None,
                end_session: Callable[..., None]) -> None:
    try:
        if step is None:  # aborted or failed: what the run holds now
            step = max(store.committed_steps(), default=0)
        end_session(store, outcome, step)
    except (ValueError, OSError) as err:  # the log is a record, never a reason to fail
        logging.getLogger("baton.fit").warning("could not record the session's end: %s", err)


def _fit_interruptibly(cfg: Any, args: argparse.Namespace, session: _Session,
                       lease: Any, resumed: int) -> Any:
    """Run `trainer.on_ray.ray_fit.fit` in a thread while the main thread owns the signals: the
    first SIGINT sets the stop event (the workers commit at the next step boundary and end),
    the second raises KeyboardInterrupt here; SIGTERM exits as Ray's own handler would.
    Ray Train installs its SIGINT handler (abort the run, nothing committed) only when
    `fit` runs in the main thread, hence the thread."""
    # The budget first: importing Ray takes seconds of the --time-limit too.
    budget = TimeBudget(session.time_limit_s) if session.time_limit_s is not None else None
    # Imports Ray: only once the input is known to be good.
    from trainer.on_ray import connect_ray, fit
    from trainer.run import ensure_dataset

    cfg = ensure_dataset(cfg)  # the default corpus, prepared once before Ray starts
    stop = threading.Event()
    done = threading.Event()
    outcome: dict[str, Any] = {}
    terminal = _FitTerminal(cfg)  # from here on Ray's own messages go to its log file
    try:
        # Ray in this thread, not the fit's: Ray's local processes end with the thread that
        # started them (`connect_ray`), and this one outlives the fit.
        connect_ray()
    except BaseException:
        terminal.close()
        raise

    def on_progress(record: dict[str, Any]) -> None:
        if budget is not None:
            budget.observe(record)
        terminal(record)

    def target() -> None:
        try:
            # `resumed`: the run directory was checked once, before the lease was taken.
            outcome["result"] = fit(cfg, on_progress=on_progress, pace_s=args.pace,
                                    lease=lease, until=session.until, stop=stop,
                                    resumed_from=resumed)
        except BaseException as err:  # noqa: BLE001 - handed to the main thread as is
            outcome["error"] = err
        finally:
            done.set()

    interrupts = 0

    def on_sigint(signum: int, frame: Any) -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts > 1:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            _no_ray_auto_init()
            raise KeyboardInterrupt
        stop.set()
        console.print("stopping after the current step (Ctrl-C again to abort)")

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(signum)

    previous = (signal.signal(signal.SIGINT, on_sigint),
                signal.signal(signal.SIGTERM, on_sigterm))
    thread = threading.Thread(target=target, name="baton-fit", daemon=True)
    try:
        thread.start()
        while not done.wait(0.25):
            if budget is not None and not stop.is_set() and budget.due():
                stop.set()
                console.print(f"time limit: stopping after the current step (about "
                              f"{max(0.0, budget.left_s()):.0f} s left, "
                              f"{budget.reserve_s():.0f} s kept for the final commit)")
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
        terminal.close()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _no_ray_auto_init() -> None:
    """On an abort the fit thread lives on while the interpreter shuts Ray down; a Ray call
    it makes after that would start a fresh local Ray (Ray's auto-init) only to fail. Turn
    auto-init off (a module flag of Ray's; absent in another Ray version: nothing to do)."""
    hook = sys.modules.get("ray._private.auto_init_hook")
    if hook is not None and hasattr(hook, "enable_auto_connect"):
        setattr(hook, "enable_auto_connect", False)  # noqa: B010 - a module attribute mypy cannot see


def _continue_command(args: argparse.Namespace) -> str:
    """The command that continues this run: the same recipe, run directory and overrides,
    without this session's own flags (a fork continues without --from)."""
    parts = ["baton", "fit", args.recipe]
    if args.run_dir:
        parts += ["--run-dir", args.run_dir]
    for assignment in args.overrides:
        parts += ["--set", assignment]
    if args.pace:
        parts += ["--pace", f"{args.pace:g}"]
    return shlex.join(parts)


def _print_summary(summary: dict[str, Any]) -> None:
    from trainer.run import print_summary

    print_summary(summary, Console(soft_wrap=True))
