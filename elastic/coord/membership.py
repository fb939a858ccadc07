"""Who trains together: the coordinator's side of in-process recovery.

A *membership* is the ordered list of workers (members, by id) training together in one
generation; a member's rank is its index. ``Membership`` decides every change, as plain data:

* ``reset(expected)`` (the driver, before Ray Train starts a whole worker group): a new
  membership forms once ``expected`` members have joined, ordered by the ``order`` each gave
  (Ray Train's world rank); members of earlier generations are left out.
* ``join(member, order)``: a member of the forming group, or, while a membership runs, a
  *joiner* (a replacement) that waits to be let in at the members' next step boundary.
  Joiners are counted in every view (``joiners``), so the members see them.
* ``beat(member, generation)``, every ``beat_s`` from each member and waiting joiner, tells
  members of joiners, a reform, a fallback. A member is *gone* once silent for
  ``dead_after_s`` or, if longer, ``slow_margin`` times its longest recent beat gap (capped at
  ``reform_wait_s``): where beats come late (a loaded machine) a live member is not lost.
* ``reform(member, generation, reason)``: a member whose process group failed, or that agreed
  with its peers to let joiners in, asks for the next membership. It forms once every member
  has asked or is *gone* (silent too long, as above), or ``reform_wait_s`` after the first
  ask: the members that asked, in their old order, then the joiners still beating, in arrival
  order. Each formation is a new generation of the commit protocol (``new_generation``: an
  older generation's files and receipts are refused, P7).
* A member left out (gone too long, or behind a formation it took no part in) is *fenced*: its
  old generation's views and reforms say so; it may join again (state from a live member).
* ``fallback(member, reason)``: in-process recovery cannot go on (a second failure while
  recovering, a state that cannot be trusted): every member's next view says so and each ends
  its worker, so the group restarts whole. ``finish(generation)``: the run's last step is
  committed; later joiners restore it instead of joining.

Every method returns a ``View`` as a plain dict (it crosses Ray), safe to repeat; its
``rendezvous`` is where a generation's group meets (``<store address>/<prefix>``). Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Phases of the membership.
OFF = "off"  # no worker group announced: in-process recovery is not in use
FORMING = "forming"  # a whole worker group is starting: waiting for `expected` members
RUNNING = "running"
REFORMING = "reforming"  # a member asked for the next membership: collecting the others
FALLBACK = "fallback"  # in-process recovery gave up: every member ends its worker
FINISHED = "finished"  # the run's last step is committed


@dataclass(frozen=True)
class MembershipSettings:
    """How the coordinator tells gone from slow (seconds)."""

    beat_s: float = 0.1  # how often members beat (they read it from every view)
    dead_after_s: float = 0.6  # no beat for this long: gone, while a reform collects
    reform_wait_s: float = 10.0  # a reform forms without members that never asked by then
    slow_margin: float = 3.0  # ...or for this many times its longest recent gap, if longer
    recent_beats: int = 50  # how many of a member's gaps between beats count as recent

    def __post_init__(self) -> None:
        if not 0 < self.beat_s < self.dead_after_s:
            raise ValueError(f"beat_s ({self.beat_s}) must be > 0 and below dead_after_s "
                             f"({self.dead_after_s})")
        if self.slow_margin < 1 or self.recent_beats < 1:
            raise ValueError(f"slow_margin ({self.slow_margin}) must be >= 1 and recent_beats "
                             f"({self.recent_beats}) >= 1")
        if self.reform_wait_s < self.dead_after_s:
            raise ValueError(f"reform_wait_s ({self.reform_wait_s}) must be at least "
                             f"dead_after_s ({self.dead_after_s})")


@dataclass
class _Reform:
    started: float
    reasons: dict[str, str] = field(default_factory=dict)  # member -> why it asked


def off_view() -> dict[str, Any]:
    """The view of a coordinator that runs no membership (store groups, no Ray)."""
    return {"phase": OFF, "generation": -1, "members": [], "rank": None, "fresh": False,
            "joiners": 0,
            "rendezvous": "", "fenced": False, "beat_s": MembershipSettings().beat_s,
            "reason": ""}


class Membership:
    """See the module docstring. ``new_generation`` starts a generation (and persists it);
    ``rendezvous_address`` gives the store address (``host:port``) process groups meet at;
    both are called outside any lock only when a membership forms."""

    def __init__(self, new_generation: Callable[[], int],
                 rendezvous_address: Callable[[], str],
                 settings: MembershipSettings | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._new_generation = new_generation
        self._rendezvous_address = rendezvous_address
        self.settings = settings or MembershipSettings()
        self._clock = clock
        self._lock = threading.RLock()
        self._forming = threading.Lock()  # one formation at a time (it calls out)
        self.phase = OFF
        self.expected = 0
        self.generation = -1
        self.members: list[str] = []
        self._candidates: dict[str, int] = {}  # forming: member -> order
        self._joiners: dict[str, float] = {}  # member -> when it asked to join
        self._beats: dict[str, float] = {}  # member -> its last beat
        self._gaps: dict[str, deque[float]] = {}  # member -> its recent gaps between beats
        self._beating: set[str] = set()  # members whose last call was a beat
        self._reform: _Reform | None = None
        self._address = ""
        self.fallback_reason = ""
        self._started: tuple[int, frozenset[str]] = (-1, frozenset())  # the group that started
        self.history: list[dict[str, Any]] = []  # one record per formation (for the driver)
        self.fallbacks: list[str] = []  # why in-process recovery gave up, each time

    # ------------------------------------------------------------------ the driver

    def reset(self, expected: int) -> dict[str, Any]:
        """A whole worker group of ``expected`` workers is starting."""
        if expected < 1:
            raise ValueError(f"expected must be >= 1, got {expected}")
        with self._lock:
            self.phase, self.expected = FORMING, expected
            self.members, self._candidates, self._joiners = [], {}, {}
            self._reform, self.fallback_reason = None, ""
            return self._view("")

    # ------------------------------------------------------------------ members

    def join(self, member: str, order: int) -> dict[str, Any]:
        with self._lock:
            self._heard(member)
            if self.phase == FORMING:
                self._candidates[member] = order
            elif self.phase in (RUNNING, REFORMING) and member not in self.members:
                self._joiners.setdefault(member, self._clock())
        self._form_if_ready()
        with self._lock:
            return self._view(member)

    def beat(self, member: str, generation: int) -> dict[str, Any]:
        with self._lock:
            self._heard(member, beat=True)
        self._form_if_ready()
        with self._lock:
            return self._view(member, generation)

    def reform(self, member: str, generation: int, reason: str) -> dict[str, Any]:
        with self._lock:
            self._heard(member)
            if (self.phase in (RUNNING, REFORMING) and generation == self.generation
                    and member in self.members):
                if self._reform is None:
                    self._reform = _Reform(started=self._clock())
                    self.phase = REFORMING
                self._reform.reasons.setdefault(member, reason)
        self._form_if_ready()
        with self._lock:
            return self._view(member, generation)

    def fallback(self, member: str, reason: str) -> dict[str, Any]:
        with self._lock:
            if self.phase not in (FINISHED, OFF):
                if self.phase != FALLBACK:
                    self.fallbacks.append(reason)
                self.phase = FALLBACK
                self.fallback_reason = self.fallback_reason or f"{member}: {reason}"
            return self._view(member)

    def finish(self, generation: int) -> dict[str, Any]:
        with self._lock:
            if generation == self.generation and self.phase in (RUNNING, REFORMING):
                self.phase = FINISHED
            return self._view("")

    def leave(self, member: str) -> None:
        """A waiting joiner gave up (its worker ends): never let it in."""
        with self._lock:
            self._joiners.pop(member, None)
            self._candidates.pop(member, None)

    # ------------------------------------------------------------------ formation

    def _form_if_ready(self) -> None:
        """Form the next membership when the forming group is complete or the reform has
        heard from everyone it waits for (module docstring)."""
        with self._forming:
            with self._lock:
                if self.phase == FORMING and len(self._candidates) >= self.expected:
                    chosen = sorted(self._candidates, key=lambda m: (self._candidates[m], m))
                    reason = "start"
                elif self.phase == REFORMING and self._reform_ready():
                    assert self._reform is not None
                    asked = self._reform.reasons
                    now = self._clock()
                    joiners = sorted((m for m in self._joiners
                                      if m not in asked and not self._gone(m, now)),
                                     key=lambda m: (self._joiners[m], m))
                    chosen = [m for m in self.members if m in asked] + joiners
                    reason = "join" if set(asked.values()) == {"join"} else "failure"
                else:
                    return
            # Outside the lock: a new generation persists to storage (may be slow).
            generation = self._new_generation()
            address = self._address or self._rendezvous_address()
            with self._lock:
                previous = list(self.members)
                self._address = address
                self.generation, self.members, self.phase = generation, chosen, RUNNING
                if reason == "start":
                    self._started = (generation, frozenset(chosen))
                self._candidates = {}
                self._joiners = {m: t for m, t in self._joiners.items() if m not in chosen}
                self._reform = None
                self.history.append({
                    "generation": generation, "reason": reason, "members": list(chosen),
                    "left": [m for m in previous if m not in chosen],
                    "joined": [m for m in chosen if m not in previous], "time": time.time()})

    def _reform_ready(self) -> bool:
        assert self._reform is not None
        now = self._clock()
        if now - self._reform.started >= self.settings.reform_wait_s:
            return True
        waiting = [m for m in self.members if m not in self._reform.reasons]
        return all(self._gone(m, now) for m in waiting)

    def _heard(self, member: str, beat: bool = False) -> None:
        """Record a call from ``member``: every call says it lives; only the gap between two
        beats says how late its beats come (a join or reform before a beat may be followed
        by a restore, which is silent by design)."""
        now = self._clock()
        if beat and member in self._beating:
            gaps = self._gaps.setdefault(member, deque(maxlen=self.settings.recent_beats))
            gaps.append(now - self._beats[member])
        self._beats[member] = now
        if beat:
            self._beating.add(member)
        else:
            self._beating.discard(member)

    def _gone(self, member: str, now: float) -> bool:
        """Silent for longer than its own recent beats make plausible (module docstring)."""
        settings = self.settings
        slowest = max(self._gaps.get(member) or [0.0])
        limit = min(max(settings.dead_after_s, settings.slow_margin * slowest),
                    settings.reform_wait_s)
        return now - self._beats.get(member, -1e18) >= limit

    # ------------------------------------------------------------------ views

    def _view(self, member: str, generation: int | None = None) -> dict[str, Any]:
        in_current = member in self.members
        fenced = bool(member) and not in_current and member not in self._joiners \
            and member not in self._candidates and self.phase in (RUNNING, REFORMING) \
            and generation is not None and 0 <= generation < self.generation
        return {
            "phase": self.phase,
            "generation": self.generation,
            "members": list(self.members),
            "rank": self.members.index(member) if in_current else None,
            # A member of the group as it started (it restores the newest snapshot with the
            # others), not a joiner (which receives the state from a live member).
            "fresh": self._started == (self.generation, self._started[1])
            and member in self._started[1],
            "joiners": len(self._joiners),
            "rendezvous": f"{self._address}/baton-g{self.generation}" if self._address else "",
            "fenced": fenced,
            "beat_s": self.settings.beat_s,
            "reason": self.fallback_reason,
        }

    def health(self) -> dict[str, Any]:
        with self._lock:
            return {"phase": self.phase, "generation": self.generation,
                    "members": list(self.members), "joiners": len(self._joiners),
                    "history": [dict(h) for h in self.history],
                    "fallback": self.fallback_reason, "fallbacks": list(self.fallbacks)}
