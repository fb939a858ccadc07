"""A Baton snapshot as a JAX/Flax/Optax train state, and back.

Contract
--------
``load_train_state(run_uri, step=None, layout=None)`` reads a committed snapshot of a run
trained with Baton's AdamW (``optim.name = "adamw"``) through ``elastic.portable`` (every byte
verified, the same checks as the PyTorch restore) and returns a ``JaxTrainState``:

* ``params``: the Flax parameter tree (``layout``: a ``LayoutMap``; default the run's model's
  ready map, ``trainer.on_jax.models.for_run``), ``model`` the Flax module that applies them;
* ``tx`` and ``opt_state``: ``baton_adamw`` (``trainer.on_jax.optim``) with ``mu``/``nu`` the
  snapshot's ``exp_avg``/``exp_avg_sq`` through the same map, ``count`` = the step; the
  weight-decay mask is the snapshot's own param groups (those with ``weight_decay > 0``: for a
  built-in optimizer, matrices only); betas, eps and weight decay come from the param groups,
  the schedule and ``grad_clip`` from ``run.json``'s recipe (``trainer.train.optim.lr_at``);
* ``step``, ``data`` (the data cursor, JSON; ``loader()`` gives the numpy loader at it),
  ``seed`` (the run's), ``config`` (the recipe from ``run.json``).

It refuses, in one ``ValueError`` line naming the field and the fix: another optimizer, a
parameter without optimizer state or whose step differs from the run's (optax keeps one
count for all), param groups that disagree on betas or eps, or with two weight decays, a
schedule position other than the step, a run without ``run.json``.

``train_step(tokens)`` makes one update on a global batch ``(global_batch, seq_len)`` (the
mean next-token loss over all its sequences: the mean of the microbatch means a Baton step
takes) and returns the loss; ``save_train_state(run_uri, state)`` commits the state as snapshot
``state.step`` (``elastic.portable.write_snapshot``: lease, new generation, manifest last)
with the JSON skeleton of the snapshot it was loaded from, so a PyTorch run restores it:
parameters and moments mapped back, every parameter's ``step`` = ``state.step``, the schedule
and trainer steps, the data cursor and each param group's lr (``lr_at(step)``, what
``LrSchedule`` sets) updated, and the data origin (``trainer.train.story``: the step and
cursor the JAX steps started from, at the recipe's global batch) where the snapshot has
one. Components it does not know are carried as they were; one that holds tensors is
refused.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from data_state.loader import ResumableLoader
from elastic.format.records import TENSOR_TAG, Manifest
from elastic.portable import PortableRun, Snapshot, write_snapshot
from trainer.config.training import OptimConfig
from trainer.on_jax.layout_map import LayoutMap
from trainer.on_jax.models import for_run
from trainer.on_jax.optim import AdamWSettings, adam_state, baton_adamw, set_adam_state
from trainer.train.optim import lr_at
from trainer.train.story import ORIGIN_KEY

MOMENTS = ("exp_avg", "exp_avg_sq")
_KNOWN = ("model", "optim", "sched", "data", "trainer")


@dataclass
class JaxTrainState:
    """A run's full training state in JAX (module contract)."""

    params: Any
    opt_state: Any
    tx: optax.GradientTransformation
    model: nn.Module
    loss_fn: Callable[[nn.Module, Any, jax.Array], jax.Array]
    step: int
    data: dict[str, Any]
    seed: int
    settings: AdamWSettings
    layout: LayoutMap
    config: dict[str, Any]
    skeleton: dict[str, Any]  # the snapshot's JSON state, written back updated
    dtypes: dict[str, Any] = field(default_factory=dict)  # snapshot key -> numpy dtype
    _step_fn: Any = None

    def loader(self, dataset: Any = None, *, rank: int = 0, world_size: int = 1
               ) -> ResumableLoader:
        """The run's data loader over numpy arrays at ``data`` (``dataset``: default the
        recipe's ``data.uri`` train split)."""
        from data_state.dataset import TokenDataset
        from data_state.numpy_source import numpy_loader

        data_cfg = self.config["data"]
        source = dataset if dataset is not None else TokenDataset(data_cfg["uri"], "train")
        return numpy_loader(source, self.data, global_batch=data_cfg["global_batch"],
                            microbatch_size=data_cfg["microbatch_size"], rank=rank,
                            world_size=world_size)

    def train_step(self, tokens: Any) -> float:
        """One AdamW update on the global batch ``tokens``; returns its mean loss."""
        if self._step_fn is None:
            model, loss_fn, tx = self.model, self.loss_fn, self.tx

            def step(params: Any, opt_state: Any, batch: jax.Array) -> tuple[Any, Any, Any]:
                loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, batch))(params)
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, loss

            self._step_fn = jax.jit(step)
        self.params, self.opt_state, loss = self._step_fn(
            self.params, self.opt_state, jnp.asarray(tokens))
        self.step += 1
        return float(loss)


