"""Baton's AdamW step as an optax transformation, and the optax state filled from a snapshot.

Contract
--------
``baton_adamw(settings, mask)`` is ``optax.chain(torch_clip_by_global_norm(grad_clip),
optax.adamw(schedule, b1, b2, eps, weight_decay, mask))`` (no clip when ``grad_clip`` is 0),
the update a Baton run makes with ``torch.optim.AdamW`` after
``torch.nn.utils.clip_grad_norm_``. Why the two agree (fp32, up to rounding):

* both increment the step before bias correction; torch's
  ``p(1 - lr wd) - lr/(1 - b1^t) m / (sqrt(v)/sqrt(1 - b2^t) + eps)`` is optax's
  ``p - lr (m_hat / (sqrt(v_hat) + eps) + wd p)`` with ``eps_root = 0``: eps added after the
  square root of the *bias-corrected* second moment in both, weight decay decoupled and
  multiplied by the learning rate, applied to the parameter before this step's update;
* moments: ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2`` (torch's ``lerp`` is the same
  sum);
* clipping: torch scales every gradient by ``min(1, max_norm / (norm + 1e-6))`` with the
  global L2 norm; ``optax.clip_by_global_norm`` has no ``1e-6`` and only scales above the
  bound, hence ``torch_clip_by_global_norm``;
* the learning rate of update ``t`` (0-based) is ``trainer.train.optim.lr_at(cfg, steps, t)``,
  computed by Baton's own function into a table (``AdamWSettings.lrs``) that the optax
  schedule indexes with its ``count`` (clamped to the table's end, where every schedule is
  flat); torch's ``LrSchedule`` sets the same value before the update.

``set_adam_state(opt_state, count, mu, nu)`` returns the state with ``count`` (the number of
completed updates: the snapshot's step) in every ``ScaleByAdamState`` and
``ScaleByScheduleState`` and the moments in the former; ``adam_state(opt_state)`` finds the
``ScaleByAdamState``; ``counts(opt_state)`` lists the count of each of those states (the
writer checks that they all equal the step). The weight-decay ``mask`` is a tree of bools
shaped like the params.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

_TORCH_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ divides by (norm + 1e-6)


@dataclass(frozen=True)
class AdamWSettings:
    """The AdamW hyperparameters of a run and its learning rate per update."""

    b1: float
    b2: float
    eps: float
    weight_decay: float
    grad_clip: float  # 0: no clipping
    lrs: tuple[float, ...]  # lr of update t (0-based), t = 0 .. len - 1; flat afterwards

    def lr(self, step: int) -> float:
        return self.lrs[min(step, len(self.lrs) - 1)]


def torch_clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``torch.nn.utils.clip_grad_norm_``'s scaling (module contract)."""

    def init(params: Any) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update(updates: Any, state: optax.EmptyState, params: Any = None
               ) -> tuple[Any, optax.EmptyState]:
        del params
        coef = jnp.minimum(max_norm / (optax.tree.norm(updates) + _TORCH_CLIP_EPS), 1.0)
        return jax.tree.map(lambda g: g * coef, updates), state

    return optax.GradientTransformation(init, update)


def schedule(settings: AdamWSettings) -> Callable[[jax.Array], jax.Array]:
    """The learning rate of update ``count`` (Baton's values, from the table)."""
    table = jnp.asarray(np.asarray(settings.lrs, dtype=np.float32))
    return lambda count: table[jnp.minimum(count, table.shape[0] - 1)]


def baton_adamw(settings: AdamWSettings, mask: Any) -> optax.GradientTransformation:
    """Baton's clip + AdamW + schedule as one optax transformation (module contract)."""
    adamw = optax.adamw(schedule(settings), b1=settings.b1, b2=settings.b2, eps=settings.eps,
                        eps_root=0.0, weight_decay=settings.weight_decay, mask=mask)
    if settings.grad_clip <= 0:
        return adamw
    return optax.chain(torch_clip_by_global_norm(settings.grad_clip), adamw)


def set_adam_state(opt_state: Any, count: int, mu: Any, nu: Any) -> Any:
    """``opt_state`` with the step count and both moments set (module contract)."""
    step = jnp.asarray(count, dtype=jnp.int32)

    def visit(node: Any) -> Any:
        if isinstance(node, optax.ScaleByAdamState):
            return node._replace(count=step, mu=mu, nu=nu)
        if isinstance(node, optax.ScaleByScheduleState):
            return node._replace(count=step)
        if hasattr(node, "_fields"):  # another optax state (a NamedTuple): look inside
            return node._replace(**{f: visit(getattr(node, f)) for f in node._fields})
        if isinstance(node, tuple):
            return tuple(visit(n) for n in node)
        return node

    return visit(opt_state)


def counts(opt_state: Any) -> list[int]:
    """The ``count`` of every ``ScaleByAdamState`` and ``ScaleByScheduleState`` inside."""
    found: list[int] = []

    def visit(node: Any) -> None:
        if isinstance(node, (optax.ScaleByAdamState, optax.ScaleByScheduleState)):
            found.append(int(np.asarray(node.count)))
        elif hasattr(node, "_fields"):
            for name in node._fields:
                visit(getattr(node, name))
        elif isinstance(node, tuple):
            for child in node:
                visit(child)

    visit(opt_state)
    return found


def adam_state(opt_state: Any) -> optax.ScaleByAdamState:
    """The ``ScaleByAdamState`` inside ``opt_state`` (``ValueError`` when there is none)."""
    if isinstance(opt_state, optax.ScaleByAdamState):
        return opt_state
    children = ([getattr(opt_state, f) for f in opt_state._fields]
                if hasattr(opt_state, "_fields") else
                list(opt_state) if isinstance(opt_state, tuple) else [])
    for child in children:
        try:
            return adam_state(child)
        except ValueError:
            continue
    raise ValueError("the optax state holds no ScaleByAdamState: build it with baton_adamw")
