"""Where BASIS sketches come from: 64-bit seeds and the (hash, signs) plan they expand to.

- `derive_seed(seed, step, microbatch, layer_name)` is a pure, platform-independent function
  (blake2b, never Python's salted `hash()`), returning a seed in [0, 2**63).
- `make_plan(n, rank, seed, device=)` expands a seed into the sketch of n rows (a `SketchPlan`,
  `sketch_ops.plan`, which the kernels read): the effective rank `min(rank, n)` (at least 1),
  every row's bucket `hash` and sign, and the same sketch in bucket-major (CSR) form. The
  balanced plan (the default) is drawn on `device` from an integer hash of the row index
  (`plan_hash`): bitwise the same on CPU and CUDA, and on a GPU a few launches with no host work
  that grows with n and no synchronisation (drawing it on the CPU and copying it cost more host
  time than the layer's GPU step). The uniform hash (`balanced=False`, an analysis option) is
  drawn from a CPU `torch.Generator` and copied.
- `sketch_seed(seed, step, microbatch)`: a context manager inside which every sketched layer's
  seed is `derive_seed(seed, step, microbatch, layer name)`. Outside it `layer_seed` draws a
  fresh seed from torch's global CPU generator, which `torch.utils.checkpoint` saves and
  restores, so a recomputed forward still reproduces its sketch.
- `plan_order(kernels, n, seed, device)`: the fused path's plan order for `seed`, bitwise
  `kernels.plan_order`; inside a block from the microbatch's `plan_cache.PlanStore`.

Activation checkpointing: a recompute reproduces the forward's sketch when it runs under the
same `sketch_seed` state as the forward (the trainer runs backward inside the context) or when
both run outside any context. A forward inside a context whose recompute runs after leaving it
draws a fresh seed: the layer stays correct (the saved sketch and the seed used in backward come
from the same recompute), but the sketch is no longer the one derived from (seed, step,
microbatch, layer).

The active seed is process-global (not thread- or context-local) on purpose: autograd may run
backward, and with it activation-checkpoint recompute, on its own worker threads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache, partial
from types import ModuleType

import torch

from . import dispatch, plan_cache
from .plan import SketchPlan

_SEED_MASK = (1 << 63) - 1  # seeds live in int64 tensors, so keep them non-negative


@dataclass(frozen=True)
class SketchSeedState:
    """The (run seed, step, microbatch) that sketches are derived from inside `sketch_seed`."""

    seed: int
    step: int
    microbatch: int
    # The fused path's plans for this microbatch (not part of the state's identity).
    plans: plan_cache.PlanStore = field(compare=False, repr=False)


_active: list[SketchSeedState] = []


@contextmanager
def sketch_seed(seed: int, step: int, microbatch: int = 0) -> Iterator[SketchSeedState]:
    """Make every sketch inside the block a pure function of (seed, step, microbatch, layer).

    Nesting is allowed; the innermost state wins. Layers capture their seed at forward time, so
    a backward run after leaving the block still uses the forward's sketch.
    """
    for name, value in (("seed", seed), ("step", step), ("microbatch", microbatch)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"sketch_seed: {name} must be an int, got {value!r}")
    if step < 0 or microbatch < 0:
        raise ValueError(
            f"sketch_seed: step and microbatch must be >= 0, got step={step}, "
            f"microbatch={microbatch}"
        )
    plans = plan_cache.open_block((seed, step, microbatch), partial(derive_seed, seed, step,
                                                                    microbatch))
    state = SketchSeedState(seed, step, microbatch, plans)
    _active.append(state)
    try:
        yield state
    finally:
        # By identity: nested blocks may have equal states.
        del _active[next(i for i, s in enumerate(_active) if s is state)]
        plan_cache.close_block(plans)


def active_seed_state() -> SketchSeedState | None:
    """The innermost `sketch_seed` state, or None outside any."""
    return _active[-1] if _active else None


def derive_seed(seed: int, step: int, microbatch: int, layer_name: str) -> int:
    """A stable 63-bit seed for one layer call; identical on every machine and Python run."""
    key = f"basis:{seed}:{step}:{microbatch}:{layer_name}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


def layer_seed(layer_name: str) -> int:
    """The seed a layer named `layer_name` uses for the current forward call."""
    state = active_seed_state()
    if state is not None:
        seed = derive_seed(state.seed, state.step, state.microbatch, layer_name)
        state.plans.note(seed, layer_name)  # which plans the next microbatch will want
        return seed
    # Fresh randomness from the global CPU generator: checkpoint recompute restores its state.
    return int(torch.randint(0, _SEED_MASK, (), dtype=torch.int64).item())


def plan_order(kernels: ModuleType, n: int, seed: int, device: torch.device) -> torch.Tensor:
    """The fused path's plan order (`kernels.plan_order(n, seed, device)`, int64, shared: never
    written), from the microbatch's plans inside a `sketch_seed` block."""
    state = active_seed_state()
    if state is None:
        return kernels.plan_order(n, seed, device)
    return state.plans.order(kernels, n, seed, device)


