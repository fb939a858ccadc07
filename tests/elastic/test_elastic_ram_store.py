"""The RAM tier without Ray (elastic/store/ram_store.py): ring placement, the per-node cap, what a
store keeps, and a coordinator that handles metadata only.

Nodes are in-process ``RamStore`` objects here (the Ray actor is the same class made
remote); a lost node is a store that answers ``StoreLost``, as a dead actor does.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from torch import nn

from elastic.coord.local_coordinator import LocalCoordinator
from elastic.coord.protocol import CoordinatorClient
from elastic.coord.receipts import Receipt
from elastic.format.records import DEFAULT_BLOCK_BYTES, MANIFEST_NAME
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.store.ram_store import RamStore, RamStoreClient, RamTier, StoreLost, ring_holders
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import build, full_state, train_step
from elastic.write.persist import RAM_GRACE_MIN_S

# ------------------------------------------------------------------------------ placement


def test_ring_places_copies_on_the_next_nodes_never_the_own_one() -> None:
    nodes = ["c", "a", "d", "b"]  # sorted: a b c d
    assert ring_holders("a", nodes, 1) == ["b"]
    assert ring_holders("d", nodes, 1) == ["a"]  # wraps around
    assert ring_holders("b", nodes, 2) == ["c", "d"]
    assert ring_holders("c", nodes, 9) == ["d", "a", "b"]  # at most every other node
    assert ring_holders("a", nodes, 0) == []  # off
    for node in nodes:
        for k in (1, 2, 3):
            assert node not in ring_holders(node, nodes, k)
    # Every node's shard lands on a different node: losing one node loses one copy each.
    assert sorted(ring_holders(n, nodes, 1)[0] for n in nodes) == sorted(nodes)
    assert ring_holders("solo", ["solo"], 1) == ["solo"]  # one node: its own store
    assert ring_holders("new", ["a", "b"], 1) == ["a"]  # a node not listed yet still counts


# ------------------------------------------------------------------------------ one store


def _data(n: int, value: int = 1) -> np.ndarray:
    return np.full(n, value, dtype=np.uint8)


def test_store_is_capped_per_node() -> None:
    store = RamStore(cap_bytes=100)
    assert store.put(2, 0, "shard-0", _data(60))
    assert not store.put(2, 0, "shard-1", _data(60))  # 120 > 100: storage-only
    assert store.put(2, 0, "shard-2", _data(40))
    assert store.held_bytes() == 100 and store.refused == 1
    assert store.read(2, [("shard-1", 0, 1)]) is None  # not held: the reader goes to storage
    store.keep(2, [])
    # A new step's shards do not fit beside the committed one: refused, the commit kept.
    assert not store.put(4, 0, "shard-0", _data(60, 7))
    assert store.stats()["steps"] == [2]
    assert bytes(store.read(2, [("shard-0", 10, 12)])[0]) == b"\x01\x01"
    assert not RamStore(cap_bytes=0).put(2, 0, "f", _data(1))


def test_store_keeps_two_steps_the_newest_commit_or_a_step_whose_notice_is_late() -> None:
    store = RamStore()
    assert store.put(2, 1, "f", _data(8, 2))
    assert store.put(4, 1, "f", _data(8, 4))
    # Not told of any commit yet: 4 may be the committed one; a third step drops only the
    # oldest, never both.
    assert store.put(6, 1, "f", _data(8, 6))
    assert store.stats()["steps"] == [4, 6]
    store.keep(6, [])
    assert store.put(8, 1, "f", _data(8, 8))  # the commit and the one step in flight
    assert store.stats()["steps"] == [6, 8]
    # 10 overtook the notice of 8's commit: 8 (most likely committed) is kept, 6 let go.
    assert store.put(10, 1, "f", _data(8, 10))
    assert store.stats()["steps"] == [8, 10]
    store.keep(8, [10])  # the late notice
    assert store.stats()["steps"] == [8, 10]
    assert not store.put(8, 1, "g", _data(8))  # at or before the newest commit: refused
    assert not store.put(12, 0, "f", _data(8))  # an older generation: refused
    assert store.put(12, 2, "f", _data(8, 12))  # a new generation: its in-flight 10 is gone
    assert store.stats()["steps"] == [8, 12]
    assert not store.put(10, 2, "f", _data(8))  # older than the step in flight: refused
    # A keep overtaken by a newer put does not drop that put (its receipt is still coming).
    store.keep(8, [])
    assert store.stats()["steps"] == [8, 12]
    store.keep(12, [])
    assert store.stats()["steps"] == [12]
    assert [bytes(x) for x in store.read(12, [("f", 0, 2)])] == [b"\x0c\x0c"]
    assert store.read(8, [("f", 0, 2)]) is None
    # Snapshot 12 proved unusable: a new generation restarted from 10 and redoes step 12.
    assert store.put(14, 3, "f", _data(8, 14))
    assert not store.put(12, 3, "g", _data(8))  # still older than its own step in flight
    assert store.put(12, 4, "g", _data(8, 13))  # the next group's redone step 12 is taken
    assert store.stats()["steps"] == [12]
    store.keep(10, [12])  # the coordinator's newest commit is 10 now
    assert store.stats()["committed"] == 10
    assert store.put(14, 4, "g", _data(8, 15))
    assert store.stats()["steps"] == [12, 14]


def test_store_applies_notices_in_the_order_they_were_decided() -> None:
    """The coordinator sends notices from several threads and the store runs calls on
    several: a notice decided before one already applied changes nothing."""
    store = RamStore()
    for step in (4, 6):
        assert store.put(step, 1, "f", _data(8, step))
    store.keep(6, [], order=(100, 2))  # the commit of 6 ...
    store.keep(4, [6], order=(100, 1))  # ... overtook the notice that 6 was in flight
    assert store.stats()["committed"] == 6 and store.stats()["steps"] == [6]
    store.keep(4, [], order=(100, 2))  # the same place again: not newer
    assert store.stats()["committed"] == 6
    # A restarted coordinator (a later start) numbers from 1 again; its word counts.
    store.keep(4, [], order=(200, 1))
    assert store.stats()["committed"] == 4
    store.keep(2, [], order=None)  # unnumbered (a test, a tool): applied as it comes
    assert store.stats()["committed"] == 2


def test_store_owns_a_copy_of_what_it_is_given() -> None:
    store = RamStore()
    image = _data(16, 3)
    store.put(1, 0, "f", image)
    image[:] = 9  # the capture image is reused by the next capture
    assert bytes(store.read(1, [("f", 0, 16)])[0]) == bytes([3] * 16)


# ------------------------------------------------------------------------------ a cluster of stores


class _Nodes:
    """In-process stores standing for nodes; ``lose(node)`` is the node going away."""

    def __init__(self, names: list[str], cap_bytes: int | None = None) -> None:
        self.stores = {n: RamStore(cap_bytes) for n in names}
        self.lost: set[str] = set()

    def live(self) -> list[str]:
        return [n for n in self.stores if n not in self.lost]

    def store_on(self, node: str) -> RamStoreClient:
        if node in self.lost:
            raise StoreLost(f"node {node} is gone")
        return self.stores[node]

    def tier(self, node: str, replicas: int = 1) -> RamTier:
        return RamTier(node, self.live, self.store_on, replicas=replicas)

    def lose(self, node: str) -> None:
        self.lost.add(node)


def test_replicas_are_sent_one_shared_copy_concurrently() -> None:
    """With ram_replicas = 2 the image is copied once (``share``: ray.put on a cluster) and
    both stores are sent that copy before either answer is awaited; the caller may reuse the
    image as soon as ``put`` returns."""
    nodes = _Nodes(["n0", "n1", "n2"])
    events: list[str] = []
    shared: list[np.ndarray] = []

    def share(data: np.ndarray) -> np.ndarray:  # the object store's copy
        shared.append(data.copy())
        return shared[-1]

    class Recording:
        def __init__(self, node: str) -> None:
            self.node, self.store = node, nodes.stores[node]

        def start_put(self, step: int, generation: int, file: str, data: Any):
            assert data is shared[-1], "each store must be sent the one shared copy"
            events.append(f"send {self.node}")
            took = self.store.put(step, generation, file, data)

            def waiter(timeout_s: float | None) -> bool:
                events.append(f"wait {self.node}")
                return took

            return waiter

    tier = RamTier("n0", nodes.live, Recording, replicas=2, share=share)
    image = _data(64, 7)
    holders = tier.put(2, 0, "shard", image)
    image[:] = 0  # the capture image is reused by the next capture
    assert holders(1.0) == ["n1", "n2"]
    assert len(shared) == 1  # one copy for both replicas
    assert events == ["send n1", "send n2", "wait n1", "wait n2"]
    for node in ("n1", "n2"):
        assert bytes(nodes.stores[node].read(2, [("shard", 0, 64)])[0]) == bytes([7] * 64)
    # No store to send to: nothing is copied.
    alone = RamTier("n0", nodes.live, Recording, replicas=0, share=share)
    assert alone.put(4, 0, "shard", image)(1.0) == [] and len(shared) == 1


_JSON_SCALARS = (str, int, float, bool, type(None))


def _json_only(value: Any, where: str) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            assert isinstance(k, str), where
            _json_only(v, where)
    elif isinstance(value, list | tuple):
        for v in value:
            _json_only(v, where)
    else:
        assert isinstance(value, _JSON_SCALARS), f"{where} sent {type(value).__name__}"


class _Wire:
    """What a worker's calls to a remote coordinator carry: every argument must be plain
    JSON data (no bytes, arrays or views; a receipt crosses as its JSON form, as to the Ray
    actor), and its size is counted."""

    def __init__(self, coordinator: LocalCoordinator) -> None:
        self.coordinator = coordinator
        self.sent = 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.coordinator, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if name == "report_shard":
                args = (args[0].to_json(),)
            _json_only([list(args), kwargs], name)
            self.sent += len(json.dumps([list(args), kwargs]))
            if name == "report_shard":
                return method(Receipt.from_json(args[0]))
            return method(*args, **kwargs)

        return call


def _state_bytes(snap: Snapshotter) -> int:
    return sum(t.numel() * t.element_size() for t in snap.registry.flatten().tensors.values())


def _two_ranks(run: str, nodes: _Nodes, ballast: int, steps: int):
    """Ranks 0 and 1 (on nodes n0 and n1) train and snapshot every 2 steps."""
    coord = LocalCoordinator(SnapshotStore(run), keep_last=2, block_bytes=DEFAULT_BLOCK_BYTES,
                             ram_stores=nodes.store_on)
    wire = _Wire(coord)
    states, snaps = [], []
    for rank, node in enumerate(["n0", "n1"]):
        ts = build(seed=5)
        ts.registry.register("ballast", _ballast(ballast))
        states.append(ts)
        snaps.append(Snapshotter(run, ts.registry, rank, 2, coordinator=wire,
                                 ram_tier=nodes.tier(node),
                                 settings=SnapshotSettings(snapshot_every=2, durable=False,
                                                           split_min_bytes=64)))
    assert isinstance(wire, CoordinatorClient)
    for step in range(1, steps + 1):
        for ts, snap in zip(states, snaps, strict=True):
            train_step(ts, step)
            snap.after_step(step)
            snap.persister.wait()
    return coord, wire, states, snaps


def _ballast(n: int) -> nn.Module:
    torch.manual_seed(1)
    return nn.Linear(n, 1, bias=False)


def _restore_on(run: str, nodes: _Nodes, node: str, wire: _Wire, ballast: int):
    ts = build(seed=99)
    ts.registry.register("ballast", nn.Linear(ballast, 1, bias=False))
    snap = Snapshotter(run, ts.registry, coordinator=wire, ram_tier=nodes.tier(node))
    step = snap.restore()
    return step, snap, ts


def test_coordinator_handles_metadata_only_whatever_the_state_size(tmp_path) -> None:
    handled = {}
    for ballast in (64, 1 << 20):  # 256 B and 4 MiB of extra state
        nodes = _Nodes(["n0", "n1", "n2"])
        coord, wire, states, snaps = _two_ranks(str(tmp_path / f"run{ballast}"), nodes,
                                                ballast, steps=6)
        assert coord.committed_steps() == [4, 6]
        # Each shard's copy is on the next node: n0 -> n1, n1 -> n2, none on its own.
        locations = coord.ram_locations(6)
        assert sorted(locations.values()) == [["n1"], ["n2"]]
        assert nodes.stores["n0"].held_bytes() == 0
        # The stores hold the newest commit only (nothing is in flight).
        assert all(s.stats()["steps"] in ([], [6]) for s in nodes.stores.values())
        handled[ballast] = (coord.health()["handled_bytes"], wire.sent, _state_bytes(snaps[0]))
    (small, small_sent, small_state), (big, big_sent, big_state) = handled[64], handled[1 << 20]
    assert big_state > 20 * small_state
    # Receipts in, manifests out, calls' arguments: the same size whatever the state's size.
    assert big < 1.05 * small and big_sent < 1.05 * small_sent, handled
    assert big < big_state / 10


def test_node_loss_restores_from_the_peer_copy_and_falls_back_for_lost_copies(
        tmp_path, monkeypatch) -> None:
    run = str(tmp_path / "run")
    read: list[str] = []
    real_read_into = SnapshotStore.read_into

    def recording_read_into(self, path, reads):
        read.append(path.rsplit("/", 1)[-1])
        return real_read_into(self, path, reads)

    monkeypatch.setattr(SnapshotStore, "read_into", recording_read_into)
    nodes = _Nodes(["n0", "n1", "n2"])
    coord, wire, states, snaps = _two_ranks(run, nodes, 64, steps=6)
    reference = full_state(states[0])

    # n0 is lost: its shard's copy is on n1, n1's on n2. A worker on n1 restores from RAM.
    nodes.lose("n0")
    step, snap, ts = _restore_on(run, nodes, "n1", wire, 64)
    assert step == 6 and snap.restored_from == ("ram", 6)
    assert snap.store.stats.range_reads == 0 and read == []
    for key, value in reference.items():
        assert torch.equal(full_state(ts)[key], value), key

    # n1 (holding n0's copy) is lost as well: n0's shard comes from storage, n1's from n2.
    nodes.lose("n1")
    step, snap, ts = _restore_on(run, nodes, "n2", wire, 64)
    assert step == 6 and snap.restored_from == ("storage", 6)
    assert 0 < snap.store.stats.range_reads
    assert set(read) == {f for f, holders in coord.ram_locations(6).items()
                         if holders == ["n1"]}
    for key, value in reference.items():
        assert torch.equal(full_state(ts)[key], value), key



def test_a_restarted_coordinator_rebuilds_its_ram_index_from_the_live_stores(tmp_path) -> None:
    """The receipts die with the coordinator; the stores' metadata (never their bytes)
    rebuilds the index of the newest commit, so a restore after the restart still reads the
    peer copies. A store that is gone is absent: its files come from storage."""
    run = str(tmp_path / "run")
    nodes = _Nodes(["n0", "n1", "n2"])
    ballast = 1 << 16
    coord, wire, states, snaps = _two_ranks(run, nodes, ballast, steps=6)
    reference, before = full_state(states[0]), coord.ram_locations(6)
    assert sorted(before.values()) == [["n1"], ["n2"]]
    # A step in flight when the coordinator died (never committed) is not indexed.
    nodes.stores["n1"].put(8, coord.current_generation(), "in-flight", _data(16, 1))
    coord.flush(0)  # it died after its housekeeping thread deleted step 2 (keep_last=2)
    # ... and before the stores heard that 6 committed: the last notice they applied was
    # its own (numbered far ahead, to show a restarted coordinator's numbers come after).
    for node in ("n1", "n2"):
        nodes.stores[node].keep(4, [6], order=(coord._started_ns, 10**9))

    restarted = LocalCoordinator(SnapshotStore(run), keep_last=2,
                                 block_bytes=DEFAULT_BLOCK_BYTES, ram_stores=nodes.store_on)
    assert restarted.committed_steps() == [4, 6] and restarted.ram_locations(6) == {}
    holdings = {n: nodes.store_on(n).holdings() for n in nodes.live()}
    held = sum(s.held_bytes() for s in nodes.stores.values())
    assert len(repr(holdings)) < held / 100  # metadata: names and sizes, not the bytes
    assert restarted.recover_ram_index(holdings) == 2
    assert restarted.ram_locations(6) == before and restarted.ram_locations(8) == {}
    # It told the stores holding 6 that 6 is the newest commit: the next two puts keep it.
    assert [nodes.stores[n].stats()["committed"] for n in ("n1", "n2")] == [6, 6]
    assert restarted.recover_ram_index(holdings) == 0  # asking again adds nothing

    step, snap, ts = _restore_on(run, nodes, "n0", _Wire(restarted), ballast)
    assert step == 6 and snap.restored_from == ("ram", 6)
    # From storage only the manifest (the new coordinator did not commit it, so it does not
    # hold it in memory); every shard byte from the peers' RAM.
    manifest = snap.store.size(snap.store.step_path(6, MANIFEST_NAME))
    assert (snap.store.stats.range_reads, snap.store.stats.bytes_read) == (1, manifest)
    for key, value in reference.items():
        assert torch.equal(full_state(ts)[key], value), key

    # n2's store is gone when the coordinator restarts again: the index names n1 only, and
    # the shard whose copy was on n2 is read from storage.
    nodes.lose("n2")
    again = LocalCoordinator(SnapshotStore(run), keep_last=2, block_bytes=DEFAULT_BLOCK_BYTES,
                             ram_stores=nodes.store_on)
    assert again.recover_ram_index({n: nodes.store_on(n).holdings()
                                    for n in nodes.live()}) == 1
    assert again.ram_locations(6) == {f: h for f, h in before.items() if h == ["n1"]}
    step, snap, ts = _restore_on(run, nodes, "n0", _Wire(again), ballast)
    assert step == 6 and snap.restored_from == ("storage", 6)
    assert 0 < snap.store.stats.range_reads
    for key, value in reference.items():
        assert torch.equal(full_state(ts)[key], value), key


def test_a_copy_still_on_its_way_does_not_hold_up_the_commit(tmp_path) -> None:
    """A store that has not answered by the time the shard is durable (one starting up, a
    slow link) is waited for a bounded time, then left out of the receipt."""
    nodes = _Nodes(["n0", "n1", "n2"])
    waited: list[float | None] = []
    slow = nodes.stores["n2"]

    class Starting:  # n2's store never answers in time
        def start_put(self, step: int, generation: int, file: str, data: Any):
            slow.put(step, generation, file, data)  # it does arrive, later

            def took(timeout_s: float | None) -> bool:
                waited.append(timeout_s)
                return False

            return took

        def read(self, step, requests):
            return slow.read(step, requests)

        def keep(self, committed, in_flight, order=None):
            slow.keep(committed, in_flight, order)

    real_store_on = nodes.store_on
    nodes.store_on = lambda node: Starting() if node == "n2" else real_store_on(node)  # type: ignore[method-assign]
    coord, wire, states, snaps = _two_ranks(str(tmp_path / "run"), nodes, 64, steps=4)
    assert coord.committed_steps() == [2, 4]
    assert sorted(coord.ram_locations(4).values()) == [["n1"]]  # n1's shard: storage-only
    assert waited and all(t is not None and t > 0.9 * RAM_GRACE_MIN_S for t in waited)


def test_a_bad_ram_copy_is_read_again_from_storage_not_quarantined(tmp_path) -> None:
    run = str(tmp_path / "run")
    ts = build(seed=5)
    snap = Snapshotter(run, ts.registry, settings=SnapshotSettings(snapshot_every=2, durable=False))
    for step in (1, 2):
        train_step(ts, step)
        snap.after_step(step)
        snap.persister.wait()
    reference = full_state(ts)
    assert snap.ram_tier is not None
    store = snap.ram_tier.store_on("local")
    assert isinstance(store, RamStore)
    (copy,) = store.files[2].values()
    copy[-1] ^= 0xFF  # the store's copy goes bad; the file in storage is fine
    train_step(ts, 3)  # move on, so that the restore has something to undo
    assert snap.restore() == 2 and snap.restored_from == ("storage", 2)
    assert snap.restore_errors == [] and SnapshotStore(run).committed_steps() == [2]
    for key, value in reference.items():
        assert torch.equal(full_state(ts)[key], value), key
    snap.close()


class _NeedsSteps:
    """A rule that reads every parameter's optimizer `step` (as the trainer's does)."""

    def scalars(self, skeletons: Any) -> list[str]:
        return [entry["step"]["__tensor__"] for entry in skeletons["optim"]["state"].values()]

    def check(self, skeletons: Any, scalars: Any) -> None:
        if sorted(set(scalars.values())) != [2.0]:
            raise ValueError(f"steps {sorted(set(scalars.values()))}")

    def loaded(self) -> None:
        return None


def test_a_bad_ram_copy_of_what_a_rule_reads_is_read_again_from_storage(tmp_path) -> None:
    """The scalars a registry rule needs are read before the restore (from the RAM tier
    first): a RAM copy that fails its checks there is no verdict on the snapshot either."""
    run = str(tmp_path / "run")
    ts = build(seed=5)
    ts.registry.add_rule(_NeedsSteps())
    snap = Snapshotter(run, ts.registry, settings=SnapshotSettings(snapshot_every=2, durable=False))
    for step in (1, 2):
        train_step(ts, step)
        snap.after_step(step)
        snap.persister.wait()
    reference = full_state(ts)
    assert snap.ram_tier is not None
    store = snap.ram_tier.store_on("local")
    assert isinstance(store, RamStore)
    (copy,) = store.files[2].values()
    copy ^= 0xFF  # every byte of the store's copy goes bad
    train_step(ts, 3)
    assert snap.restore() == 2 and snap.restored_from == ("storage", 2)
    assert snap.restore_errors == [] and SnapshotStore(run).committed_steps() == [2]
    for key, value in reference.items():
        assert torch.equal(full_state(ts)[key], value), key
    snap.close()
