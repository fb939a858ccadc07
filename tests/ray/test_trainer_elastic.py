"""Elastic fit on a local multi-node Ray cluster: lose a node, gain one back.

Run A trains STEPS steps on one worker without interruption. Run B (DDP, in-process recovery,
`elastic.recovery`) starts on 2 workers, grows to 3 in place when a node is added, loses the
node it grew by after step LOSE_AT, then gets a node back: the two survivors keep their
processes, re-form their group and train on at 2, redoing at most the interrupted step; Ray
Train replaces only the lost worker's replica group once the new node is there, and it joins at
a step boundary (W = 3 again), taking the state from a live peer. No worker group restarts.
Checked at the end, on what the snapshots say: B's final parameters and AdamW moments equal
A's (P1, P2); the AdamW step counter is STEPS (never a cold start); over the recorded steps
every sample was trained exactly once (P5); the recovery redid at most the interrupted step
(P6). FSDP2's in-process recovery (the survivors restart their training state from the newest
commit over the re-formed group) is the same Ray machinery around another worker-side path:
tests/train/test_recovery_inprocess.py runs it on real processes without a cluster.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import ray
from snapshot_compare import assert_same_state, final_state

from elastic.store.snapshot_store import SnapshotStore
from trainer.config import load_recipe
from trainer.on_ray.local_cluster import LocalCluster
from trainer.on_ray.monitor import NAMESPACE, get_monitor
from trainer.on_ray.ray_fit import FitResult, fit
from trainer.run.metrics import read_records
from trainer.train.loop import WorkerEnv, run_worker

ROOT = Path(__file__).resolve().parents[2]
STEPS = 80
SNAPSHOT_EVERY = 5
LOSE_AT = 8
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster() -> Any:
    local = LocalCluster(worker_nodes=3)
    ray.init(address=local.address, namespace=NAMESPACE, log_to_driver=False)
    yield local
    ray.shutdown()
    local.shutdown()


def _config(run: Path, dataset: str, min_workers: int,
            max_workers: int = 3) -> Any:
    return load_recipe(
        ROOT / "recipes" / "tiny.toml",
        [
            f'snapshots.run_uri="{run}"', f'data.uri="{dataset}"', f"steps={STEPS}",
            f"snapshots.snapshot_every={SNAPSHOT_EVERY}", 'parallelism="ddp"',
            f"scaling.min_workers={min_workers}", f"scaling.max_workers={max_workers}",
            "eval.every=0",
        ],
    )


def _latest(monitor: Any) -> dict[str, Any]:
    return ray.get(monitor.latest.remote())


def _monitor_step(cfg: Any) -> int:
    try:
        return _latest(get_monitor(cfg)).get("step", 0)
    except ValueError:  # the monitor is not created yet
        return 0


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _fit_with_faults(cluster: LocalCluster, cfg: Any) -> FitResult:
    """Run fit in a thread on a node fewer (2 workers); add the node back and wait for the
    group to grow to 3 in place; lose the newest node (the grown worker's) after LOSE_AT; add
    one back once at 2 workers. (Cluster changes must happen on the main thread: Ray installs
    signal handlers.)"""
    out: dict[str, Any] = {}
    cluster.remove_worker()
    thread = threading.Thread(  # steps slow enough for the three changes to fit the run
        target=lambda: out.update(result=fit(cfg, pace_s=0.5, record_samples=True))
    )
    thread.start()
    monitor = None

    def monitor_ready() -> bool:
        nonlocal monitor
        try:
            monitor = get_monitor(cfg)
            return True
        except ValueError:
            return False

    _wait(monitor_ready, 120, "the run monitor")
    _wait(lambda: _latest(monitor).get("step", 0) >= 1, 180, "step 1")
    assert _latest(monitor).get("world_size") == 2
    cluster.add_worker()
    _wait(lambda: _latest(monitor).get("world_size") == 3, 180, "growing to 3 workers")
    _wait(lambda: _latest(monitor).get("step", 0) >= LOSE_AT, 180, f"step {LOSE_AT}")
    cluster.remove_worker()
    _wait(lambda: _latest(monitor).get("world_size") == 2, 180, "training on 2 workers")
    cluster.add_worker()
    thread.join(timeout=400)
    assert "result" in out, "fit did not finish"
    return out["result"]


def _committed_history(run: Path) -> dict[int, list[int]]:
    """Samples of each step as finally committed: a redone step's last occurrence wins."""
    history: dict[int, list[int]] = {}
    for record in read_records(str(run)):
        if record["kind"] == "step":
            history[record["step"]] = record["samples"]
    return history


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: str) -> Path:
    """Run A: STEPS steps without faults, on one worker in this process (the trajectory does
    not depend on the world size, P1; no Ray Train start to pay for it)."""
    run = tmp_path_factory.mktemp("uninterrupted") / "a"
    run_worker(_config(run, tiny_dataset, min_workers=1, max_workers=1), WorkerEnv())
    return run


