"""`trainer.on_ray.resize.SnapshotBeforeResize` without a cluster: a running group that Ray
Train resizes asks for a snapshot on demand and waits (boundedly) until it is committed; other
state changes ask for nothing."""

from __future__ import annotations

from typing import Any

import pytest
from ray.train.v2._internal.execution.controller.state import (
    ResizingState,
    RestartingState,
    RunningState,
)

from trainer.on_ray import resize


class _Call:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _Coordinator:
    """The three calls the callback makes, as a Ray actor handle offers them."""

    def __init__(self, met_after: int | None) -> None:
        self.calls: list[str] = []
        self._met_after = met_after  # answers of request_met before it says True (None: never)
        self.request_snapshot = _Call(lambda: self.calls.append("request"))
        self.request_met = _Call(self._met)
        self.cancel_request = _Call(lambda: self.calls.append("cancel"))

    def _met(self) -> bool:
        self.calls.append("met?")
        return self._met_after is not None and self.calls.count("met?") > self._met_after


@pytest.fixture
def coordinator(monkeypatch: pytest.MonkeyPatch) -> Any:
    def install(met_after: int | None) -> _Coordinator:
        fake = _Coordinator(met_after)
        monkeypatch.setattr(resize.ray, "get_actor", lambda name, namespace: fake)
        monkeypatch.setattr(resize.ray, "get", lambda value, **_: value)
        monkeypatch.setattr(resize.time, "sleep", lambda _s: None)
        return fake
    return install


def test_a_resize_of_a_running_group_waits_for_the_snapshot_it_asked_for(coordinator: Any
                                                                           ) -> None:
    fake = coordinator(met_after=2)
    resize.SnapshotBeforeResize("runs/x").after_controller_state_update(
        RunningState(), ResizingState(scaling_decision=None))
    assert fake.calls == ["request", "met?", "met?", "met?", "cancel"]


def test_other_state_changes_ask_for_nothing(coordinator: Any) -> None:
    fake = coordinator(met_after=0)
    callback = resize.SnapshotBeforeResize("runs/x")
    callback.after_controller_state_update(RunningState(), RestartingState(
        training_failed_error=None))
    callback.after_controller_state_update(RestartingState(training_failed_error=None),
                                           RunningState())
    assert fake.calls == []


def test_a_snapshot_that_never_commits_holds_the_resize_only_until_the_timeout(
        coordinator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = coordinator(met_after=None)
    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr(resize.time, "monotonic", lambda: next(clock))
    resize.SnapshotBeforeResize("runs/x", timeout_s=5).after_controller_state_update(
        RunningState(), ResizingState(scaling_decision=None))
    assert fake.calls[0] == "request" and fake.calls[-1] == "cancel"
    assert 1 <= fake.calls.count("met?") <= 5  # bounded by the timeout, then the request ends


def test_without_a_coordinator_the_resize_goes_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str, namespace: str) -> Any:
        raise ValueError(f"no actor {name}")

    monkeypatch.setattr(resize.ray, "get_actor", missing)
    resize.SnapshotBeforeResize("runs/x").after_controller_state_update(
        RunningState(), ResizingState(scaling_decision=None))
