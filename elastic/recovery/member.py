"""One worker's side of the membership: join, beat, reform (``elastic.coord.membership``).

Contract
--------
- ``Member(coordinator, member_id, order, settings)``; ``join()`` blocks until this worker
  is a member — of the group that forms at the start (``started_fresh`` True) or, as a
  joiner of a running membership, once the members let it in at their next step boundary
  (``started_fresh`` False: it must then receive the state from a live member) — and
  returns the view; ``None`` if the coordinator runs no membership (``off``) or the run has
  finished (``run_finished``): train without in-process recovery.
- ``start_beating()`` starts a daemon thread that calls ``membership_beat`` every
  ``beat_s`` and keeps the latest view; ``view()`` returns it. ``joiners_waiting()``: the
  members should let joiners in at the next step boundary. ``superseded()``: the membership
  has moved past this member's generation (a reform in progress, a newer generation, a
  fence or a fallback): its group's next collective must fail at once
  (``elastic.recovery.group.ElasticGroup.superseded``).
- ``reform(reason)`` asks for the next membership and blocks until it forms; returns its
  view with this worker in it. Raises ``RecoveryFailedError`` — in-process recovery
  cannot go on: the worker group restarts whole — when the coordinator does not answer
  for ``settings.coordinator_s`` (its node lost), when the membership falls back, when
  this worker was left out (fenced: ``FencedError``, a subclass: it may join again), or
  when no membership forms within ``settings.reform_s``.
- ``rejoin()``, for a member left out (``FencedError``): ``join()`` again, as a replacement
  does (let in at the members' next step boundary, state from a live member). Raises
  ``LeftBehindError`` if the run finished without it, or ``RecoveryFailedError`` after
  telling every member to fall back when it cannot join.
- ``fall_back(reason)`` tells every member to end its worker; ``finish()`` tells the
  coordinator the run's last step is committed. ``stop()`` ends the beats.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastic.coord import FALLBACK, FINISHED, OFF, REFORMING, CoordinatorClient

log = logging.getLogger("baton.recovery")


class RecoveryFailedError(RuntimeError):
    """In-process recovery cannot go on; the worker group restarts whole."""


class FencedError(RecoveryFailedError):
    """This worker was left out of the membership (gone too long): it may join again."""


class LeftBehindError(RecoveryFailedError):
    """This worker was left out and the run finished without it: it has nothing to train."""


@dataclass(frozen=True)
class MemberSettings:
    poll_s: float = 0.01  # how often a waiting member asks the coordinator again
    reform_s: float = 120.0  # a reform (or a join) that forms nothing by then: fall back
    coordinator_s: float = 30.0  # a coordinator silent that long is gone: fall back


class Member:
    """See the module docstring."""

    def __init__(self, coordinator: CoordinatorClient, member_id: str, order: int,
                 settings: MemberSettings | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.coordinator = coordinator
        self.id = member_id
        self.order = order
        self.settings = settings or MemberSettings()
        self._clock = clock
        self.generation = -1
        self.started_fresh = True
        self.run_finished = False  # join() found the run finished (a late replacement)
        self._view: dict[str, Any] = {}
        self._answered = clock()  # when the coordinator last answered
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ joining

    def join(self) -> dict[str, Any] | None:
        view = self._call(lambda: self.coordinator.membership_join(self.id, self.order))
        if view["phase"] in (OFF, FINISHED):
            self.run_finished = view["phase"] == FINISHED
            return None
        deadline = self._clock() + self.settings.reform_s
        while view["rank"] is None:
            self._refuse(view, joining=True)
            if view["phase"] == FINISHED:
                self._call(lambda: self.coordinator.membership_leave(self.id))
                self.run_finished = True
                return None
            if self._clock() > deadline:
                self._call(lambda: self.coordinator.membership_leave(self.id))
                raise RecoveryFailedError(
                    f"worker {self.id} was not let into the training group within "
                    f"{self.settings.reform_s:g} s")
            time.sleep(self.settings.poll_s)
            view = self._call(lambda: self.coordinator.membership_beat(self.id, -1))
        self.started_fresh = bool(view["fresh"])
        return self._adopt(view)

    def rejoin(self) -> dict[str, Any]:
        """Join again after being left out (module docstring)."""
        try:
            view = self.join()
        except RecoveryFailedError as err:
            self.fall_back(str(err))
            raise RecoveryFailedError(f"in-process recovery fell back to a group restart: "
                                      f"{err}") from err
        if view is None:  # the others finished meanwhile: nothing left to train here
            raise LeftBehindError(f"worker {self.id} was left out of the training group and "
                                  "the run finished without it")
        return view

    # ------------------------------------------------------------------ beating

    def start_beating(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat_loop, name="baton-membership",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _beat_loop(self) -> None:
        while not self._stop.is_set():
            try:
                view = self.coordinator.membership_beat(self.id, self.generation)
            except Exception as err:  # noqa: BLE001 - judged by the main thread (silence)
                log.debug("membership beat failed: %r", err)
            else:
                with self._lock:
                    self._view, self._answered = view, self._clock()
            self._stop.wait(float(self.view().get("beat_s") or 0.1))

    def view(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._view)

    def joiners_waiting(self) -> bool:
        view = self.view()
        return view.get("generation") == self.generation and bool(view.get("joiners"))

    def superseded(self) -> bool:
        view = self.view()
        if not view:
            return False
        return (view["generation"] != self.generation or view["fenced"]
                or view["phase"] in (REFORMING, FALLBACK))

    # ------------------------------------------------------------------ reforming

    def reform(self, reason: str) -> dict[str, Any]:
        """The next membership, with this worker in it (module docstring)."""
        old = self.generation
        deadline = self._clock() + self.settings.reform_s
        view = self._call(lambda: self.coordinator.membership_reform(self.id, old, reason))
        while view["generation"] == old or view["rank"] is None:
            self._refuse(view, joining=False)
            if self._clock() > deadline:
                raise RecoveryFailedError(
                    f"no training group formed within {self.settings.reform_s:g} s after "
                    f"generation {old} failed")
            time.sleep(self.settings.poll_s)
            view = self._call(lambda: self.coordinator.membership_reform(self.id, old, reason))
        return self._adopt(view)

    def fall_back(self, reason: str) -> None:
        try:
            self.coordinator.membership_fallback(self.id, reason)
        except Exception as err:  # noqa: BLE001 - the fallback happens anyway (we raise)
            log.warning("could not tell the coordinator about the fallback: %r", err)

    def finish(self) -> None:
        self._call(lambda: self.coordinator.membership_finish(self.generation))

    # ------------------------------------------------------------------ internals

    def _adopt(self, view: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.generation = int(view["generation"])
            self._view, self._answered = view, self._clock()
        return view

    def _refuse(self, view: dict[str, Any], *, joining: bool) -> None:
        if view["phase"] == FINISHED and not joining:
            raise LeftBehindError(f"worker {self.id} was left out of the training group and "
                                  "the run finished without it")
        if view["phase"] == FALLBACK:
            raise RecoveryFailedError(f"in-process recovery fell back: {view['reason']}")
        if view["phase"] == OFF:
            raise RecoveryFailedError("the coordinator lost the training group (it restarted)")
        if view["fenced"] and not joining:
            raise FencedError(f"worker {self.id} was left out of generation "
                              f"{view['generation']} (it did not answer in time)")

    def _call(self, call: Callable[[], Any]) -> Any:
        """One coordinator call, retried until it answers or ``coordinator_s`` passes."""
        deadline = self._clock() + self.settings.coordinator_s
        while True:
            try:
                answer = call()
                with self._lock:
                    self._answered = self._clock()
                return answer
            except Exception as err:  # noqa: BLE001 - a coordinator that restarts or is gone
                if self._clock() > deadline:
                    raise RecoveryFailedError(f"the coordinator does not answer: {err}") from err
                time.sleep(min(1.0, self.settings.poll_s * 10))
