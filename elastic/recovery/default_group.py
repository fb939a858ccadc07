"""The membership's group as torch.distributed's default process group (sharded layouts).

Contract: `form_default_group(view, backend, timeout_s)` makes the process group of the
membership `view` describes (``elastic.coord.membership``: rendezvous, rank, members) the
default one of this process: the group there before (Ray Train's of this worker alone, or an
earlier generation's) is destroyed first. Every member of the view calls it; it raises if the
group cannot form within `timeout_s` (a member gone again). `peer_lost(error)` tells an error
of a collective whose peer is gone or silent (gloo's connection errors and timeouts,
torch.distributed's backend and network errors) from any other error. `shard_mesh(device)` is
the 1-D `DeviceMesh` over the default group that FSDP2 shards over, named after the
generation that formed the group.

Why the name: `DeviceMesh` equality ignores this process's rank, and DTensor caches plans by
mesh (sharding propagation, redistribution). A survivor that sharded as rank 2 of 3, then 1
of 2, then 1 of 3 would get the first mesh's plans back, rank 2's coordinate included, and
restore the wrong shard; a mesh per generation never equals an earlier one.

Why a default group and not `elastic.recovery.group.ElasticGroup`: FSDP2 shards over a
`DeviceMesh`, which needs a registered torch.distributed group of the right size; a sharded
model is rebuilt over the new default group after each change of the membership (its state
restored from the newest commit), while a replicated one keeps its model and only swaps the
reconfigurable group under its gradient hook.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

_generation: int | None = None  # the membership generation of the default group formed here

# What gloo and torch.distributed say when a peer is gone or silent.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting",
              "Socket Timeout", "Broken pipe", "Connection refused")


def form_default_group(view: dict[str, Any], backend: str, timeout_s: float) -> None:
    global _generation
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _generation = None
    address, prefix = str(view["rendezvous"]).split("/", 1)
    host, port = address.rsplit(":", 1)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host.strip("[]"), int(port), is_master=False,
                          wait_for_workers=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"{prefix}/default", store),
                            rank=int(view["rank"]), world_size=len(view["members"]),
                            timeout=timeout)
    _generation = int(view["generation"])


def shard_mesh(device_type: str) -> DeviceMesh:
    name = "shard" if _generation is None else f"shard_g{_generation}"
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=(name,))


def peer_lost(error: BaseException) -> bool:
    if isinstance(error, (dist.DistBackendError, dist.DistNetworkError)):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error) for s in _PEER_LOST)
