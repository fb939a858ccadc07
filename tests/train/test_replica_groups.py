"""When Ray replaces lost replica groups alone and when the whole worker group restarts
(`trainer.on_ray.replica_groups.replace_alone`), and when a running group grows in place
(`_ResizeInPlace`, `InPlaceGrowth.supported`), without a cluster."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import ActorDiedError
from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError
from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision

from trainer.on_ray.grow_in_place import InPlaceGrowth
from trainer.on_ray.replica_groups import _ResizeInPlace, replace_alone
from trainer.train.session import PreemptedError

DIED = [WorkerHealthCheckFailedError("missed heartbeats", ActorDiedError())]


def _asked(answer: bool) -> tuple[list[int], Callable[[], bool]]:
    calls: list[int] = []

    def fell_back() -> bool:
        calls.append(1)
        return answer

    return calls, fell_back


def test_some_groups_failing_are_replaced_alone_while_the_others_train_on() -> None:
    calls, fell_back = _asked(False)
    assert replace_alone({2}, {0, 1, 2}, DIED, fell_back)
    assert calls == [1]


def test_after_a_fallback_the_first_members_to_fail_restart_the_whole_group() -> None:
    # The members end their workers one by one: the first poll sees only some failing. Were
    # they replaced alone, each replacement would meet a membership that refuses it, until
    # max_failures ended the run.
    _, fell_back = _asked(True)
    assert not replace_alone({0}, {0, 1, 2}, DIED, fell_back)


def test_every_group_failing_or_none_restarts_nothing_alone() -> None:
    calls, fell_back = _asked(False)
    assert not replace_alone({0, 1, 2}, {0, 1, 2}, DIED * 3, fell_back)
    assert not replace_alone(set(), {0, 1, 2}, [], fell_back)
    assert calls == []  # the coordinator is asked only when it decides something


def test_workers_that_raised_restart_the_whole_group_whichever_a_poll_saw_first() -> None:
    # A preemption notice: every worker commits and raises at the same step boundary, but a
    # poll may see some of them end before the others. Replacing those alone left the run
    # waiting for replacements of workers that were never lost.
    calls, fell_back = _asked(False)
    preempted = [PreemptedError("preempted at step 15 (external)")] * 2
    assert not replace_alone({1, 2}, {0, 1, 2}, preempted, fell_back)
    assert not replace_alone({1, 2}, {0, 1, 2}, [*DIED, *preempted[:1]], fell_back)
    assert calls == []


class _Policy:
    def __init__(self, decision: Any) -> None:
        self.decision = decision
        self.scaling_config = "inner's"

    def make_decision_for_running_worker_group(self, state: Any, status: Any) -> Any:
        return self.decision


class _Controller:
    def __init__(self, can_grow: bool, down: bool = False) -> None:
        self.can_grow, self.has_down_groups = can_grow, down
        self.asked: list[tuple[int, int]] = []

    def grow_in_place(self, num_workers: int, current: int) -> bool:
        self.asked.append((num_workers, current))
        return self.can_grow


def _decide(decision: Any, controller: _Controller, workers: int = 2) -> Any:
    policy = _ResizeInPlace(_Policy(decision), controller)  # type: ignore[arg-type]
    state = SimpleNamespace(workers=[object()] * workers)
    return policy.make_decision_for_running_worker_group(state, None)


GROW = ResizeDecision(num_workers=4, resources_per_worker={"CPU": 1})
SAME = ResizeDecision(num_workers=2, resources_per_worker={"CPU": 1})


def test_a_decision_to_grow_adds_workers_in_place_instead_of_restarting() -> None:
    controller = _Controller(can_grow=True)
    assert isinstance(_decide(GROW, controller), NoopDecision)
    assert controller.asked == [(4, 2)]
    # Where the group cannot grow in place, Ray Train's resize (snapshot, restart) runs.
    controller = _Controller(can_grow=False)
    assert _decide(GROW, controller) is GROW and controller.asked == [(4, 2)]


def test_while_groups_are_down_a_resize_to_their_size_waits_for_the_replacements() -> None:
    assert isinstance(_decide(SAME, _Controller(can_grow=True, down=True)), NoopDecision)
    controller = _Controller(can_grow=True)
    assert _decide(SAME, controller) is SAME and controller.asked == []  # not down: Ray's
    noop = NoopDecision()
    assert _decide(noop, controller) is noop
    assert _ResizeInPlace(_Policy(noop), controller).scaling_config == "inner's"


@pytest.mark.parametrize(("strategy", "selector", "slices", "supported"), [
    ("PACK", None, 1, True), ("SPREAD", None, 1, True),
    ("STRICT_SPREAD", None, 1, False), ("STRICT_PACK", None, 1, False),
    ("PACK", [{"zone": "a"}], 1, False), ("PACK", None, 2, False),
])
def test_only_soft_placements_grow_in_place(strategy: str, selector: Any, slices: int,
                                            supported: bool) -> None:
    """A worker in a placement group of its own cannot be held to its peers' nodes (STRICT_*),
    a per-worker label selector or a TPU slice: those keep Ray Train's resize."""
    context = SimpleNamespace(placement_strategy=strategy, label_selector=selector,
                              num_slices=slices)
    assert InPlaceGrowth.supported(context) is supported
