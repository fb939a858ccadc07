"""`baton fit` under `ray job submit` on a running cluster, and a second submission continuing it.

The path a user takes on a real cluster (cluster.yaml's header): a head started with
`ray start --head`, the project uploaded as the job's working_dir, `baton fit` as the
entrypoint. The second submission of the same run directory must continue from the committed
snapshot (no step trained twice), not start over.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray.job_submission import JobStatus, JobSubmissionClient
from ray_harness import (
    MARKER_VAR,
    ROOT,
    RayHead,
    free_port,
    free_ports,
    non_loopback_listeners,
    start_head,
)

from elastic.store.snapshot_store import SnapshotStore
from trainer.run.metrics import read_records, summarize

# What a job uploads: the source tree, not environments, caches or run outputs.
WORKING_DIR_EXCLUDES = ["/.venv", "/.git", "/runs", "/data", "__pycache__", ".pytest_cache",
                        ".ruff_cache", ".hypothesis", "*.egg-info", "benchmarks/results"]
JOB_TIMEOUT_S = 200.0  # a tiny fit takes ~30 s; the CPUs are shared with other test runs


@pytest.fixture
def job_head(monkeypatch: pytest.MonkeyPatch) -> Iterator[RayHead]:
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the job client talks to a no-auth head
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    head = start_head(num_cpus=2, dashboard=True)
    try:
        yield head
    finally:
        head.stop()


def _run_job(client: JobSubmissionClient, entrypoint: str) -> tuple[str, str]:
    """Submit `entrypoint` with the repo as working_dir; wait for the end.

    Returns the final status and the job's logs with runs of whitespace made single spaces.
    """
    job_id = client.submit_job(
        entrypoint=entrypoint,
        runtime_env={"working_dir": str(ROOT), "excludes": WORKING_DIR_EXCLUDES},
    )
    deadline = time.monotonic() + JOB_TIMEOUT_S
    status = client.get_job_status(job_id)
    while not status.is_terminal() and time.monotonic() < deadline:
        time.sleep(1.0)
        status = client.get_job_status(job_id)
    if not status.is_terminal():
        client.stop_job(job_id)  # do not leave a driver running past the test
    # Rich wraps the driver's lines at 80 columns when stdout is not a terminal.
    return status, " ".join(client.get_job_logs(job_id).split())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_baton_fit_as_a_ray_job_then_resubmitted_continues(
    job_head: RayHead, tmp_path: Path
) -> None:
    client = JobSubmissionClient(job_head.dashboard_url)
    run = tmp_path / "run"

    status, logs = _run_job(client, f"baton fit recipes/tiny.toml --run-dir {run}")
    assert status == JobStatus.SUCCEEDED, f"first job ended {status}:\n{logs[-4000:]}"
    assert "starting run" in logs and "continuing run" not in logs, logs[-4000:]
    assert "run summary" in logs, logs[-4000:]
    assert max(SnapshotStore(str(run)).committed_steps(), default=0) == 24
    assert non_loopback_listeners(job_head.pids()) == []

    # Same run directory, a longer schedule (accepted with --reschedule): it must continue
    # from step 24, not start over.
    status, logs = _run_job(
        client, f"baton fit recipes/tiny.toml --run-dir {run} --set steps=30 --reschedule"
    )
    assert status == JobStatus.SUCCEEDED, f"second job ended {status}:\n{logs[-4000:]}"
    assert "continuing run" in logs and "from committed step 24" in logs, logs[-4000:]
    assert max(SnapshotStore(str(run)).committed_steps()) == 30

    records = read_records(str(run))
    starts = [r for r in records if r["kind"] == "start"]
    assert [r["step"] for r in starts] == [0, 24], starts
    resumed_at = starts[1]["time"]
    later_steps = [r["step"] for r in records if r["kind"] == "step" and r["time"] > resumed_at]
    assert later_steps and min(later_steps) == 25 and max(later_steps) == 30, later_steps
    summary = summarize(records)
    assert summary.steps == 30
    assert summary.steps_redone == 0


# The harness itself: its clean-up and its network check must be able to fail.


def test_harness_stop_ends_exactly_the_clusters_processes(tmp_path: Path) -> None:
    """`stop()` ends the head's group and strays that carry the cluster's marks, nothing else."""
    port = free_port()
    temp_dir = tmp_path / "rt"
    temp_dir.mkdir()
    marker = "harness-selftest"
    env = {**os.environ, MARKER_VAR: marker}

    def sleeper(arg: str, env: dict[str, str]) -> subprocess.Popen:
        # An idle process with `arg` in its command line (an unused argv entry).
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", arg],
                                env=env, start_new_session=True)

    head_proc = sleeper("head", env)
    stray_by_marker = sleeper("stray", env)  # its own session: the group kill misses it
    stray_by_gcs = sleeper(f"--gcs-address=127.0.0.1:{port}", dict(os.environ))
    bystander = sleeper(f"--gcs-address=127.0.0.1:{port}1", dict(os.environ))  # another port
    head = RayHead(port=port, dashboard_port=None, temp_dir=temp_dir, marker=marker,
                   proc=head_proc, log_path=temp_dir / "head.log", env=env)
    try:
        assert set(head.pids()) == {head_proc.pid, stray_by_marker.pid, stray_by_gcs.pid}
        head.stop(grace_s=1.0)
        for proc in (head_proc, stray_by_marker, stray_by_gcs):
            assert proc.wait(timeout=5) is not None
        assert bystander.poll() is None, "a process of another cluster was killed"
        assert not temp_dir.exists()
    finally:
        for proc in (head_proc, stray_by_marker, stray_by_gcs, bystander):
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_harness_free_ports_are_distinct_and_skip_the_excluded() -> None:
    first = free_port()
    ports = free_ports(64, exclude=[first])
    assert len(set(ports)) == 64 and first not in ports


def test_harness_sees_a_listener_on_all_interfaces() -> None:
    with socket.socket() as wildcard, socket.socket() as loopback:
        wildcard.bind(("0.0.0.0", 0))
        wildcard.listen()
        loopback.bind(("127.0.0.1", 0))
        loopback.listen()
        bad = non_loopback_listeners([os.getpid()])
        expected = [f"{os.getpid()} 0.0.0.0:{wildcard.getsockname()[1]}"]
    assert bad == expected