def load_train_state(run_uri: str, step: int | None = None, layout: LayoutMap | None = None,
                     storage_options: dict[str, Any] | None = None) -> JaxTrainState:
    """The committed snapshot ``step`` (default: newest) as a ``JaxTrainState``."""
    run = PortableRun(run_uri, storage_options)
    snap = run.read(step)
    info = run.run_info()
    where = f"{run.run_uri} snapshot {snap.step}"
    if info is None or not isinstance(info.get("config"), dict):
        raise ValueError(f"{where}: run.json with the recipe is missing or unreadable; the "
                         "schedule and grad_clip are read from it")
    config = info["config"]
    step_now = _trainer_step(snap, where)
    optim = snap.component("optim")
    settings = _settings(config, optim, step_now, snap, where)
    model_tensors = {k[len("model."):]: v for k, v in snap.tensors.items()
                     if k.startswith("model.")}
    moments = _moments(optim, model_tensors, step_now, where)
    chosen = for_run(info, model_tensors)
    layout = layout or chosen.layout
    params = jax.tree.map(jnp.asarray, layout.to_flax(model_tensors))
    mu, nu = (jax.tree.map(jnp.asarray, layout.to_flax(moments[m])) for m in MOMENTS)
    decayed = {n for g in optim["param_groups"] if g["weight_decay"] > 0 for n in g["params"]}
    tx = baton_adamw(settings, layout.decayed(decayed))
    opt_state = set_adam_state(tx.init(params), step_now, mu, nu)
    return JaxTrainState(
        params=params, opt_state=opt_state, tx=tx, model=chosen.module(params),
        loss_fn=chosen.loss_fn, step=step_now, data=dict(snap.state["data"]),
        seed=int(config.get("seed", snap.state["data"].get("seed", 0))), settings=settings,
        layout=layout, config=config, skeleton=snap.state,
        dtypes={k: v.dtype for k, v in snap.tensors.items()})


def _trainer_step(snap: Snapshot, where: str) -> int:
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


def _settings(config: dict[str, Any], optim: dict[str, Any], step: int, snap: Snapshot,
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


def _moments(optim: dict[str, Any], model: dict[str, Any], step: int, where: str
             ) -> dict[str, dict[str, np.ndarray]]:
    """exp_avg / exp_avg_sq per parameter; every parameter updated ``step`` times."""
    per_param = optim.get("state", {})
    missing = sorted(set(model) - set(per_param))
    if missing:
        raise ValueError(f"{where}: parameters {missing[:5]} have no optimizer state (never "
                         "had a gradient); optax keeps one step count for all parameters")
    out: dict[str, dict[str, np.ndarray]] = {m: {} for m in MOMENTS}
    for name in model:
        entry = per_param[name]
        if float(np.asarray(entry["step"])) != step:
            raise ValueError(f"{where}: field optim.state.{name}.step is "
                             f"{float(np.asarray(entry['step']))}, the run is at step {step}; "
                             "optax keeps one step count for all parameters")
        for m in MOMENTS:
            out[m][name] = entry[m]
    return out


def save_train_state(run_uri: str, state: JaxTrainState,
                     storage_options: dict[str, Any] | None = None) -> Manifest:
    """Commit ``state`` as snapshot ``state.step`` of ``run_uri`` (module contract)."""
    adam = adam_state(state.opt_state)
    if int(adam.count) != state.step:
        raise ValueError(f"the optax count is {int(adam.count)} but state.step is "
                         f"{state.step}; train with state.train_step or keep them equal")
    as_np = jax.tree.map(np.asarray, state.params)
    tensors = {f"model.{k}": v for k, v in state.layout.to_torch(as_np).items()}
    for m, tree in zip(MOMENTS, (adam.mu, adam.nu), strict=True):
        for name, value in state.layout.to_torch(jax.tree.map(np.asarray, tree)).items():
            tensors[f"optim.state.{name}.{m}"] = value
    for name in state.layout.torch_names:
        tensors[f"optim.state.{name}.step"] = np.asarray(float(state.step))
    skeleton = _updated_skeleton(state)
    wanted = set(_tensor_refs(skeleton))
    if wanted != set(tensors):
        raise ValueError(f"the state does not fit the snapshot it was loaded from: tensors "
                         f"{sorted(wanted ^ set(tensors))[:5]} differ")
    tensors = {k: np.asarray(v, dtype=state.dtypes.get(k, np.asarray(v).dtype))
               for k, v in tensors.items()}
    return write_snapshot(run_uri, state.step, tensors, skeleton, storage_options=storage_options,
                          versions={"jax": jax.__version__, "optax": optax.__version__})


def _updated_skeleton(state: JaxTrainState) -> dict[str, Any]:
    skeleton = copy.deepcopy(state.skeleton)
    for comp, tree in skeleton.items():
        if comp not in _KNOWN and any(True for _ in _tensor_refs(tree)):
            raise ValueError(f"component {comp!r} holds tensors that the JAX state does not "
                             "carry; it cannot be written back")
    skeleton["trainer"]["step"] = state.step
    skeleton["sched"]["step"] = state.step
    skeleton["data"] = dict(state.data)
    if ORIGIN_KEY in skeleton:  # the steps since the snapshot loaded are JAX's (`loader()`)
        loaded = state.skeleton["data"]
        skeleton[ORIGIN_KEY] = {
            "step": state.skeleton["trainer"]["step"], "epoch": loaded.get("epoch"),
            "samples_consumed": loaded.get("samples_consumed"),
            "global_batch": state.config["data"]["global_batch"], "drop_last": True}
    for group in skeleton["optim"]["param_groups"]:
        group["lr"] = state.settings.lr(state.step)  # what LrSchedule sets at this step
    return skeleton


def _tensor_refs(tree: Any) -> Any:
    if isinstance(tree, dict):
        if TENSOR_TAG in tree:
            yield tree[TENSOR_TAG]
            return
        for value in tree.values():
            yield from _tensor_refs(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from _tensor_refs(value)
