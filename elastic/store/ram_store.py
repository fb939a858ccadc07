"""The RAM tier: copies of shard files held by stores on peer nodes, never on the head.

``RamStore`` holds shard-file bytes for one run on one node: plain Python in-process (world size
1, tests), on Ray the per-node actor (``ray_actors.get_or_create_ram_store``, named
``baton-ram-<run>-<node>`` in namespace ``baton``, pinned to its node, detached).

* ``put(step, generation, file, data)`` keeps a copy the store owns and returns True, or refuses
  (False): a generation older than one seen, a step at or before the newest commit (unless
  from a newer generation: a group restarted from an older commit), an in-flight step older
  than the one held, or more than ``cap_bytes`` in all (``snapshots.ram_copy_mib``: that shard
  is then storage-only). It holds two steps at most: the put's and the newest other (the
  newest commit, or a predecessor whose commit notice the put overtook).
* ``keep(committed, in_flight, order)`` (the coordinator, at a commit or abort) drops all other
  steps but newer ones; a notice ordered before one applied (``order``: the coordinator's start
  time, a count) is ignored. ``read(step, requests)``: the ranges ``(file, start, end)``, or
  None unless every file is held (the reader then goes to storage).
* ``holdings()``: metadata only, ``{"committed": step or None, "steps": {step: {"generation":
  g, "files": {file: nbytes}}}}``, from which a restarted coordinator rebuilds its index.

``ring_holders(node, live_nodes, replicas)``: a worker on node ``i`` of the sorted live nodes
sends its shard to nodes ``i+1 .. i+replicas`` (its own only on a one-node cluster, which does
not survive that node's loss). ``RamTier`` is a worker's view: ``start_put`` (the data is taken
when the call returns), which nodes took it within a bounded wait (at most as long again as the
durable write: the tier never holds up a commit), and reads from whichever node the coordinator
names; a store gone (``StoreLost``) or refusing reads as "not held", never a failure.
``in_process_tier``: one store, node ``"local"``, for a run without Ray.

Transport: the image is put into the object store once (``RamTier(share=ray.put)``), every ring
store gets the reference and copies it into buffers it owns and reuses; reads return numpy
views (why: benchmarks/reports/2026-12-07-snapshot-path-costs.md).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np

# (file, start, end) byte ranges of one step's shard files.
Requests = list[tuple[str, int, int]]

LOCAL_NODE = "local"

class StoreLost(OSError):
    """The store actor (and so its node) is gone: its copies are lost, read storage."""


# Waits up to the given seconds (None: for good) for a put; True once the store took it.
PutWaiter = Callable[[float | None], bool]


class RamStoreClient(Protocol):
    """What a worker and the coordinator call on a store (a ``RamStore`` in-process, or
    the Ray actor through ``elastic.coord.ray_actors.RayRamStoreClient``). ``start_put`` has
    taken what it needs of ``data`` when it returns (a Ray call serialises its arguments
    then); the store's answer may come later."""

    def start_put(self, step: int, generation: int, file: str, data: Any) -> PutWaiter: ...

    def read(self, step: int, requests: Requests) -> list[Any] | None: ...

    def keep(self, committed: int | None, in_flight: list[int],
             order: tuple[int, int] | None = None) -> None: ...

    def holdings(self) -> dict[str, Any]: ...


