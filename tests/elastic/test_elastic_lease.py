"""The run lease (P7 "one writer"): one live driver per run directory, local and S3 (moto).

A fake clock drives expiry, so nothing here sleeps except the renew-thread test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from elastic.lease.run_lease import (
    LEASE_NAME,
    LeaseHeldError,
    LeaseLostError,
    RunLease,
    lease_holds,
    ray_job_id_from_env,
)
from elastic.store.snapshot_store import SnapshotStore

T0 = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["local", "s3"])
def run_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "run")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/runs/lease"


def _lease(run_uri: str, clock: FakeClock, pid: int, ttl_s: float = 60.0) -> RunLease:
    holder = {"host": f"host-{pid}", "pid": pid, "ray_job_id": f"raysubmit_{pid}",
              "started_at": clock.now}
    return RunLease(SnapshotStore(run_uri), ttl_s=ttl_s, holder=holder, clock=clock)


def test_acquire_writes_the_lease(run_uri: str) -> None:
    clock = FakeClock()
    lease = _lease(run_uri, clock, 101)
    record = lease.acquire()
    assert record["epoch"] == 1 and len(record["token"]) == 32
    assert record["acquired_at"] == T0 and record["expires_at"] == T0 + 60
    assert record["holder"]["pid"] == 101
    store = SnapshotStore(run_uri)
    assert json.loads(store.read_file(store.path(LEASE_NAME))) == record
    assert lease.read() == record
    assert lease_holds(store, record["token"])
    assert not lease_holds(store, "0" * 32)


def test_second_acquire_names_the_holder_and_expiry(run_uri: str) -> None:
    clock = FakeClock()
    first = _lease(run_uri, clock, 101)
    first.acquire()
    clock.now += 15
    with pytest.raises(LeaseHeldError) as info:
        _lease(run_uri, clock, 202).acquire()
    message = str(info.value)
    assert "\n" not in message
    for part in ("host-101", "pid 101", "Ray job raysubmit_101", "started 2027-01-15 08:00:00 UTC",
                 "expires at 2027-01-15 08:01:00 UTC", "(in 45 s)", "--force-takeover",
                 "stop that driver", run_uri):
        assert part in message, (part, message)
    assert lease_holds(SnapshotStore(run_uri), first.token or "")


def test_expired_lease_is_taken_over_and_fences_the_old_holder(run_uri: str) -> None:
    clock = FakeClock()
    old = _lease(run_uri, clock, 101)
    old_record = old.acquire()
    clock.now += 30
    old.renew()  # a live holder's renew moves the expiry
    assert old.read()["expires_at"] == T0 + 90
    clock.now = T0 + 91  # it stopped renewing
    new = _lease(run_uri, clock, 202)
    record = new.acquire()
    assert record["epoch"] == 2 and record["token"] != old_record["token"]
    store = SnapshotStore(run_uri)
    assert not lease_holds(store, old_record["token"])
    assert lease_holds(store, record["token"])
    with pytest.raises(LeaseLostError, match="pid 202"):
        old.renew()
    assert lease_holds(store, record["token"])  # the failed renew wrote nothing


def test_force_takes_over_a_live_lease(run_uri: str) -> None:
    clock = FakeClock()
    old = _lease(run_uri, clock, 101)
    old.acquire()
    new = _lease(run_uri, clock, 202)
    with pytest.raises(LeaseHeldError):
        new.acquire()
    record = new.acquire(force=True)
    assert record["epoch"] == 2
    assert not lease_holds(SnapshotStore(run_uri), old.token or "")
    with pytest.raises(LeaseLostError, match="pid 202"):
        old.renew()


def test_release_removes_only_its_own_lease(run_uri: str) -> None:
    clock = FakeClock()
    old = _lease(run_uri, clock, 101)
    old.acquire()
    new = _lease(run_uri, clock, 202)
    record = new.acquire(force=True)
    old.release()  # taken over: must not delete the new holder's lease
    assert new.read() == record
    new.release()
    assert new.read() is None
    again = _lease(run_uri, clock, 303)
    assert again.acquire()["epoch"] == 1  # a released run is free at once
    again.release()
    again.release()  # idempotent


@pytest.mark.parametrize("expired", [False, True], ids=["fresh", "takeover"])
def test_concurrent_acquire_has_one_winner(run_uri: str, expired: bool) -> None:
    clock = FakeClock()
    if expired:
        _lease(run_uri, clock, 100).acquire()
        clock.now += 3600
    leases = [_lease(run_uri, clock, 201 + i) for i in range(8)]
    for lease in leases:
        lease._probed = True  # the S3 probe is not what this test races
    barrier = threading.Barrier(len(leases))
    winners: list[RunLease] = []
    refused: list[str] = []
    errors: list[BaseException] = []

    def contend(lease: RunLease) -> None:
        barrier.wait()
        try:
            lease.acquire()
            winners.append(lease)
        except LeaseHeldError as err:
            refused.append(str(err))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=contend, args=(lease,)) for lease in leases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert len(winners) == 1 and len(refused) == 7, (len(winners), refused)
    store = SnapshotStore(run_uri)
    assert lease_holds(store, winners[0].token or "")
    assert winners[0].read()["epoch"] == (2 if expired else 1)
    pid = winners[0].holder["pid"]
    assert all(f"pid {pid}" in message for message in refused)


def test_renew_thread_reports_a_takeover(run_uri: str) -> None:
    lease = _lease(run_uri, FakeClock(), 101)  # the expiry never passes; only a force can win
    lease.acquire()
    lease.start_renewing(interval_s=0.05)
    try:
        time.sleep(0.2)
        assert lease.lost is None
        _lease(run_uri, FakeClock(), 202).acquire(force=True)
        deadline = time.monotonic() + 10
        while lease.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lease.lost is not None and "pid 202" in lease.lost
    finally:
        lease.stop_renewing()


def test_s3_lease_probe_finds_conditional_writes(s3_bucket: str) -> None:
    lease = _lease(f"s3://{s3_bucket}/runs/probe", FakeClock(), 101)
    lease.acquire()
    assert lease.conditional  # moto enforces If-None-Match/If-Match, like AWS S3
    fs = lease.store.fs
    assert [p for p in fs.ls(f"{s3_bucket}/runs/probe", detail=False)
            if ".baton-lease-probe" in p] == []


def test_an_s3_renew_ends_before_the_lease_would(s3_faults: Any, s3_bucket: str) -> None:
    """A store that accepts the request and never answers: the renew gives up within the
    lease's time left (here 10 s ttl), not the store's 60 s retry deadline, so the driver
    learns of it (and retries) while the lease still holds; nothing is written."""
    from elastic.errors import StorageUnavailableError

    store = SnapshotStore(f"s3://{s3_bucket}/runs/slow-renew")  # timeout 30 s, retries 60 s
    lease = RunLease(store, ttl_s=10.0)
    lease.acquire()
    before = lease.read()
    s3_faults.add_rule("GET", r"/lease\.json", "blackhole", times=None)
    started = time.monotonic()
    with pytest.raises(StorageUnavailableError):
        lease.renew()
    assert time.monotonic() - started < 9.0  # 10 s ttl - 5 s margin, at least 5 s
    s3_faults.clear()
    assert lease.read() == before
    lease.renew()  # the store answers again: still ours
    assert lease.read()["expires_at"] > before["expires_at"]
    lease.release()


def test_a_symlinked_lease_is_unreadable_and_force_replaces_the_link(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text('{"token": "x"}')
    run = tmp_path / "run"
    run.mkdir()
    (run / LEASE_NAME).symlink_to(elsewhere)
    with pytest.raises(LeaseHeldError, match="unreadable"):
        RunLease(SnapshotStore(str(run))).acquire()
    lease = RunLease(SnapshotStore(str(run)))
    assert lease.acquire(force=True)["epoch"] == 1
    assert not (run / LEASE_NAME).is_symlink() and lease.read()["token"] == lease.token
    assert elsewhere.read_text() == '{"token": "x"}'  # never written through the link
    lease.release()


class _Pauses:
    """Stands in for the renew thread's stop event: records each pause, stops after n."""

    def __init__(self, n: int) -> None:
        self.pauses: list[float] = []
        self.n = n

    def wait(self, timeout: float) -> bool:
        self.pauses.append(timeout)
        return len(self.pauses) > self.n


