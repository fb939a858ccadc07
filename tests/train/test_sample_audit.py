"""The data audit's record of a step's samples when a member is lost during the gather
(`trainer.train.parallel.gather_samples`): partial samples are never recorded as the step's."""

from __future__ import annotations

from typing import Any

import torch

from elastic import collectives
from trainer.train.parallel import gather_samples


class _Group:
    """In-process recovery's group as `elastic.collectives` sees it: three ranks, this one
    rank 0; its all-gather fills in what the peers sent, or fails (`ok=False`) after the
    first peer's part arrived, as a gather cut off by a lost member does."""

    rank, world_size, device = 0, 3, torch.device("cpu")

    def __init__(self, peers: list[list[int]], ok: bool) -> None:
        self.peers, self.ok = peers, ok

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> bool:
        outputs[0].copy_(tensor)
        arrived = self.peers if self.ok else self.peers[:1]
        for out, peer in zip(outputs[1:], arrived, strict=False):
            out[: len(peer)] = torch.tensor(peer)
        return self.ok

    def all_reduce(self, tensor: torch.Tensor, op: Any) -> bool:
        return self.ok


def test_a_gather_that_went_through_gives_every_ranks_samples() -> None:
    with collectives.use_group(_Group([[5, 2], [7]], ok=True)):  # type: ignore[arg-type]
        assert gather_samples([0, 3], 2, torch.device("cpu")) == [0, 2, 3, 5, 7]


def test_a_gather_cut_off_by_a_lost_member_gives_nothing_partial() -> None:
    # Before, the step was recorded with ranks 0 and 1's samples only: the audit then found
    # samples never trained although the step (its all-reduces went through) trained them.
    with collectives.use_group(_Group([[5, 2], [7]], ok=False)):  # type: ignore[arg-type]
        assert gather_samples([0, 3], 2, torch.device("cpu")) is None
