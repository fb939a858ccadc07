"""Every rank's `data_state.StreamShareLoader` over one feeder, walked step by step: what the
stream tests compare.

`walk(feeder, world, steps, rows, state=None, **settings)` makes one loader per rank (the
feeder's `units` and `fingerprint` unless `settings` give them), restores `state` (through
JSON, as a snapshot holds it) and takes `steps` steps. It returns the rows of each step over
all ranks in rank order (`rows(batch)` lists one rank's), and rank 0's state after them. On
every step it checks that the ranks' rows are the step's `step_samples` and that their loss
weights sum to the world size (their weighted mean losses average to the step's mean).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from data_state import StreamShareLoader


def walk(feeder: Any, world: int, steps: int, rows: Callable[[Any], list[Any]],
         state: dict[str, Any] | None = None, **settings: Any
         ) -> tuple[list[list[Any]], dict[str, Any]]:
    settings = {"units": getattr(feeder, "units", None),
                "fingerprint": getattr(feeder, "fingerprint", None), **settings}
    loaders = [StreamShareLoader(feeder, rank=r, world_size=world, **settings)
               for r in range(world)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(json.loads(json.dumps(state)))
    out = []
    for _ in range(steps):
        shares = [loader.next_step() for loader in loaders]
        step = [row for share in shares if not share.idle for row in rows(share.batch)]
        assert len(step) == shares[0].step_samples
        assert sum(share.weight for share in shares) == pytest.approx(world)
        out.append(step)
        for loader in loaders:
            loader.advance()
    state = loaders[0].state_dict()
    for loader in loaders:
        loader.close()
    return out, state