class RamStore:
    """Shard-file copies of one run on one node (thread-safe; see the module docstring)."""

    def __init__(self, cap_bytes: int | None = None) -> None:
        self.cap_bytes = cap_bytes
        self._lock = threading.Lock()
        self.files: dict[int, dict[str, np.ndarray]] = {}  # step -> file -> owned bytes
        self.step_generation: dict[int, int] = {}
        self.generation = -1  # the newest generation a put came from
        self.committed: int | None = None  # the newest commit the coordinator told of
        self._notice_order: tuple[int, int] = (-1, -1)  # the newest notice applied
        self._spare: list[np.ndarray] = []  # dropped buffers, reused by later puts
        self.allocated = 0  # buffers ever allocated (after the first two snapshots: none)
        self.refused = 0
        self.bytes_in = 0
        self.bytes_out = 0

    def put(self, step: int, generation: int, file: str, data: Any) -> bool:
        view = data.reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) \
            else np.frombuffer(data, dtype=np.uint8)
        with self._lock:
            if generation < self.generation:
                self.refused += 1
                return False
            if generation > self.generation:  # what older groups left in flight is void
                for s in self._uncommitted_locked():
                    if self.step_generation[s] < generation:
                        self._drop_locked(s)
                self.generation = generation
            if ((self.committed is not None and step <= self.committed
                 and generation <= self.step_generation.get(self.committed, -1))
                    or any(s > step for s in self._uncommitted_locked())):
                self.refused += 1
                return False
            # This step and the newest other, never a third: that other is the newest
            # commit, or a step whose commit notice this put overtook (the step before this
            # one has most likely committed; the older commit is then the one let go).
            for s in sorted(s for s in self.files if s != step)[:-1]:
                self._drop_locked(s)
            previous = self.files.get(step, {}).pop(file, None)
            if previous is not None:
                self._spare.append(previous)
            if self.cap_bytes is not None:
                if self._held_locked() + self._spare_locked() + view.nbytes > self.cap_bytes:
                    self._spare.clear()  # resident memory counts against the cap
                if self._held_locked() + view.nbytes > self.cap_bytes:
                    self.refused += 1
                    return False
            owned = self._take_spare_locked(view.nbytes)
            np.copyto(owned, view)
            self.files.setdefault(step, {})[file] = owned
            self.step_generation[step] = generation
            self.bytes_in += view.nbytes
            return True

    def start_put(self, step: int, generation: int, file: str, data: Any) -> PutWaiter:
        """In-process: the put is done when this returns."""
        took = self.put(step, generation, file, data)
        return lambda _timeout_s: took

    def read(self, step: int, requests: Requests) -> list[np.ndarray] | None:
        with self._lock:
            held = self.files.get(step, {})
            if not all(f in held for f, _, _ in requests):
                return None
            out = [held[f][a:b] for f, a, b in requests]
            self.bytes_out += sum(len(x) for x in out)
            return out

    def keep(self, committed: int | None, in_flight: list[int],
             order: tuple[int, int] | None = None) -> None:
        with self._lock:
            if order is not None:
                if order <= self._notice_order:
                    return  # overtaken by a newer notice: the coordinator's word then
                self._notice_order = order
            # The coordinator's word is final: after an unusable snapshot its newest commit
            # may be older than the one it told of before. (Notices overtaking each other
            # can cost a copy, never serve a wrong byte: files are named by generation and
            # every block is checksummed on restore.)
            self.committed = committed  # None: nothing is committed now (quarantined)
            wanted = set(in_flight) | ({committed} if committed is not None else set())
            # A step newer than all the coordinator knew of is a put whose receipt it has
            # not seen yet (this notice was overtaken): not its to drop.
            horizon = max(wanted, default=-1)
            for s in list(self.files):
                if s not in wanted and s <= horizon:
                    self._drop_locked(s)

    def holdings(self) -> dict[str, Any]:
        """What this store holds, metadata only (see the module docstring)."""
        with self._lock:
            return {"committed": self.committed,
                    "steps": {s: {"generation": self.step_generation.get(s, -1),
                                  "files": {f: int(b.nbytes) for f, b in files.items()}}
                              for s, files in self.files.items()}}

    def held_bytes(self) -> int:
        with self._lock:
            return self._held_locked()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"held_bytes": self._held_locked(), "spare_bytes": self._spare_locked(),
                    "steps": sorted(self.files), "committed": self.committed,
                    "refused": self.refused, "allocated": self.allocated,
                    "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}

    def _uncommitted_locked(self) -> list[int]:
        return [s for s in self.files if s != self.committed]

    def _held_locked(self) -> int:
        return sum(b.nbytes for files in self.files.values() for b in files.values())

    def _spare_locked(self) -> int:
        return sum(b.nbytes for b in self._spare)

    def _drop_locked(self, step: int) -> None:
        dropped = list(self.files.pop(step, {}).values())
        self.step_generation.pop(step, None)
        self._spare.extend(dropped)
        # Spares for one step's worth of puts at most: with the two steps held, a store's
        # memory stays about two snapshots' shards.
        limit = max([sum(b.nbytes for b in f.values()) for f in self.files.values()]
                    + [sum(b.nbytes for b in dropped)])
        while self._spare and self._spare_locked() > limit:
            self._spare.pop(0)

    def _take_spare_locked(self, nbytes: int) -> np.ndarray:
        """A dropped buffer of this size that nothing refers to any more (a reader's view
        of it holds a reference: CPython's count, as ``sys.getrefcount`` sees it), else a
        new one."""
        for i in range(len(self._spare)):
            # References: the list's slot and getrefcount's argument.
            if self._spare[i].nbytes == nbytes and sys.getrefcount(self._spare[i]) <= 2:
                return self._spare.pop(i)
        self.allocated += 1
        return np.empty(nbytes, dtype=np.uint8)


