"""When Ray replaces lost replica groups alone and when the whole worker group restarts
(`trainer.on_ray.replica_groups.replace_alone`), without a cluster."""

from __future__ import annotations

from collections.abc import Callable

from trainer.on_ray.replica_groups import replace_alone


def _asked(answer: bool) -> tuple[list[int], Callable[[], bool]]:
    calls: list[int] = []

    def fell_back() -> bool:
        calls.append(1)
        return answer

    return calls, fell_back


def test_some_groups_failing_are_replaced_alone_while_the_others_train_on() -> None:
    calls, fell_back = _asked(False)
    assert replace_alone({2}, {0, 1, 2}, fell_back)
    assert calls == [1]


def test_after_a_fallback_the_first_members_to_fail_restart_the_whole_group() -> None:
    # The members end their workers one by one: the first poll sees only some failing. Were
    # they replaced alone, each replacement would meet a membership that refuses it, until
    # max_failures ended the run.
    _, fell_back = _asked(True)
    assert not replace_alone({0}, {0, 1, 2}, fell_back)


def test_every_group_failing_or_none_restarts_nothing_alone() -> None:
    calls, fell_back = _asked(False)
    assert not replace_alone({0, 1, 2}, {0, 1, 2}, fell_back)
    assert not replace_alone(set(), {0, 1, 2}, fell_back)
    assert calls == []  # the coordinator is asked only when it decides something