def effective_rank(rank: int, n: int) -> int:
    """R clamped to the number of rows (at least 1, so an empty input still has a shape)."""
    return max(1, min(rank, n))


@lru_cache(maxsize=8)  # a run has a few (rows, rank, device) shapes; each entry is ~16n bytes
def _balanced_layout(n: int, rank: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """What a balanced plan of n rows and `rank` buckets shares whatever its seed: the bucket of
    each position in the scrambled order (position p goes to bucket p mod R, slot p // R), the
    positions in bucket-major order, and the CSR offsets."""
    slots = -(-n // rank)
    positions = torch.arange(slots * rank).view(slots, rank).t().reshape(-1)
    positions = positions[positions < n]  # bucket r holds positions r, r + R, r + 2R, ...
    sizes = (n - torch.arange(rank) + rank - 1) // rank  # count of p < n with p % R == r
    offsets = torch.zeros(rank + 1, dtype=torch.int64)
    torch.cumsum(sizes, 0, out=offsets[1:])
    bucket_of_position = torch.arange(n) % rank
    return tuple(t.to(device) for t in (bucket_of_position, positions, offsets))


def make_plan(
    n: int, rank: int, seed: int, *, balanced: bool = True, device: torch.device | None = None
) -> SketchPlan:
    """Expand `seed` into the sketch of n rows on `device` (default CPU; module docstring)."""
    rank = effective_rank(rank, n)
    device = torch.device("cpu") if device is None else torch.device(device)
    if not balanced:
        return _uniform_plan(n, rank, seed).to(device)
    # Balanced hash (Algorithm 1 of BASIS): i mod R over a random order of the rows. Sorting
    # the rows' hash keys gives that order: position p holds row order[p].
    keys, signs = dispatch.row_keys(n, seed & _SEED_MASK, device)
    order = torch.argsort(keys)  # the keys are distinct: every sort gives this order
    bucket_of_position, positions, offsets = _balanced_layout(n, rank, device)
    bucket = torch.empty_like(order).scatter_(0, order, bucket_of_position)
    return SketchPlan(rank, bucket, signs, order[positions], offsets)


def _uniform_plan(n: int, rank: int, seed: int) -> SketchPlan:
    """The i.i.d. uniform hash (an analysis option), drawn on the CPU."""
    gen = torch.Generator(device="cpu").manual_seed(seed & _SEED_MASK)
    bucket = torch.randint(0, rank, (n,), generator=gen)
    signs = torch.randint(0, 2, (n,), generator=gen).to(torch.float32).mul_(2).sub_(1)
    offsets = torch.zeros(rank + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(bucket, minlength=rank), 0, out=offsets[1:])
    return SketchPlan(rank, bucket, signs, torch.argsort(bucket, stable=True), offsets)
