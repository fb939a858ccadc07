"""`SketchPlan`: the sketch S of n rows as tensors, in row form and bucket-major (CSR) form.

The plan is drawn from a seed by `sketch_ops.seeds.make_plan`; the kernels (`reference`,
`kernels`, `dispatch`) only read it. This module imports torch and nothing of `sketch_ops`,
so the kernels can name the type without importing where plans come from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
        return SketchPlan(self.rank, hash_, signs, rows, offsets)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.hash, self.signs, self.rows, self.offsets

    def row_blocks(self, size: int) -> list[SketchPlan]:
        """The same sketch split into blocks of `size` rows (the last may be shorter): block b
        covers rows [b·size, (b+1)·size), renumbered from 0.

        S is linear in the rows, so `S @ mat` is the sum over blocks of `S_b @ mat_b`: a tall
        matrix can be sketched a block at a time. All blocks come from one stable sort on the
        plan's device (no host read): block b's entries are `rows[b·size:(b+1)·size]` of the
        sorted order, since each block holds exactly its own rows.
        """
        n, rank, device = self.num_rows, self.rank, self.rows.device
        if size >= n:
            return [self]
        num_blocks = -(-n // size)
        block_of_entry = torch.div(self.rows, size, rounding_mode="floor")
        # Stable: within a block the entries stay in bucket order, so each block is CSR too.
        block_of_entry, order = torch.sort(block_of_entry, stable=True)
        rows = self.rows[order]
        group = block_of_entry * rank + self.hash[rows]  # (block, bucket), ascending
        rows -= block_of_entry * size
        bounds = torch.searchsorted(
            group, torch.arange(num_blocks * rank + 1, dtype=torch.int64, device=device)
        )
        starts = torch.arange(num_blocks, dtype=torch.int64, device=device) * size
        offsets = bounds.as_strided((num_blocks, rank + 1), (rank, 1)) - starts[:, None]
        return [
            SketchPlan(rank, self.hash[a:b], self.signs[a:b], rows[a:b], offsets[i])
            for i, (a, b) in enumerate((a, min(a + size, n)) for a in range(0, n, size))
        ]