def test_the_renew_thread_retries_soon_after_a_storage_failure(tmp_path: Path) -> None:
    from elastic.lease.run_lease import RENEW_RETRY_S

    clock = FakeClock()
    lease = _lease(str(tmp_path / "run"), clock, 101)
    lease.acquire()
    outcomes = iter([OSError("no answer"), OSError("no answer"), None, None])
    renewed: list[float] = []

    def flaky_renew() -> None:
        failure = next(outcomes)
        if failure is not None:
            raise failure
        renewed.append(clock.now)

    lease.renew = flaky_renew  # type: ignore[method-assign]
    lease._stop = _Pauses(4)  # type: ignore[assignment]
    lease._renew_loop(20.0)
    # The first renew after 20 s failed twice: retried after 2 s each, then every 20 s again.
    assert lease._stop.pauses == [20.0, RENEW_RETRY_S, RENEW_RETRY_S, 20.0, 20.0]
    assert len(renewed) == 2 and lease.lost is None


def test_ray_job_id_from_env() -> None:
    assert ray_job_id_from_env({}) is None
    assert ray_job_id_from_env({"RAY_JOB_SUBMISSION_ID": "raysubmit_a"}) == "raysubmit_a"
    assert ray_job_id_from_env({"RAY_JOB_ID": "02000000"}) == "02000000"
    config = json.dumps({"metadata": {"job_submission_id": "raysubmit_b"}})
    assert ray_job_id_from_env({"RAY_JOB_CONFIG_JSON_ENV_VAR": config}) == "raysubmit_b"
    assert ray_job_id_from_env({"RAY_JOB_CONFIG_JSON_ENV_VAR": "not json"}) is None


