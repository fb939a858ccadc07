"""Preemption: SIGTERM (or Ray's notice) -> snapshot at the next step boundary, committed
before the process exits, so no step is lost (P6)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import torch

from elastic.preemption import PreemptionWatcher
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.testing import build, full_state, train_step


def _preempted_child(run: str, ready: str, out: str) -> None:
    torch.set_num_threads(1)  # the parent's reference below runs with one thread too
    watcher = PreemptionWatcher().install()
    ts = build(seed=5)
    snap = Snapshotter(run, ts.registry, settings=SnapshotSettings(snapshot_every=10**6))
    for step in range(1, 100_000):
        train_step(ts, step)
        if step == 3:
            open(ready, "w").close()
        notice = watcher.poll(step)
        if notice is not None:
            assert notice.must_exit and notice.source == "signal"
            snap.after_step(step, force=True)
            snap.close()
            with open(out, "w") as fh:
                fh.write(str(step))
            return
        time.sleep(0.01)  # pacing only: gives the parent time to send the signal


def test_sigterm_snapshots_at_next_boundary_and_commits(tmp_path) -> None:
    run, ready, out = (str(tmp_path / n) for n in ("run", "ready", "out"))
    child = mp.get_context("spawn").Process(target=_preempted_child, args=(run, ready, out))
    child.start()
    for _ in range(1200):
        if os.path.exists(ready) or not child.is_alive():
            break
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGTERM)
    child.join(120)
    assert child.exitcode == 0
    stopped = int(open(out).read())
    assert stopped >= 3
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bitwise equality needs the child's reduction order
    try:
        ref = build(seed=5)
        for step in range(1, stopped + 1):
            train_step(ref, step)
    finally:
        torch.set_num_threads(threads)
    ts = build(seed=8)
    assert Snapshotter(run, ts.registry).restore() == stopped  # no step lost
    for key, value in full_state(ref).items():
        assert torch.equal(full_state(ts)[key], value), key


def test_notice_is_reported_once_per_cause() -> None:
    """The external notice (in a Ray Train worker: `ray.train.get_preemption_info`) is an
    injected callable, asked every `external_check_every` steps."""
    detail = {"deadline_ms": 123, "preempted_ranks": [1]}
    answers = [None, detail, detail]
    asked: list[int] = []

    def external() -> object:
        asked.append(1)
        return answers.pop(0)

    watcher = PreemptionWatcher(external=external, external_check_every=1)
    assert watcher.poll(1) is None
    notice = watcher.poll(2)
    assert notice is not None and notice.source == "external" and not notice.must_exit
    assert notice.detail["preempted_ranks"] == [1]
    assert watcher.poll(3) is None  # the external notice already acted on: not asked again
    assert len(asked) == 2
    watcher.request()
    notice = watcher.poll(4)
    assert notice is not None and notice.source == "signal" and notice.must_exit
    assert watcher.poll(5) is None


def test_a_stop_request_outranks_a_snapshot_request_and_comes_back_while_asked() -> None:
    stop, snapshot = [False], [True]
    watcher = PreemptionWatcher(requested=lambda: snapshot[0], stop_requested=lambda: stop[0])
    assert watcher.poll(1).source == "request"
    stop[0] = True
    first, second = watcher.poll(2), watcher.poll(3)
    assert first.source == second.source == "stop" and not first.must_exit
    stop[0] = snapshot[0] = False
    assert watcher.poll(4) is None
