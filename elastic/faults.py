"""Fault injection keyed by (rank, step, phase), for tests of the snapshot protocol and of
in-process recovery.

Contract: production code calls ``faults.hit(rank, step, phase)`` at each named phase of a
snapshot's life; with no plan it does nothing. A test arms a plan entry
``(rank | None, step | None, phase) -> "raise" | "exit"``; ``None`` matches any value.
``"raise"`` raises :class:`InjectedFault` (the thread or process handles it like any other
failure); ``"exit"`` ends the process at once with ``os._exit`` (a hard crash: no finally
blocks, no flushing), which is how a worker or the coordinator dying mid-phase is modelled;
a callable is called and the phase then proceeds (e.g. stop the storage endpoint mid-persist).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

# The phases in the order a snapshot goes through them.
PHASES: tuple[str, ...] = (
    "capture",  # worker: copying state into its CPU buffers
    "persist_begin",  # worker: before writing its shard file
    "persist_mid",  # worker: half of the shard file's bytes written (temp name on local disk)
    "persist_end",  # worker: shard durable, receipt not yet sent
    "commit_begin",  # coordinator: all receipts in, manifest not written
    "commit_manifest",  # coordinator: manifest bytes being written (temp name on local disk)
    "commit_end",  # coordinator: manifest written, garbage collection not done
)
# The phases of an in-process recovery (elastic.recovery), keyed by the steps completed.
RECOVERY_PHASES: tuple[str, ...] = (
    "recover_formed",  # worker: the next membership formed, its process group not yet
    "recover_transfer",  # worker: the members agreed who sends the state, nothing sent
)


class InjectedFault(RuntimeError):
    """Raised by an armed fault of kind "raise"."""


@dataclass
class FaultInjector:
    plan: dict[tuple[int | None, int | None, str], str | Callable[[], None]] = field(
        default_factory=dict)
    fired: list[tuple[int, int, str]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def arm(self, phase: str, *, rank: int | None = None, step: int | None = None,
            action: str | Callable[[], None] = "raise") -> FaultInjector:
        if phase not in PHASES + RECOVERY_PHASES:
            raise ValueError(f"unknown fault phase {phase!r}; choose one of "
                             f"{PHASES + RECOVERY_PHASES}")
        if not callable(action) and action not in ("raise", "exit"):
            raise ValueError(f"fault action must be 'raise', 'exit' or a callable, got {action!r}")
        self.plan[(rank, step, phase)] = action
        return self

    def hit(self, rank: int, step: int, phase: str) -> None:
        if not self.plan:
            return
        for key in ((rank, step, phase), (None, step, phase), (rank, None, phase),
                    (None, None, phase)):
            action = self.plan.get(key)
            if action is None:
                continue
            with self._lock:
                self.fired.append((rank, step, phase))
            if callable(action):
                action()
                return
            if action == "exit":
                os._exit(17)
            raise InjectedFault(f"injected fault: rank {rank}, step {step}, phase {phase}")

