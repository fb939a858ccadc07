"""The fused sketch path's plans, drawn a microbatch at a time: one keys launch and one sort for
all the sketched layers of a microbatch, instead of two launches per layer.

- `open_block(microbatch, derive) -> PlanStore` and `close_block(store)`: `seeds.sketch_seed`
  calls them on entering and leaving a block; `microbatch` is its `(seed, step, microbatch)`
  and `derive(name)` a layer's seed in it. Blocks with equal `microbatch` share one store (a
  backward run in a block of its own finds the forward's plans).
- `PlanStore.note(seed, name)`: the layer `name` drew `seed` here (`seeds.layer_seed`).
- `PlanStore.order(kernels, n, seed, device)` is bitwise `kernels.plan_order(n, seed, device)`
  (int64, n; shared between callers: never write into it). On a miss, one `kernels.plan_orders`
  call draws this plan together with the plans, under this microbatch's seeds, of every layer
  the previous microbatch (the latest that asked for any) asked for by name with the same n and
  device (`kernels.KEYS_PER_LAUNCH` seeds per keys launch, one sort for all); later requests,
  activation-checkpoint recompute and layers called twice hit. The first microbatch a process
  runs draws each plan alone.
- Lifetime: a store's plans are dropped when a block for another microbatch opens (or when a
  block closes while another store is kept), so at most one microbatch beyond the open blocks
  holds plans: 8 bytes per row and sketched layer (the layers save their own int32 copy for
  backward). `held_bytes()` says how many are held now.

A plan is a pure function of (seed, n), so a held plan is the right one whoever drew it, and
which layers are drawn together changes launches, never bits: a resumed, resized or recomputed
step draws the same sketches (P1). Outside any block seeds are fresh per call and nothing is
shared (`seeds.plan_order` draws each plan alone). Why this design, and the alternatives
weighed: docs/design.md, "A microbatch's sketch plans, drawn together".
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import ModuleType

import torch

Microbatch = tuple[int, int, int]  # a sketch_seed block's (seed, step, microbatch)
Request = tuple[str, int, torch.device]  # (layer name, rows, device) of a plan asked for

_lock = threading.Lock()  # autograd may run backward (and recompute) on its own threads
_live: dict[Microbatch, PlanStore] = {}  # the stores of open blocks, and the one kept
_kept: PlanStore | None = None  # the latest store whose blocks all closed


class PlanStore:
    """The plans of one microbatch (module docstring)."""

    def __init__(self, microbatch: Microbatch, derive: Callable[[str], int],
                 previous: dict[Request, None]) -> None:
        self.microbatch, self.derive = microbatch, derive
        self.previous = previous  # the requests of the microbatch before: what to draw
        self.names: dict[int, str] = {}  # seed -> layer name, from seeds.layer_seed
        self.requests: dict[Request, None] = {}  # in order, for the next microbatch
        self.orders: dict[tuple[int, int, torch.device], torch.Tensor] = {}
        self.blocks = 0  # open sketch_seed blocks using this store

    def note(self, seed: int, name: str) -> None:
        self.names[seed] = name

    def order(self, kernels: ModuleType, n: int, seed: int,
              device: torch.device) -> torch.Tensor:
        """`kernels.plan_order(n, seed, device)`, held or drawn with the predicted ones."""
        with _lock:
            name = self.names.get(seed)
            if name is not None:
                self.requests[(name, n, device)] = None
            held = self.orders.get((seed, n, device))
            if held is not None:
                return held
            seeds = [seed, *self._predicted(n, device, seed)]
            for drawn, row in zip(seeds, kernels.plan_orders(n, seeds, device).unbind(0),
                                  strict=True):
                self.orders[(drawn, n, device)] = row
            return self.orders[(seed, n, device)]

    def _predicted(self, n: int, device: torch.device, seed: int) -> list[int]:
        """This microbatch's seeds of the previous one's layers with n rows on `device`
        that are not held yet."""
        seeds = dict.fromkeys(self.derive(name) for name, rows, where in self.previous
                              if rows == n and where == device)
        return [s for s in seeds if s != seed and (s, n, device) not in self.orders]

    def drop(self) -> None:
        self.orders.clear()


def open_block(microbatch: Microbatch, derive: Callable[[str], int]) -> PlanStore:
    """The store of a `sketch_seed` block for `microbatch` (shared with open or kept blocks
    for the same one); another microbatch's kept store is dropped."""
    global _kept
    with _lock:
        store = _live.get(microbatch)
        if store is None:
            # The latest microbatch that asked for plans (not an empty block in between).
            previous = {} if _kept is None else dict(_kept.requests or _kept.previous)
            if _kept is not None:
                _live.pop(_kept.microbatch, None)
                _kept.drop()
                _kept = None
            store = _live[microbatch] = PlanStore(microbatch, derive, previous)
        elif store is _kept:
            _kept = None
        store.blocks += 1
        return store


def close_block(store: PlanStore) -> None:
    """A block using `store` ended: the store is kept once none is open (module docstring)."""
    global _kept
    with _lock:
        store.blocks -= 1
        if store.blocks:
            return
        if _kept is not None and _kept is not store:  # at most one kept: the latest
            _live.pop(_kept.microbatch, None)
            _kept.drop()
        _kept = store


def held_bytes() -> int:
    """The bytes of all plans held now (each batch's storage once)."""
    with _lock:
        storages = {order.untyped_storage().data_ptr(): order.untyped_storage().nbytes()
                    for store in _live.values() for order in store.orders.values()}
    return sum(storages.values())
