"""Where BASIS sketches come from: 64-bit seeds and the (hash, signs) plan they expand to.

Contract:
- `derive_seed(seed, step, microbatch, layer_name)` is a pure, platform-independent function
  (blake2b, never Python's salted `hash()`), returning a seed in [0, 2**63).
- `make_plan(n, rank, seed)` expands a seed into the sketch of n rows: the effective rank
  `min(rank, n)` (at least 1), the bucket `hash` of every row, its sign, and the same sketch in
  bucket-major (CSR) form. It is drawn from a CPU `torch.Generator`, so the same seed gives
  bitwise the same sketch on CPU and CUDA; the plan is then moved to the data's device (a few
  n-long integer vectors, cheap next to the n × N data).
- `sketch_seed(seed, step, microbatch)` is a context manager; inside it every sketched layer's
  seed is `derive_seed(seed, step, microbatch, layer name)`. Outside it, `layer_seed` draws a
  fresh seed from torch's global CPU generator, which `torch.utils.checkpoint` saves and
  restores, so a recomputed forward still reproduces its sketch.

Activation checkpointing: a recompute reproduces the forward's sketch when it runs under the
same `sketch_seed` state as the forward (the trainer runs backward inside the context) or when
both run outside any context. If the forward ran inside a context and the backward (with its
recompute) runs after leaving it, the recompute draws a fresh seed: the layer stays correct —
the saved sketch and the seed used in backward come from the same recompute — but the sketch is
no longer the one derived from (seed, step, microbatch, layer).

The active seed is process-global (not thread- or context-local) on purpose: autograd may run
backward, and with it activation-checkpoint recompute, on its own worker threads, which would
not see a thread-local or contextvar value.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

_SEED_MASK = (1 << 63) - 1  # seeds live in int64 tensors, so keep them non-negative


@dataclass(frozen=True)
class SketchSeedState:
    """The (run seed, step, microbatch) that sketches are derived from inside `sketch_seed`."""

    seed: int
    step: int
    microbatch: int


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
    state = SketchSeedState(seed, step, microbatch)
    _active.append(state)
    try:
        yield state
    finally:
        _active.remove(state)


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
        return derive_seed(state.seed, state.step, state.microbatch, layer_name)
    # Fresh randomness from the global CPU generator: checkpoint recompute restores its state.
    return int(torch.randint(0, _SEED_MASK, (), dtype=torch.int64).item())


@dataclass(frozen=True)
class SketchPlan:
    """The sketch S of n rows: row i goes to bucket `hash[i]` with sign `signs[i]`.

    The same sketch also in bucket-major (CSR) form: bucket r holds the rows
    `rows[offsets[r]:offsets[r + 1]]`. The reference multiplies by S as a sparse CSR matrix and
    the kernel sums each bucket's rows without atomics from this form.
    """

    rank: int
    hash: torch.Tensor  # (n,) int64
    signs: torch.Tensor  # (n,) float32, each +1 or -1
    rows: torch.Tensor  # (n,) int64, rows sorted by bucket
    offsets: torch.Tensor  # (rank + 1,) int64, bucket r = rows[offsets[r]:offsets[r + 1]]
    max_bucket: int  # the size of the largest bucket

    @property
    def num_rows(self) -> int:
        return int(self.hash.shape[0])

    def to(self, device: torch.device) -> SketchPlan:
        """The plan on `device`. From the CPU to a GPU the tensors go through pinned memory:
        a copy from pageable memory waits for the GPU's whole queue first (a stream sync per
        tensor, twice per sketched layer and step), one from pinned memory is queued like a
        kernel (torch's caching host allocator keeps the pinned block until it has run)."""
        if self.hash.device == device:
            return self
        pin = device.type == "cuda" and self.hash.device.type == "cpu"
        hash_, signs, rows, offsets = (
            (t.pin_memory() if pin else t).to(device, non_blocking=True) for t in self.tensors()
        )
        return SketchPlan(self.rank, hash_, signs, rows, offsets, self.max_bucket)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.hash, self.signs, self.rows, self.offsets

    def row_block(self, start: int, end: int) -> SketchPlan:
        """The same sketch restricted to rows [start, end), renumbered from 0.

        S is linear in the rows, so `S @ mat` is the sum over blocks [a, b) of
        `S_ab @ mat[a:b]` with `S_ab = row_block(a, b)`: a tall matrix can be sketched a block
        at a time. Call it on a CPU plan (it reads the largest bucket size on the host).
        """
        bucket, signs = self.hash[start:end], self.signs[start:end]
        sizes = torch.bincount(bucket, minlength=self.rank)
        offsets = torch.zeros(self.rank + 1, dtype=torch.int64, device=bucket.device)
        torch.cumsum(sizes, 0, out=offsets[1:])
        rows = torch.argsort(bucket, stable=True)
        max_bucket = int(sizes.max()) if end > start else 0
        return SketchPlan(self.rank, bucket, signs, rows, offsets, max_bucket)


def effective_rank(rank: int, n: int) -> int:
    """R clamped to the number of rows (at least 1, so an empty input still has a shape)."""
    return max(1, min(rank, n))


def make_plan(
    n: int, rank: int, seed: int, *, balanced: bool = True, device: torch.device | None = None
) -> SketchPlan:
    """Expand `seed` into the sketch of n rows (see the module docstring)."""
    rank = effective_rank(rank, n)
    gen = torch.Generator(device="cpu").manual_seed(seed & _SEED_MASK)
    if balanced:
        # Balanced hash: i mod R, with the positions randomly permuted (Algorithm 1 of BASIS):
        # row i takes slot perm[i] of the sequence 0, 1, .., R-1, 0, 1, ...
        perm = torch.randperm(n, generator=gen)
        bucket = perm % rank
        slots = -(-n // rank)
        # Sorting rows by (bucket, slot) is a scatter: the key below is unique per row.
        key = bucket * slots + perm // rank
        by_key = torch.full((rank * slots,), -1, dtype=torch.int64)
        by_key[key] = torch.arange(n)
        rows = by_key[by_key >= 0]
        sizes = (n - torch.arange(rank) + rank - 1) // rank  # count of j < n with j % R == r
    else:
        bucket = torch.randint(0, rank, (n,), generator=gen)
        rows = torch.argsort(bucket, stable=True)
        sizes = torch.bincount(bucket, minlength=rank)
    signs = torch.randint(0, 2, (n,), generator=gen).to(torch.float32).mul_(2).sub_(1)
    offsets = torch.zeros(rank + 1, dtype=torch.int64)
    torch.cumsum(sizes, 0, out=offsets[1:])
    plan = SketchPlan(rank, bucket, signs, rows, offsets, int(sizes.max()) if n else 0)
    return plan if device is None else plan.to(torch.device(device))