def test_node_loss_and_gain_end_where_an_uninterrupted_run_ends(
    cluster: LocalCluster, uninterrupted: Path, tmp_path: Path, tiny_dataset: str,
) -> None:
    a = uninterrupted
    b = tmp_path / "b"
    result = _fit_with_faults(cluster, _config(b, tiny_dataset, min_workers=1))

    summary = result.summary
    assert summary.steps == STEPS
    _assert_survivors_never_stopped(result)

    state_a, state_b = final_state(a, tmp_path, STEPS), final_state(b, tmp_path, STEPS)
    assert_same_state(state_a, state_b)
    counters = {v.item() for k, v in state_b.items() if k.endswith(".step")}
    assert counters == {float(STEPS)}, f"AdamW step counters {counters}: a cold start"

    history = _committed_history(b)
    assert sorted(history) == list(range(1, STEPS + 1))
    trained = [i for samples in history.values() for i in samples]
    assert len(trained) == len(set(trained)) == STEPS * 8  # global_batch 8, one epoch


def _assert_survivors_never_stopped(result: FitResult) -> None:
    """No worker group started again: the group grew from 2 to 3 in place, lost the worker it
    grew by, and the replacement joined; the survivors are the processes that started (a
    member id is its node, process id and a nonce) and they are still members at the end;
    the loss redid at most the interrupted step."""
    summary = result.summary
    assert summary.restarts == 0, summary
    assert summary.world_sizes == [2, 3, 2, 3], summary.world_sizes
    assert summary.recovered_in_process == 1, summary
    assert summary.replacements_joined == 2, summary
    assert summary.steps_redone <= 1, summary
    history = result.membership["history"]
    assert [h["reason"] for h in history] == ["start", "join", "failure", "join"], history
    started, grown, survivors, regrown = (set(h["members"]) for h in history)
    assert survivors == started, history  # the processes that started never stopped
    assert len(grown) == 3 and survivors < grown and survivors < regrown, history
    assert len(regrown - grown) == 1  # the replacement


def test_preemption_notice_loses_no_steps(
    cluster: LocalCluster, uninterrupted: Path, tmp_path: Path, tiny_dataset: str
) -> None:
    """A spot notice (a drain with reason PREEMPTION) makes every worker commit a snapshot at
    the next step boundary and restart without the doomed node: nothing is redone."""
    cfg = _config(tmp_path / "b", tiny_dataset, min_workers=1)
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(result=fit(cfg, pace_s=0.25)))
    thread.start()
    try:
        _wait(lambda: _monitor_step(cfg) >= LOSE_AT, 180, f"step {LOSE_AT}")
        cluster.drain_worker(deadline_s=60)
        _wait(lambda: _latest(get_monitor(cfg)).get("world_size") == 2, 180,
              "a restart without the drained node")
        cluster.remove_worker()  # the spot node goes away, as announced
        thread.join(timeout=400)
    finally:
        if len(cluster.workers) < 3:
            cluster.add_worker()  # later tests start from 3 worker nodes again
    summary = out["result"].summary
    assert summary.restarts >= 1 and summary.world_sizes[:2] == [3, 2], summary
    assert summary.steps_redone == 0
    assert_same_state(final_state(uninterrupted, tmp_path, STEPS),
                      final_state(tmp_path / "b", tmp_path, STEPS))


def test_a_new_session_continues_after_the_driver_is_killed(
    cluster: LocalCluster, uninterrupted: Path, tmp_path: Path, tiny_dataset: str
) -> None:
    """`baton fit` is killed (SIGKILL) half-way; a new `baton fit` on the same run directory,
    with a different worker count, continues it and ends where run A ends."""
    run = tmp_path / "moved"
    baton = str(Path(sys.executable).with_name("baton"))
    common = [baton, "fit", str(ROOT / "recipes" / "tiny.toml"), "--run-dir", str(run),
              "--set", f'data.uri="{tiny_dataset}"', "--set", f"steps={STEPS}",
              "--set", f"snapshots.snapshot_every={SNAPSHOT_EVERY}", "--set", "eval.every=0"]
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    first = subprocess.Popen(
        [*common, "--set", "scaling.min_workers=2", "--set", "scaling.max_workers=2",
         "--pace", "0.25"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        for line in first.stdout:
            match = re.match(r"\s*step\s+(\d+)", line)
            if match and int(match.group(1)) >= STEPS // 2:
                break
    finally:
        first.kill()  # the driver dies without any chance to clean up
        first.wait(timeout=60)
    committed = SnapshotStore(str(run)).committed_steps()
    assert committed and max(committed) < STEPS, committed

    second = subprocess.run(
        [*common, "--set", "scaling.min_workers=1", "--set", "scaling.max_workers=1"],
        env=env, capture_output=True, text=True, timeout=400,
    )
    assert second.returncode == 0, second.stdout + second.stderr
    # The killed driver's workers may still commit a snapshot or two before Ray ends them
    # (they hold its generation until the new driver starts one): the new session continues
    # from the newest commit it finds, never an older one.
    resumed = re.search(r"continuing run .* from committed step (\d+)", second.stderr)
    assert resumed and int(resumed.group(1)) >= max(committed), second.stderr
    assert_same_state(final_state(uninterrupted, tmp_path, STEPS),
                      final_state(run, tmp_path, STEPS))
