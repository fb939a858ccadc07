"""The integer hash that sketch plans are drawn from: the same bits on every device.

Contract: `hash_rows(n, seed, device)` returns `(keys, signs)` for rows 0..n-1:
- `keys` (n,) int64 in [0, 2**32): a bijection of the row index for a fixed seed, so the keys
  are distinct and sorting them scrambles the rows (a random permutation, as `randperm` would);
- `signs` (n,) float32, each +1 or -1.
Both are pure functions of (n, seed), bitwise the same on the CPU (here, numpy uint32)
and on CUDA (one Triton kernel, `kernels.row_keys`; `dispatch.row_keys` chooses), so a
plan costs a handful of launches on the GPU and no host work that grows with n.

The mixer is three rounds of a 32-bit multiply-xorshift bijection (the "lowbias32" constants),
each keyed by a word of blake2b(seed) (`seed_words`), and one more round for the signs. Keying
by a digest, not by the seed's own bits, matters: with raw bits, seeds that differ in their low
bits only would give permutations that are XOR-relabelings of one another (correlated sketches,
which the Monte Carlo error tests catch). Products wrap mod 2**32 (uint32 in numpy and
Triton alike).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

MULTIPLIERS = (0x7FEB352D, 0x846CA68B)  # lowbias32's: odd, so each multiply is a bijection
SIGN_SALT = 0x5BD1E995  # keys the sign round apart from the key rounds


def seed_words(seed: int) -> tuple[int, int, int]:
    """The three 32-bit words that key the rounds: blake2b of the seed (any int, 64 bits used)."""
    digest = hashlib.blake2b((seed & (2**64 - 1)).to_bytes(8, "little"), digest_size=12).digest()
    return tuple(int.from_bytes(digest[i : i + 4], "little") for i in (0, 4, 8))  # type: ignore[return-value]


def mix32(x: np.ndarray) -> np.ndarray:
    """One round of the bijection on uint32 (in place; numpy's uint32 products wrap)."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(MULTIPLIERS[0])
    x ^= x >> np.uint32(15)
    x *= np.uint32(MULTIPLIERS[1])
    x ^= x >> np.uint32(16)
    return x


def hash_rows(n: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(keys, signs)` of rows 0..n-1, computed on the CPU (the reference of the Triton kernel;
    numpy's wrapping uint32 is ~6x faster here than int64 torch ops) and copied to `device`."""
    keys = np.arange(n, dtype=np.uint32)
    for word in seed_words(seed):
        keys ^= np.uint32(word)
        mix32(keys)
    bits = mix32(keys ^ np.uint32(SIGN_SALT)) >> np.uint32(31)  # the top bit: 0 or 1
    signs = 1 - 2 * bits.astype(np.float32)
    return torch.from_numpy(keys.astype(np.int64)).to(device), torch.from_numpy(signs).to(device)
