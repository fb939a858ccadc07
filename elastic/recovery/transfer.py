"""The training state of one member, sent to the members that lack it, over the group.

Contract
--------
- ``send_state(group, registry, to)`` (on the member that holds the state) and
  ``receive_state(group, registry, src)`` (on each member in ``to``) move everything the
  registry holds — model, optimizer state, schedule, data position, the session's step,
  extras — from ``src`` to the others, point to point: a JSON header (the registry's
  skeletons and a catalog of tensor names, dtypes and shapes) then the tensors' bytes in
  pieces of at most ``PIECE_BYTES``. Members that are not party to it do nothing.
- The receiver checks the header against its own registry (``StateRegistry.load``: the same
  checks as a snapshot restore; nothing is loaded unless everything fits) and loads it; it
  returns the skeletons it got, so a component registered later (a data loader made after
  the session) loads its part from them. Sender and receiver run the same code on the same
  model, so the check guards against a member that is not: a mismatch raises
  ``ManifestError`` (recovery then falls back to a group restart).
- A failed send or receive (a member lost again) returns False on both sides (the group
  records it); nothing is loaded then.

Replicated (DDP) state only: every tensor is the whole tensor. Why not through a snapshot:
this costs one copy over the network from a live peer and no storage at all, the way a
replacement worker in torchft heals from a peer; the RAM tier stays the source for state no
live member holds (a group restart).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from elastic.recovery.group import ElasticGroup
from elastic.state import StateRegistry

PIECE_BYTES = 64 * 2**20
_LENGTH_TAG, _HEADER_TAG, _FIRST_PIECE_TAG = 1, 2, 3

Span = tuple[int, int, int]  # (tensor index, first byte, end byte)


def _plan(sizes: list[int]) -> list[list[Span]]:
    """The tensors' bytes cut into pieces of at most ``PIECE_BYTES`` (both sides compute it
    from the catalog, so only bytes cross)."""
    pieces: list[list[Span]] = [[]]
    room = PIECE_BYTES
    for index, size in enumerate(sizes):
        start = 0
        while start < size:
            if room == 0:
                pieces.append([])
                room = PIECE_BYTES
            end = min(size, start + room)
            pieces[-1].append((index, start, end))
            room -= end - start
            start = end
    return [p for p in pieces if p]


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def send_state(group: ElasticGroup, registry: StateRegistry, to: list[int]) -> bool:
    flat = registry.flatten()
    names = sorted(flat.tensors)
    tensors = [flat.tensors[n].detach().contiguous() for n in names]
    header = json.dumps({
        "skeletons": flat.skeletons,
        "catalog": [[n, str(t.dtype).removeprefix("torch."), list(t.shape)]
                    for n, t in zip(names, tensors, strict=True)],
    }).encode()
    wire = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    length = torch.tensor([wire.numel()], dtype=torch.int64)
    if not group.exchange([(length, peer, _LENGTH_TAG) for peer in to], []):
        return False
    if not group.exchange([(wire, peer, _HEADER_TAG) for peer in to], []):
        return False
    sources = [_bytes_of(t) for t in tensors]
    for i, piece in enumerate(_plan([s.numel() for s in sources])):
        buffer = torch.cat([sources[t][a:b] for t, a, b in piece]).to(group.device)
        if not group.exchange([(buffer, peer, _FIRST_PIECE_TAG + i) for peer in to], []):
            return False
    return True


def receive_state(group: ElasticGroup, registry: StateRegistry, src: int
                  ) -> dict[str, Any] | None:
    """The sender's skeletons once its state is loaded, or None if the group broke."""
    length = torch.zeros(1, dtype=torch.int64)
    if not group.exchange([], [(length, src, _LENGTH_TAG)]):
        return None
    wire = torch.empty(int(length.item()), dtype=torch.uint8)
    if not group.exchange([], [(wire, src, _HEADER_TAG)]):
        return None
    header = json.loads(wire.numpy().tobytes())
    tensors: dict[str, torch.Tensor] = {}
    targets: list[torch.Tensor] = []
    for name, dtype_name, shape in header["catalog"]:
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor {name!r} of member {src}: unknown dtype {dtype_name!r}")
        tensor = torch.empty(tuple(int(x) for x in shape), dtype=dtype)
        tensors[str(name)] = tensor
        targets.append(_bytes_of(tensor))
    for i, piece in enumerate(_plan([t.numel() for t in targets])):
        buffer = torch.empty(sum(b - a for _, a, b in piece), dtype=torch.uint8,
                             device=group.device)
        if not group.exchange([], [(buffer, src, _FIRST_PIECE_TAG + i)]):
            return None
        offset = 0
        for t, a, b in piece:
            targets[t][a:b].copy_(buffer[offset: offset + b - a])
            offset += b - a
    skeletons: dict[str, Any] = header["skeletons"]
    present = {k: v for k, v in skeletons.items() if k in registry.keys()}
    registry.load(tensors, present, where=f"the state of member {src}")
    return skeletons
