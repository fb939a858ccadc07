"""Two `baton fit` drivers on one run directory (P7 "one writer", issue 13 point 2).

The first driver holds the run lease; the second, started while the first trains, must fail
fast (exit 2, before it starts Ray) with one line naming the first driver's pid and the fix.
The first must not notice: it finishes with exit 0, its snapshots verify, and it releases
the lease at the end.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray_harness import ROOT, RayHead, ray_client_env, start_head

from elastic.lease.run_lease import LEASE_NAME, LeaseHeldError, RunLease
from elastic.store.snapshot_store import SnapshotStore
from trainer.config import load_recipe

BATON = str(Path(sys.executable).with_name("baton"))
STEPS = 16
PACE_S = 0.5  # >= 8 s of training after Ray is up: the second driver lands mid-run
FIT_TIMEOUT_S = 300.0  # shared 2-core machine


@pytest.fixture
def head(monkeypatch: pytest.MonkeyPatch) -> Iterator[RayHead]:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cluster = start_head(num_cpus=2)
    try:
        yield cluster
    finally:
        cluster.stop()  # also ends any driver still attached (they carry its marker)


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} from the first driver:\n{path.read_text()[-4000:]}")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_second_driver_is_refused_while_the_first_trains(
    head: RayHead, tmp_path: Path, tiny_dataset: str
) -> None:
    run = tmp_path / "run"
    args = ["fit", str(ROOT / "recipes" / "tiny.toml"), "--run-dir", str(run),
            "--set", f'data.uri="{tiny_dataset}"', "--set", f"steps={STEPS}",
            "--set", "eval.every=0"]
    env = ray_client_env(head)
    log_path = tmp_path / "first.log"
    with open(log_path, "wb") as log:  # a file, not a pipe: nobody reads it while it runs
        first = subprocess.Popen([BATON, *args, "--pace", str(PACE_S)], cwd=ROOT, env=env,
                                 stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for(log_path, "starting run", first, FIT_TIMEOUT_S)  # printed once it holds the lease
        started = time.monotonic()
        second = subprocess.run([BATON, *args], cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=120)
        second_s = time.monotonic() - started
        still_running = first.poll() is None
        first.wait(timeout=FIT_TIMEOUT_S)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    first_log = log_path.read_text(errors="replace")
    assert second.returncode == 2, second.stdout + second.stderr
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, second.stderr
    for part in (f"pid {first.pid}", "is held by another driver", "expires at",
                 "--force-takeover"):
        assert part in errors[0], (part, errors[0])
    assert still_running, f"the second driver took {second_s:.1f} s; the first had ended"
    assert first.returncode == 0, first_log[-4000:]
    assert "run summary" in first_log, first_log[-4000:]

    assert max(SnapshotStore(str(run)).committed_steps(), default=0) == STEPS, first_log[-3000:]
    verify = subprocess.run([BATON, "snapshots", "verify", str(run)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert not (run / LEASE_NAME).exists()  # released at the end


def test_python_fit_refuses_a_held_run_before_ray_starts(tmp_path: Path,
                                                         tiny_dataset: str) -> None:
    """`trainer.fit(config)` takes the lease itself: the Python API is one-driver-per-run too."""
    import ray

    from trainer.on_ray.ray_fit import fit

    run = tmp_path / "run"
    holder = {"host": "elsewhere", "pid": 4242, "ray_job_id": None, "started_at": time.time()}
    other = RunLease(SnapshotStore(str(run)), holder=holder)
    other.acquire()
    cfg = load_recipe(ROOT / "recipes" / "tiny.toml",
                      [f'snapshots.run_uri="{run}"', f'data.uri="{tiny_dataset}"'])
    with pytest.raises(LeaseHeldError, match="host elsewhere, pid 4242"):
        fit(cfg)
    assert not ray.is_initialized()
    assert other.read()["token"] == other.token  # the refused driver left the lease alone
    other.release()
