"""The coordinator protocol (elastic/coord/protocol.py) is complete and spoken by every coordinator.

Without Ray: the local and store coordinators define every protocol method with the
protocol's parameters, and the Ray client forwards exactly the protocol's methods to its
actor handle (a fake one here) and nothing else, a receipt as its JSON form.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from elastic.coord.local_coordinator import LocalCoordinator
from elastic.coord.protocol import PROTOCOL_METHODS, CoordinatorClient
from elastic.coord.receipts import Receipt
from elastic.coord.store_coordinator import StoreCoordinator


def _parameters(fn: Any) -> list[tuple[str, Any]]:
    # Once elastic.coord.ray_actors made LocalCoordinator an actor class in this process (any
    # earlier test importing it), Ray's tracing hook shows `_ray_trace_ctx` on its methods.
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
            if p.name not in ("self", "_ray_trace_ctx")]


@pytest.mark.parametrize("cls", [LocalCoordinator, StoreCoordinator])
def test_every_coordinator_speaks_the_whole_protocol(cls: type) -> None:
    assert {"worker_lost", "events", "flush", "snapshot_requested",
            "answer_request"} <= PROTOCOL_METHODS
    for name in sorted(PROTOCOL_METHODS):
        assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
        assert _parameters(getattr(cls, name)) == _parameters(
            getattr(CoordinatorClient, name)), f"{cls.__name__}.{name}: other parameters"


class _FakeRemote:
    def __init__(self, calls: list[tuple[str, tuple, dict]], name: str) -> None:
        self.calls, self.name = calls, name

    def remote(self, *args: Any, **kwargs: Any) -> tuple[str, str]:
        self.calls.append((self.name, args, kwargs))
        return ("ref", self.name)


class _FakeHandle:
    """Stands in for an ActorHandle: every attribute is a remote method that records."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str) -> _FakeRemote:
        return _FakeRemote(self.calls, name)


def test_ray_client_forwards_exactly_the_protocol(monkeypatch) -> None:
    ray = pytest.importorskip("ray")
    from elastic.coord.ray_actors import RayCoordinatorClient

    monkeypatch.setattr(ray, "get", lambda ref: ("got", ref))
    handle = _FakeHandle()
    client = RayCoordinatorClient(handle)
    assert isinstance(client, CoordinatorClient)

    generic = sorted(PROTOCOL_METHODS - {"poll", "flush", "report_shard"})
    for name in generic:
        assert getattr(client, name)(1, key=2) == ("got", ("ref", name))
    assert [c[0] for c in handle.calls] == generic
    assert all(c[1:] == ((1,), {"key": 2}) for c in handle.calls)

    # A receipt crosses as its JSON form, read back checked by the actor (never pickled).
    receipt = Receipt(step=2, rank=1, world_size=2, generation=1, layout="ddp",
                      file="shard-00001-of-00002-g000001.safetensors", chunks={},
                      versions={"baton": "1"}, ram=("n1",))
    assert client.report_shard(receipt) == ("got", ("ref", "report_shard_json"))
    assert handle.calls[-1] == ("report_shard_json", (receipt.to_json(),), {})

    # Receipts go straight to the actor: poll and flush never reach it.
    client.poll()
    client.flush(5.0)
    assert len(handle.calls) == len(PROTOCOL_METHODS) - 2

    # Driver-only controls and typos are not forwarded.
    for name in ("request_snapshot", "request_met", "snapshot_requestd", "_private"):
        with pytest.raises(AttributeError):
            getattr(client, name)