_HOLD_AND_DIE = """
import os, sys
from elastic.lease.run_lease import RunLease
from elastic.store.snapshot_store import SnapshotStore
RunLease(SnapshotStore(sys.argv[1])).acquire()
os._exit(0)  # dies without releasing, as a SIGKILLed driver would
"""


def test_a_dead_local_holder_is_taken_over_before_expiry(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    subprocess.run([sys.executable, "-c", _HOLD_AND_DIE, run], check=True, timeout=120,
                   cwd=Path(__file__).resolve().parents[2])
    lease = RunLease(SnapshotStore(run))
    assert lease.read()["expires_at"] > time.time()  # still live by the clock
    assert lease.acquire()["epoch"] == 2  # but its process is gone
    with pytest.raises(LeaseHeldError, match=f"pid {os.getpid()}"):
        RunLease(SnapshotStore(run)).acquire()  # this process is alive: refused
    lease.release()


def test_a_live_holder_hidden_by_hidepid_is_not_taken_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With /proc mounted hidepid=2, another user's live driver has no /proc/PID here: that is
    not proof it died (the lease stays held until it expires); a pid that is really gone is."""
    import builtins

    import elastic.lease.run_lease as lease_module

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = {**lease_module.default_holder(), "pid": holder.pid}
        record.pop("pid_start")
        real_open = builtins.open

        def hidden(path: Any, *args: Any, **kwargs: Any) -> Any:
            if str(path) == f"/proc/{holder.pid}/stat":
                raise FileNotFoundError(path)  # what hidepid=2 shows of another user's pid
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", hidden)
        assert not lease_module.holder_is_dead(record)
        run = str(tmp_path / "run")
        RunLease(SnapshotStore(run), holder=record).acquire()
        with pytest.raises(LeaseHeldError, match=f"pid {holder.pid}"):
            RunLease(SnapshotStore(run)).acquire()
    finally:
        holder.kill()
        holder.wait()
    assert lease_module.holder_is_dead(record)  # gone (and reaped): taken over at once
    assert RunLease(SnapshotStore(run)).acquire()["epoch"] == 2


# A lease file is untrusted input: whatever it holds, acquiring gives one line (never a
# traceback), fails closed without --force-takeover and is replaced with it.
_CRAFTED = {
    "bad json": b"{not json",
    "deep nesting": b"[" * 100_000 + b"]" * 100_000,
    "epoch a string": {"epoch": "abc", "expires_at": T0 - 10},
    "epoch null": {"epoch": None, "expires_at": T0 - 10},
    "holder a string": {"holder": "me", "expires_at": T0 + 30},
    "expiry infinite": {"expires_at": float("inf")},
    "expiry NaN": {"expires_at": float("nan")},
    "expiry a bool": {"expires_at": True},
    "expiry beyond the calendar": {"expires_at": 1e20},
    "start beyond the calendar": {"holder": {"pid": 1, "host": "far", "started_at": 1e20},
                                  "expires_at": T0 + 30},
}


@pytest.mark.parametrize("name", sorted(_CRAFTED))
def test_a_crafted_lease_fails_closed_in_one_line_and_force_replaces_it(
        tmp_path: Path, name: str) -> None:
    run = str(tmp_path / "run")
    store = SnapshotStore(run)
    crafted = _CRAFTED[name]
    if isinstance(crafted, dict):
        record = {"token": "t" * 32, "holder": {"host": "elsewhere", "pid": 1},
                  "acquired_at": T0 - 60, "epoch": 3, **crafted}
        crafted = json.dumps(record).encode()  # Python's json writes inf and NaN as such
    store.write_file(store.path(LEASE_NAME), crafted)
    clock = FakeClock()
    with pytest.raises(LeaseHeldError) as err:
        _lease(run, clock, pid=7).acquire()
    assert "\n" not in str(err.value) and "--force-takeover" in str(err.value)
    well_formed = name.endswith("beyond the calendar")  # readable, only its times absurd
    assert lease_holds(store, "t" * 32) == well_formed  # the fencing read never raises
    taken = _lease(run, clock, pid=7).acquire(force=True)
    assert lease_holds(store, taken["token"]) and taken["epoch"] >= 1


def test_baton_fit_renews_its_lease_from_the_moment_it_takes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Making a fork (preparing its corpus, copying shards) runs before training and can
    # outlast the lease's ttl: the lease must be renewed through it.
    import trainer.cli.fit
    from trainer.cli import main

    calls: list[str] = []
    monkeypatch.setattr(RunLease, "start_renewing",
                        lambda self, interval_s=None: calls.append("renewing"))
    monkeypatch.setattr(RunLease, "stop_renewing", lambda self: calls.append("stopped"))

    def start_session(*args: object, **kwargs: object) -> int:
        calls.append("session")
        raise ValueError("stop here")

    monkeypatch.setattr(trainer.cli.fit, "_start_session", start_session)
    recipe = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny.toml")
    assert main(["fit", recipe, "--run-dir", str(tmp_path / "run")]) == 2
    assert calls == ["renewing", "session", "stopped"]
