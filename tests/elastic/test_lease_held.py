"""`elastic.lease.held_lease`: the lease's take, renew and release as one `with` block.

Local run directories and the real clock; a short ttl makes the renew thread tick quickly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from elastic.lease import LeaseHeldError, LeaseLostError, RunLease, held_lease, lease_holds
from elastic.store.snapshot_store import SnapshotStore


def _renew_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "baton-lease-renew"]


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_an_exception_in_the_block_releases_the_lease_and_stops_renewing(
        tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path / "run"))
    before = set(_renew_threads())
    with pytest.raises(RuntimeError, match="boom"):
        with held_lease(store) as lease:
            assert lease_holds(store, lease.token or "") and lease.renewing
            (thread,) = set(_renew_threads()) - before
            raise RuntimeError("boom")
    assert RunLease(store).read() is None  # released
    assert not lease.renewing and not thread.is_alive()
    assert RunLease(store).acquire()["epoch"] == 1  # free at once, no expiry to wait for


def test_a_live_holder_refuses_the_block_before_it_runs(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path / "run"))
    other = RunLease(store)
    other.acquire()
    ran = False
    with pytest.raises(LeaseHeldError):
        with held_lease(store):
            ran = True
    assert not ran and lease_holds(store, other.token or "")  # the holder's lease untouched
    with held_lease(store, force=True) as taken:
        assert taken.epoch == 2 and not lease_holds(store, other.token or "")


def test_a_takeover_mid_block_is_raised_as_lease_lost_and_the_new_lease_stays(
        tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path / "run"))
    with pytest.raises(LeaseLostError) as raised:
        with held_lease(store, ttl_s=0.3) as lease:  # renewed every 0.1 s
            thief = RunLease(store)
            thief.acquire(force=True)
            _wait_for(lambda: lease.lost is not None)
            assert lease.lost is not None
            raise ValueError("a commit refused")
    assert isinstance(raised.value.__cause__, ValueError)
    assert not lease.renewing
    assert lease_holds(store, thief.token or "")  # leaving the block never deletes theirs


def test_a_stop_from_outside_passes_as_it_is_after_a_loss(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path / "run"))
    with pytest.raises(KeyboardInterrupt):
        with held_lease(store, renew=False) as lease:
            lease.lost = "taken over"
            raise KeyboardInterrupt


def test_nested_blocks_over_one_lease_renew_from_one_thread_until_the_outer_ends(
        tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path / "run"))
    before = set(_renew_threads())
    with held_lease(store) as outer:
        (thread,) = set(_renew_threads()) - before
        with held_lease(store, lease=outer) as inner:
            with held_lease(store, lease=inner) as innermost:
                assert innermost is outer
                assert set(_renew_threads()) - before == {thread}
        assert outer.renewing and thread.is_alive()  # the inner blocks left it alone
        assert lease_holds(store, outer.token or "")  # and released nothing
    assert not thread.is_alive() and RunLease(store).read() is None


def test_a_lease_passed_in_that_nobody_renews_is_renewed_for_the_block_and_kept(
        tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path / "run"))
    lease = RunLease(store)
    lease.acquire()
    with held_lease(store, lease=lease):
        assert lease.renewing
    assert not lease.renewing and lease_holds(store, lease.token or "")
    lease.release()
