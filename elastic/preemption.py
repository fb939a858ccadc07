"""Step-boundary notices: preemption (SIGTERM or an external notice), on-demand snapshots and
stop requests, agreed across ranks.

``PreemptionWatcher`` is a flag object the training loop checks at every step boundary:
``watcher = PreemptionWatcher(external=notice_fn).install()`` (the SIGTERM handler, main
thread), then after each step ``notice = watcher.poll(step)``; on a notice the loop captures
now (``snapshotter.after_step(step, force=True)``), commits (``snapshotter.close()``) and, if
``notice.must_exit``, stops.

* The signal handler only sets a flag; the snapshot happens at the next step boundary, a
  consistent cut.
* ``external`` (optional), asked every ``external_check_every`` steps, returns a platform's
  preemption notice's detail, or None. In a Ray Train worker ``trainer.on_ray.elastic_trainer``
  passes one asking ``ray.train.get_preemption_info()`` (a barrier across workers: all ranks
  must call ``poll`` on the same steps); this module imports nothing of Ray. Such a notice
  advises to snapshot and keep training (``must_exit=False``); a SIGTERM means this process is
  going away (``must_exit=True``).
* ``requested`` (optional, rank 0 only): an on-demand snapshot request, e.g. the coordinator's
  before a planned resize: source ``"request"``, ``must_exit=False``.
* ``stop_requested`` (optional, rank 0 only): the driver asked the run to stop (Ctrl-C, a time
  limit): source ``"stop"``, ``must_exit=False`` (the loop commits and ends normally).
* ``joiners`` (optional, every rank): workers waiting to join the group (in-process recovery,
  ``elastic.recovery``): source ``"join"``, the least urgent.
* With a group of ranks (``elastic.collectives``), ``poll`` agrees across ranks (all-reduce MAX
  of the most urgent cause: signal, external, stop, request, join), so a signal delivered to
  some workers only, or a request seen by rank 0 only, makes every rank act on the same step.
* A notice is returned once per cause (requests and stops: once per poll while asked); later
  polls return ``None``.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from elastic import collectives
from elastic.collectives import agree_max

# Agreement codes, most urgent highest: every rank acts on the most urgent cause any saw.
_CODES = {5: "signal", 4: "external", 3: "stop", 2: "request", 1: "join"}


@dataclass(frozen=True)
class PreemptionNotice:
    step: int
    # "signal", "external" (the platform's notice), "stop", "request" or "join"
    source: str
    must_exit: bool
    detail: Any = None  # what `external` returned, when source == "external"


class PreemptionWatcher:
    def __init__(self, *, signals: tuple[int, ...] = (signal.SIGTERM,),
                 external: Callable[[], Any] | None = None, external_check_every: int = 1,
                 requested: Callable[[], bool] | None = None,
                 stop_requested: Callable[[], bool] | None = None,
                 joiners: Callable[[], bool] | None = None) -> None:
        if external_check_every < 1:
            raise ValueError(f"external_check_every must be >= 1, got {external_check_every}")
        self.signals = signals
        self.external = external
        self.external_check_every = external_check_every
        self.requested = requested  # on-demand snapshot (planned resize), asked on rank 0
        self.stop_requested = stop_requested  # the driver asked to stop, asked on rank 0
        self.joiners = joiners  # workers wait to join the group, asked on every rank
        self._signalled = threading.Event()
        self._previous: dict[int, Any] = {}
        self._reported: set[str] = set()

    def install(self) -> PreemptionWatcher:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signalled.set()

    def request(self) -> None:
        """Ask for a preemption snapshot programmatically (same as receiving SIGTERM)."""
        self._signalled.set()

    def poll(self, step: int) -> PreemptionNotice | None:
        signalled = self._signalled.is_set() and "signal" not in self._reported
        detail = None
        if self.external is not None and step % self.external_check_every == 0 \
                and "external" not in self._reported:
            detail = self.external()
        first = _rank() == 0
        stop = self.stop_requested is not None and first and self.stop_requested()
        asked = self.requested is not None and first and self.requested()
        joining = self.joiners is not None and self.joiners()
        code = agree_max(5 if signalled else 4 if detail is not None else 3 if stop
                         else 2 if asked else 1 if joining else 0)
        if code == 0:
            return None
        source = _CODES[code]
        if source in ("signal", "external"):  # requests and stops may be asked again
            self._reported.add(source)
        return PreemptionNotice(step=step, source=source, must_exit=source == "signal",
                                detail=detail if source == "external" else None)


def _rank() -> int:
    return collectives.rank()
