"""Zero-loss planned resizes: snapshot before Ray Train restarts a healthy worker group.

Contract: `SnapshotBeforeResize(run_uri)` is a Ray Train controller callback (passed in
`RunConfig(callbacks=...)`). When the controller has decided to resize a *running* group
(more nodes arrived, state Running -> Resizing), it asks the run's coordinator for an
on-demand snapshot, which the workers take at their next step boundary (and then stop), and
waits until that snapshot is committed — at most `timeout_s` — before the controller tears the
group down. The new group restores exactly that step, so a scale-up redoes no step (P6).
A failure restart is not a planned resize and is not delayed.

It uses Ray Train V2's internal controller callback API (`ControllerCallback`), hence the
pinned Ray version range; `tests/ray/test_trainer_autoscale.py` covers it.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback
from ray.train.v2._internal.execution.controller.state import ResizingState, RunningState

from elastic.coord import NAMESPACE, coordinator_name


class SnapshotBeforeResize(ControllerCallback):
    def __init__(self, run_uri: str, timeout_s: float = 60.0,
                 lease_token: str | None = None) -> None:
        self.run_uri = run_uri
        self.timeout_s = timeout_s
        self.lease_token = lease_token  # names the run's coordinator (one per lease)

    def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
        if isinstance(previous_state, RunningState) and isinstance(current_state, ResizingState):
            self._snapshot_now()

    def _snapshot_now(self) -> None:
        try:
            coordinator = ray.get_actor(coordinator_name(self.run_uri, self.lease_token),
                                        namespace=NAMESPACE)
        except ValueError:
            return  # no coordinator: nothing to protect
        ray.get(coordinator.request_snapshot.remote())
        deadline = time.monotonic() + self.timeout_s
        try:
            while time.monotonic() < deadline:
                if ray.get(coordinator.request_met.remote()):
                    return
                time.sleep(0.1)
        finally:
            ray.get(coordinator.cancel_request.remote())
