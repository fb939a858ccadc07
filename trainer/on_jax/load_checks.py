"""What ``load_train_state`` reads out of a snapshot and ``run.json``, and checks first.

Contract
--------
Each function takes the snapshot (``elastic.portable.Snapshot``) or its parts and ``where``
(the run and snapshot, for messages) and raises ``ValueError`` in one line naming the field
and the fix; nothing here writes.

* ``trainer_step(snap, where)``: ``trainer.step``, a step number that ``sched.step`` equals
  (the snapshot has the ``trainer``, ``sched`` and ``data`` components of Baton's loop).
* ``adamw_settings(config, optim, step, where)``: the run's AdamW as ``AdamWSettings`` —
  betas, eps and weight decay from the snapshot's param groups (what torch's
  ``load_state_dict`` gives a PyTorch session; for a Baton run, the recipe's), the schedule
  and ``grad_clip`` from the recipe (``trainer.train.optim.lr_at``). Refused: another
  optimizer or a factory, groups that differ in betas/eps/amsgrad/maximize or hold two
  weight decays, amsgrad or maximize.
* ``moments(optim, model, step, where, tied)``: ``exp_avg`` / ``exp_avg_sq`` per parameter;
  every parameter but the ``tied`` aliases (which the optimizer never sees) has state, each
  updated ``step`` times (optax keeps one count).
* ``module_shapes(module, params, where)``: each Flax parameter has the shape the module
  declares (``jax.eval_shape`` of its ``init`` on a 1 x 2 batch of token ids): a snapshot's
  tensor of another shape is refused here, not at the first ``apply``.
* ``data_batches(config, skeleton)``: the global batch and microbatch size of the JAX steps:
  the global batch the snapshot's session trained with (its ``data_origin``: a run may change
  ``data.global_batch`` between sessions, ``run.json`` holds the first session's recipe),
  else the recipe's; the recipe's microbatch size where it divides it, else their gcd.
* ``warn_sketched(config, where)``: a run whose recipe sketches (BASIS: ``[sketch] rank`` or
  ``memory_budget_mib``) continues here with exact gradients; said once per load, as a
  ``SketchNotCarriedWarning``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from elastic.portable import Snapshot
from trainer.config import OptimConfig
from trainer.on_jax.optim import AdamWSettings
from trainer.train import ORIGIN_KEY, lr_at

MOMENTS = ("exp_avg", "exp_avg_sq")


class SketchNotCarriedWarning(UserWarning):
    """A run trained with BASIS sketches continues in JAX with exact gradients."""


def trainer_step(snap: Snapshot, where: str) -> int:
    for comp in ("trainer", "sched", "data"):
        if comp not in snap.state:
            raise ValueError(f"{where}: no {comp!r} component; not a snapshot of a Baton "
                             "training loop (trainer.Session)")
    step = snap.state["trainer"].get("step")
    if snap.state["sched"].get("step") != step:
        raise ValueError(f"{where}: field sched.step is {snap.state['sched'].get('step')!r}, "
                         f"trainer.step {step!r}; the schedule must be at the step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"{where}: field trainer.step is {step!r}, not a step number")
    return step


def adamw_settings(config: dict[str, Any], optim: dict[str, Any], step: int,
                   where: str) -> AdamWSettings:
    """AdamW hyperparameters: param groups (betas, eps, decay) + recipe (schedule, clip)."""
    optim_cfg = OptimConfig(**config.get("optim", {}))
    if optim_cfg.name != "adamw" or config.get("optimizer_factory"):
        raise ValueError(f"{where}: field optim.name is {optim_cfg.name!r} (factory "
                         f"{config.get('optimizer_factory')!r}); only Baton's AdamW maps to "
                         "optax.adamw")
    groups = optim.get("param_groups") or []
    firsts = {(tuple(g["betas"]), g["eps"], bool(g.get("amsgrad")), bool(g.get("maximize")))
              for g in groups}
    decays = {g["weight_decay"] for g in groups if g["weight_decay"] > 0}
    if len(firsts) != 1 or len(decays) > 1:
        raise ValueError(f"{where}: field optim.param_groups: the groups differ in betas, eps, "
                         "amsgrad or weight decay; optax.adamw takes one of each")
    (b1, b2), eps, amsgrad, maximize = firsts.pop()
    if amsgrad or maximize:
        raise ValueError(f"{where}: field optim.param_groups: amsgrad/maximize have no "
                         "optax.adamw equivalent here")
    total = int(config.get("steps", step))
    lrs = tuple(lr_at(optim_cfg, total, t)
                for t in range(max(total, step, optim_cfg.warmup_steps) + 1))
    return AdamWSettings(b1=float(b1), b2=float(b2), eps=float(eps),
                         weight_decay=float(decays.pop()) if decays else 0.0,
                         grad_clip=float(optim_cfg.grad_clip), lrs=lrs)


def moments(optim: dict[str, Any], model: dict[str, Any], step: int, where: str,
            tied: frozenset[str] = frozenset()) -> dict[str, dict[str, np.ndarray]]:
    """exp_avg / exp_avg_sq per parameter; every parameter updated ``step`` times."""
    per_param = optim.get("state", {})
    missing = sorted(set(model) - set(per_param) - tied)
    if missing:
        raise ValueError(f"{where}: parameters {missing[:5]} have no optimizer state (never "
                         "had a gradient); optax keeps one step count for all parameters (an "
                         "alias of another parameter goes in the layout map's tied=)")
    out: dict[str, dict[str, np.ndarray]] = {m: {} for m in MOMENTS}
    for name in sorted(set(model) - tied):
        entry = per_param[name]
        if float(np.asarray(entry["step"])) != step:
            raise ValueError(f"{where}: field optim.state.{name}.step is "
                             f"{float(np.asarray(entry['step']))}, the run is at step {step}; "
                             "optax keeps one step count for all parameters")
        for m in MOMENTS:
            out[m][name] = entry[m]
    return out


def module_shapes(module: nn.Module, params: Any, where: str) -> None:
    """Each leaf of ``params`` has the shape ``module`` declares (contract)."""
    tokens = jnp.zeros((1, 2), dtype=jnp.int32)
    want = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), tokens))["params"]
    got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    expected = dict(jax.tree_util.tree_flatten_with_path(want)[0])
    for path in sorted(set(got) | set(expected), key=str):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if path not in got or path not in expected:
            raise ValueError(f"{where}: Flax parameter {name} is "
                             f"{'missing' if path not in got else 'not in the model'}; the "
                             "layout map does not fit the model")
        if tuple(np.shape(got[path])) != tuple(expected[path].shape):
            raise ValueError(f"{where}: Flax parameter {name} has shape "
                             f"{list(np.shape(got[path]))}, the model declares "
                             f"{list(expected[path].shape)}; the snapshot's tensor does not fit "
                             "the run's model: read an earlier snapshot (step=)")


def data_batches(config: dict[str, Any], skeleton: dict[str, Any]) -> tuple[int, int]:
    """(global batch, microbatch size) of the JAX steps (module contract)."""
    data = config.get("data") or {}
    origin = skeleton.get(ORIGIN_KEY)
    batch = origin.get("global_batch") if isinstance(origin, dict) else None
    if type(batch) is not int or batch < 1:
        batch = int(data["global_batch"])
    micro = int(data.get("microbatch_size") or batch)
    return batch, micro if batch % micro == 0 else math.gcd(batch, micro)


def warn_sketched(config: dict[str, Any], where: str) -> None:
    """Say once that BASIS sketching is not carried (module contract)."""
    sketch = config.get("sketch") or {}
    rank, budget = sketch.get("rank") or 0, sketch.get("memory_budget_mib") or 0
    if rank or budget:
        what = f"rank {rank}" if rank else f"memory_budget_mib {budget}"
        warnings.warn(f"{where}: the run trains with BASIS sketched linear layers ([sketch] "
                      f"{what}); JAX continues it with exact gradients (the same model and "
                      "optimizer, other gradient noise); a PyTorch session sketches again",
                      SketchNotCarriedWarning, stacklevel=3)
