"""When Ray replaces lost replica groups alone and when the whole worker group restarts
(`trainer.on_ray.replica_groups.replace_alone`), without a cluster."""

from __future__ import annotations

from collections.abc import Callable

from ray.exceptions import ActorDiedError
from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

from trainer.on_ray.replica_groups import replace_alone
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
