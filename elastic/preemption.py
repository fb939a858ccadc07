"""Preemption: notice SIGTERM or Ray's preemption notice, snapshot at the next step boundary.

Contract
--------
``PreemptionWatcher`` is a flag object the training loop checks at every step boundary::

    watcher = PreemptionWatcher().install()        # SIGTERM handler (main thread only)
    for step in ...:
        train_step(...)
        notice = watcher.poll(step)
        if notice is not None:
            snapshotter.after_step(step, force=True)  # capture now, even if not due
            snapshotter.close()                        # ... and commit before exiting
            if notice.must_exit:
                break

* The signal handler only sets a flag (no work inside a handler); the snapshot happens at
  the next step boundary, which is a consistent cut.
* Inside a Ray Train worker ``poll`` also asks ``ray.train.get_preemption_info()`` every
  ``ray_check_every`` steps. That call is itself a barrier across workers, so all ranks
  must call ``poll`` on the same steps. Ray's advice is to snapshot and keep training
  (``must_exit=False``); a SIGTERM means this process is going away (``must_exit=True``).
* When torch.distributed is initialised, ``poll`` agrees across ranks (all-reduce MAX), so
  a signal delivered to only some workers still makes every rank snapshot the same step.
* ``requested`` (optional, asked on rank 0 only) reports an on-demand snapshot request, e.g.
  the coordinator's before a planned resize: source ``"request"``, ``must_exit=False``.
* A notice is returned once per cause (requests: once per request); later polls return
  ``None``.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch.distributed as dist

from elastic.collectives import agree_max


@dataclass(frozen=True)
class PreemptionNotice:
    step: int
    source: str  # "signal", "ray" (Ray's preemption notice) or "request" (on demand)
    must_exit: bool
    detail: Any = None  # ray.train.PreemptionInfo when source == "ray"


class PreemptionWatcher:
    def __init__(self, *, signals: tuple[int, ...] = (signal.SIGTERM,),
                 use_ray_train: bool | None = None, ray_check_every: int = 1,
                 requested: Callable[[], bool] | None = None) -> None:
        if ray_check_every < 1:
            raise ValueError(f"ray_check_every must be >= 1, got {ray_check_every}")
        self.signals = signals
        self.use_ray_train = _in_ray_train() if use_ray_train is None else use_ray_train
        self.ray_check_every = ray_check_every
        self.requested = requested  # on-demand snapshot (planned resize), asked on rank 0
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
        info = None
        if self.use_ray_train and step % self.ray_check_every == 0 \
                and "ray" not in self._reported:
            import ray.train

            info = ray.train.get_preemption_info()
        asked = self.requested is not None and _rank() == 0 and self.requested()
        code = agree_max(3 if signalled else 2 if info is not None else 1 if asked else 0)
        if code == 0:
            return None
        source = {3: "signal", 2: "ray", 1: "request"}[code]
        if source != "request":  # requests may come again (one per planned resize)
            self._reported.add(source)
        return PreemptionNotice(step=step, source=source, must_exit=source == "signal",
                                detail=info)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _in_ray_train() -> bool:
    try:
        from ray.train.v2._internal.execution.train_fn_utils import get_train_fn_utils

        get_train_fn_utils()
        return True
    except Exception:  # not inside a Ray Train worker (or Ray Train not importable)
        return False
