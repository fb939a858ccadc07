"""What the worker loop does with a step whose loss is NaN or Inf.

Contract: `nonfinite_loss(loss_sum, step, skip=...)` is called with a step's loss summed over
all ranks (so every rank decides alike) before the step's optimizer update. It returns
False for a finite loss. For a NaN or an Inf it returns True when `skip` (the recipe's
`optim.skip_nonfinite_loss`: the caller drops the step's gradients, makes no update, and lets
the data and the schedule move on), else raises `FatalRunError` in one line naming the step
(1-based) and the fixes: the run stops before the update, so nothing of that step is ever
committed (the session's snapshots stop at the step before), and no restart repeats it.

Why before the update: an update from a NaN gradient writes NaN into every parameter and
moment it touches; a snapshot taken after it would hold them (the restore refuses such a
snapshot, `elastic.format.finite`, but the run would already have lost its steps since).
"""

from __future__ import annotations

import logging
import math

from elastic.errors import FatalRunError

log = logging.getLogger("baton.train")


def nonfinite_loss(loss_sum: float, step: int, *, skip: bool) -> bool:
    """True: skip step `step`'s (0-based) update; False: a finite loss (module contract)."""
    if math.isfinite(loss_sum):
        return False
    if skip:
        log.warning("step %d: the loss is %s; its update is skipped "
                    "(optim.skip_nonfinite_loss)", step + 1, loss_sum)
        return True
    raise FatalRunError(
        f"step {step + 1}: the loss is {loss_sum} (NaN or Inf), so the run stops before its "
        "update and the step is never committed; lower optim.lr or set optim.grad_clip, or "
        "set optim.skip_nonfinite_loss = true to skip such steps")