def ring_holders(node: str, live_nodes: Iterable[str], replicas: int) -> list[str]:
    """The nodes whose stores hold copies of a shard written on ``node``: the next
    ``replicas`` nodes after it in the sorted live nodes (0: none). Never ``node`` itself
    while another node is live; alone, ``node`` (not surviving its own loss)."""
    if replicas <= 0:
        return []
    ring = sorted(set(live_nodes) | {node})
    if len(ring) == 1:
        return [node]
    at = ring.index(node)
    return [ring[(at + k) % len(ring)] for k in range(1, min(replicas, len(ring) - 1) + 1)]


class RamTier:
    """A worker's access to the RAM tier (see the module docstring).

    ``store_on(node)`` gives the store client of ``node`` (raising ``StoreLost`` when it is
    gone); ``live_nodes()`` the nodes alive now. A store copies what it keeps, so ``put``
    may be given a view of memory the caller reuses (the capture image)."""

    def __init__(self, node: str, live_nodes: Callable[[], list[str]],
                 store_on: Callable[[str], RamStoreClient], *, replicas: int = 1,
                 share: Callable[[Any], Any] | None = None) -> None:
        self.node = node
        self.live_nodes = live_nodes
        self.store_on = store_on
        self.replicas = replicas
        # Makes the one copy of a shard that all its stores are sent (on Ray: ``ray.put``,
        # the object store; the stores get the reference). None: each store gets ``data``.
        self.share = share

    def put(self, step: int, generation: int, file: str, data: Any
            ) -> Callable[[float | None], list[str]]:
        """Start copying a shard file to the stores of its ring; ``data`` may be reused
        once this returns. The returned function waits up to its argument in seconds (None:
        for good) and returns the nodes that took the copy by then: a copy still on its way
        (a store just starting, a slow link) is not waited for beyond that, so the RAM tier
        never holds up a commit; the store drops it with the next snapshot.

        The copies travel concurrently: ``share`` (if given) copies ``data`` once, and every
        store is sent that one copy, each call returning at once; only then are the answers
        awaited, all under the one deadline."""
        ring = ring_holders(self.node, self.live_nodes(), self.replicas)
        payload = data if self.share is None or not ring else self.share(data)
        waiters: list[tuple[str, PutWaiter]] = []
        for node in ring:
            try:
                waiters.append((node, self.store_on(node).start_put(step, generation, file,
                                                                    payload)))
            except StoreLost:
                continue

        def holders(timeout_s: float | None) -> list[str]:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            took = []
            for node, waiter in waiters:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    if waiter(left):
                        took.append(node)
                except StoreLost:
                    continue
            return took

        return holders

    def prepare(self) -> None:
        """Reach (on Ray: start) the stores this node's shards go to, ahead of the first
        snapshot, so that a store starting up does not cost that snapshot its copy."""
        for node in ring_holders(self.node, self.live_nodes(), self.replicas):
            try:
                self.store_on(node)
            except StoreLost:
                continue

    def read(self, step: int, locations: dict[str, list[str]],
             requests: Requests) -> list[Any | None]:
        """Each request's bytes from a store holding its file, or None (read storage)."""
        got: list[Any | None] = [None] * len(requests)
        todo = list(range(len(requests)))
        tried: set[str] = set()
        while todo:
            # Ask each node for everything it is the first untried holder of.
            by_node: dict[str, list[int]] = {}
            for i in todo:
                node = next((n for n in locations.get(requests[i][0], []) if n not in tried),
                            None)
                if node is not None:
                    by_node.setdefault(node, []).append(i)
            if not by_node:
                break
            for node, indices in by_node.items():
                tried.add(node)
                try:
                    data = self.store_on(node).read(step, [requests[i] for i in indices])
                except StoreLost:
                    data = None
                if data is not None:
                    for i, d in zip(indices, data, strict=True):
                        got[i] = d
            todo = [i for i in todo if got[i] is None]
        return got


def in_process_tier(cap_bytes: int | None = None) -> RamTier:
    """The RAM tier of a run without Ray: one in-process store on node ``"local"``."""
    store = RamStore(cap_bytes)

    def store_on(node: str) -> RamStoreClient:
        if node != LOCAL_NODE:
            raise StoreLost(f"no RAM store on node {node!r} in this process")
        return store

    return RamTier(LOCAL_NODE, lambda: [LOCAL_NODE], store_on)
