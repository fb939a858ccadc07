"""The metrics of steps whose group failed, and of the recoveries, for Baton's own loop.

Contract: `LateRecords(cfg, env, built, session, emit)` goes with `run_worker`'s loop under
in-process recovery (`elastic.recovery`). A step whose group failed is not recorded when it
ends (its all-reduces gave nothing to trust): `failed(step, cursor, loss, started)` keeps
it, and `catch_up()` — at the next step's start and after the loop — records it if it
counted after all (another member applied it and sent its state), with the step's samples
as the loader plans them at its start (`ResumableLoader.global_samples`: every sample of the
step, whatever the world size); a redone step is recorded when it is trained again.
`catch_up()` also hands every new recovery to `env.on_recovery` on the member that is rank 0
after it: the reason, the steps it redid, the seconds it cost and the world sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from data_state import DataCursor, ResumableLoader


class RecoveringLoop(Protocol):
    """What this module needs of the loop's `Session`."""

    @property
    def step(self) -> int: ...

    @property
    def rank(self) -> int: ...

    @property
    def recoveries(self) -> list[dict[str, Any]]: ...


# emit(step (1-based), loss, samples, started): `trainer.train.loop.record` for one step.
Emit = Callable[[int, float, list[int], float], Any]


class LateRecords:
    def __init__(self, loader: ResumableLoader, session: RecoveringLoop, emit: Emit,
                 on_recovery: Callable[[dict[str, Any]], None] | None) -> None:
        self._loader = loader
        self._session = session
        self._emit = emit
        self._on_recovery = on_recovery
        self._failed: tuple[int, DataCursor, float, float] | None = None
        self._told = len(session.recoveries)

    def failed(self, step: int, cursor: DataCursor, loss: float, started: float) -> None:
        self._failed = (step, cursor, loss, started)

    def catch_up(self) -> None:
        if self._failed is not None:
            step, cursor, loss, started = self._failed
            if self._session.step > step:  # it counted: applied by a member that survived
                self._emit(step + 1, loss, self._loader.global_samples(cursor), started)
            self._failed = None
        recoveries = self._session.recoveries
        for recovery in recoveries[self._told:]:
            if self._on_recovery is not None and self._session.rank == 0:
                self._on_recovery(dict(recovery))
        self._told = len(recoveries)
