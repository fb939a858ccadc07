"""Measure what autograd keeps for backward.

Contract: `saved_bytes(run, module)` calls `run()` (a forward pass returning a tensor) under
`torch.autograd.graph.saved_tensors_hooks`, then backpropagates its sum, and returns the bytes
of the distinct storages that were saved for backward, `module`'s parameters excluded (they
exist anyway). This is the activation memory a training step holds between forward and
backward, the quantity BASIS reduces.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def saved_bytes(run: Callable[[], torch.Tensor], module: nn.Module) -> int:
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    out.float().sum().backward()  # the saved tensors must really be enough for backward
    return sum(storages.values())
