"""The membership protocol of in-process recovery, on a fake clock (no process group).

`elastic.coord.membership.Membership` decides who trains together: these tests drive it the
way members do and check every decision (who is in, in which order, when a reform forms, who
is fenced) and that each formation is a new generation.
"""

from __future__ import annotations

from typing import Any

import pytest

from elastic.coord.membership import (
    FALLBACK,
    FINISHED,
    FORMING,
    REFORMING,
    RUNNING,
    Membership,
    MembershipSettings,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def membership(clock: Clock) -> Membership:
    generations = iter(range(1, 100))
    return Membership(lambda: next(generations), lambda: "10.0.0.1:1234",
                      MembershipSettings(beat_s=0.1, dead_after_s=0.5, reform_wait_s=5.0),
                      clock=clock)


def _started(membership: Membership, members: list[str]) -> None:
    membership.reset(len(members))
    for order, member in enumerate(members):
        membership.join(member, order)


def test_a_group_forms_once_every_worker_joined_in_ray_rank_order(
        membership: Membership) -> None:
    membership.reset(3)
    assert membership.join("c", 2)["phase"] == FORMING
    assert membership.join("a", 0)["rank"] is None
    view = membership.join("b", 1)
    assert view["phase"] == RUNNING and view["generation"] == 1
    assert view["members"] == ["a", "b", "c"] and view["rank"] == 1 and view["fresh"]
    assert view["rendezvous"] == "10.0.0.1:1234/baton-g1"
    assert membership.beat("c", 1)["rank"] == 2


def test_a_reform_waits_for_every_live_member_then_leaves_the_dead_out(
        membership: Membership, clock: Clock) -> None:
    _started(membership, ["a", "b", "c"])
    clock.now += 0.3
    membership.beat("a", 1)
    membership.beat("b", 1)
    assert membership.reform("a", 1, "failure")["phase"] == REFORMING
    clock.now += 0.1  # c beat 0.4 s ago: maybe only slow
    assert membership.reform("a", 1, "failure")["generation"] == 1
    clock.now += 0.2  # 0.6 s: gone; b has not asked yet but beats
    membership.beat("b", 1)
    assert membership.reform("a", 1, "failure")["generation"] == 1
    view = membership.reform("b", 1, "failure")
    assert view["generation"] == 2 and view["members"] == ["a", "b"] and view["rank"] == 1
    assert not view["fresh"]
    assert membership.history[-1]["left"] == ["c"]
    assert membership.history[-1]["reason"] == "failure"


def test_a_member_that_comes_back_after_the_reform_is_fenced_and_may_join_again(
        membership: Membership, clock: Clock) -> None:
    _started(membership, ["a", "b", "c"])
    clock.now += 1.0
    membership.beat("b", 1)
    membership.reform("a", 1, "failure")
    membership.reform("b", 1, "failure")  # c silent for 1 s: left out
    late = membership.reform("c", 1, "failure")
    assert late["fenced"] and late["rank"] is None and late["generation"] == 2
    assert membership.beat("c", 1)["fenced"]
    waiting = membership.join("c", 2)  # back as a joiner
    assert not waiting["fenced"] and waiting["rank"] is None
    assert membership.beat("a", 2)["joiners"] == 1
    membership.reform("a", 2, "join")
    view = membership.reform("b", 2, "join")
    assert view["members"] == ["a", "b", "c"] and view["generation"] == 3
    assert membership.beat("c", -1)["rank"] == 2
    assert membership.history[-1]["reason"] == "join"


def test_a_joiner_that_stopped_beating_is_not_let_in(
        membership: Membership, clock: Clock) -> None:
    _started(membership, ["a", "b"])
    membership.join("d", 5)
    clock.now += 1.0  # d went silent after asking; the members beat on
    membership.beat("b", 1)
    membership.reform("a", 1, "join")
    view = membership.reform("b", 1, "join")
    assert view["members"] == ["a", "b"] and view["joiners"] == 1


def test_a_reform_forms_without_a_member_that_beats_but_never_asks(
        membership: Membership, clock: Clock) -> None:
    _started(membership, ["a", "b"])
    membership.reform("a", 1, "failure")
    for _ in range(60):  # b's heartbeat thread lives on, its training thread is stuck
        clock.now += 0.1
        membership.beat("b", 1)
        view = membership.beat("a", 1)
    assert view["generation"] == 2 and view["members"] == ["a"]


def test_a_member_whose_beats_come_late_is_given_longer_before_it_counts_as_gone(
        membership: Membership, clock: Clock) -> None:
    """On a loaded machine b's beats come every 0.4 s (c's every 0.1 s): 0.6 s of silence is
    normal for b, not for c. Each is gone after 3 times its longest recent gap, at least
    dead_after_s (0.5 s here)."""
    _started(membership, ["a", "b", "c"])
    for tick in range(1, 13):
        clock.now += 0.1
        membership.beat("a", 1)
        membership.beat("c", 1)
        if tick % 4 == 0:
            membership.beat("b", 1)  # b's last beat at tick 12
    membership.reform("a", 1, "failure")
    clock.now += 0.6  # c silent 0.6 s: gone; b silent 0.6 s: only late
    assert membership.beat("a", 1)["generation"] == 1
    clock.now += 0.5  # b silent 1.1 s: still within 3 x 0.4 s
    assert membership.beat("a", 1)["generation"] == 1
    view = membership.reform("b", 1, "failure")
    assert view["generation"] == 2 and view["members"] == ["a", "b"]
    assert membership.history[-1]["left"] == ["c"]
    clock.now += 0.1
    membership.beat("b", 2)  # the gap over a reform is no beat gap: b still counts 0.4 s
    membership.reform("a", 2, "failure")
    clock.now += 1.3
    assert membership.beat("a", 2)["members"] == ["a"]  # b silent 1.3 s > 1.2 s: gone


def test_fallback_and_finish_reach_every_member(membership: Membership) -> None:
    _started(membership, ["a", "b"])
    membership.fallback("b", "a second failure")
    view: dict[str, Any] = membership.beat("a", 1)
    assert view["phase"] == FALLBACK and "a second failure" in view["reason"]
    _started(membership, ["a", "b"])  # the group restarts whole: a new membership
    assert membership.beat("a", 2)["phase"] == RUNNING
    assert membership.finish(2)["phase"] == FINISHED
    assert membership.join("e", 9)["phase"] == FINISHED  # a late replacement restores


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="beat_s"):
        MembershipSettings(beat_s=1.0, dead_after_s=0.5)
    with pytest.raises(ValueError, match="reform_wait_s"):
        MembershipSettings(dead_after_s=2.0, reform_wait_s=1.0)
    with pytest.raises(ValueError, match="slow_margin"):
        MembershipSettings(slow_margin=0.5)
