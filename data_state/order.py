"""Sample order: a keyed pseudo-random permutation of [0, n) per (seed, epoch), in O(1) memory.

Contract: `Permutation(n, seed=s, epoch=e)` is a bijection of [0, n) that depends only on
`(n, s, e)` — not on the platform, the Python version or the number of workers.
`perm(positions)` maps positions (an int or an integer array) to sample indices; nothing of
size n is ever built, so shuffling billions of sequences costs a few integer operations per
sample drawn.

How: a balanced Feistel network over 2k bits (the smallest even bit width whose domain
4^(k) covers n) is a bijection of [0, 4^k) whatever its round function. Cycle walking turns it
into a bijection of [0, n): a value that lands at or beyond n is encrypted again until it falls
inside. Since 4^k < 4n, a value takes fewer than 4 passes on average. The round function is
the splitmix64 finaliser of the right half mixed with a per-round key; keys come from BLAKE2b
of `(seed, epoch, round)`, so they are stable across machines (Python's `hash()` is not).
Six rounds: four already make a Feistel network a strong pseudo-random permutation when the
round function is pseudo-random (Luby–Rackoff); two more are cheap insurance for a fast,
non-cryptographic round function. The permutation is statistically well mixed, not
cryptographically secret.
"""

from __future__ import annotations

import hashlib

import numpy as np

ROUNDS = 6
MAX_N = 1 << 62  # 2k <= 62 bits keeps every intermediate inside uint64 arithmetic

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


class Permutation:
    """A bijection of [0, n) keyed by `(seed, epoch)`; see the module docstring."""

    def __init__(self, n: int, *, seed: int, epoch: int) -> None:
        if not 1 <= n <= MAX_N:
            raise ValueError(f"permutation size n must be in [1, 2**62], got {n}")
        for name, value in (("seed", seed), ("epoch", epoch)):
            if not 0 <= value < 1 << 63:
                raise ValueError(f"{name} must be in [0, 2**63), got {value}")
        self.n, self.seed, self.epoch = n, seed, epoch
        # Half width k: the domain 4**k is the smallest power of four >= n (k >= 1).
        self._half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
        self._mask = np.uint64((1 << self._half_bits) - 1)
        digest = hashlib.blake2b(
            f"baton.order/1:{seed}:{epoch}".encode(), digest_size=8 * ROUNDS
        ).digest()
        self._keys = np.frombuffer(digest, dtype="<u8").astype(np.uint64)

    def __call__(self, positions: int | np.ndarray) -> int | np.ndarray:
        scalar = np.ndim(positions) == 0
        x = np.atleast_1d(np.asarray(positions, dtype=np.int64))
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise ValueError(
                f"positions must be in [0, {self.n}), got range [{x.min()}, {x.max()}]"
            )
        y = self._encrypt(x.astype(np.uint64))
        outside = y >= np.uint64(self.n)
        while outside.any():  # cycle walking; terminates because the Feistel map is a bijection
            y[outside] = self._encrypt(y[outside])
            outside = y >= np.uint64(self.n)
        out = y.astype(np.int64)
        return int(out[0]) if scalar else out

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self._half_bits)
        left, right = x >> shift, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << shift) | right


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast bijective 64-bit mixer (uint64 arithmetic wraps)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))
