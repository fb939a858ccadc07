"""A Baton snapshot as a JAX/Flax/Optax train state, and back (the guide: docs/jax.md).

``load_train_state(run_uri, step=None, layout=None, *, model=None, loss_fn=None)`` reads a
committed snapshot of a run trained with AdamW (``optim.name = "adamw"``) through
``elastic.portable`` (every byte verified, the PyTorch restore's checks) into a ``JaxTrainState``:
* ``params`` (the Flax tree through ``layout``, a ``LayoutMap``; default the run's ready map,
  ``trainer.on_jax.models.for_run``), ``model`` (default the ready module; None for a user's
  own model until set) and ``loss_fn`` (default the next-token loss);
* ``tx``/``opt_state``: ``baton_adamw`` (``trainer.on_jax.optim``), ``mu``/``nu`` the moments
  through the same map, ``count`` the step; the weight-decay mask, betas, eps and weight decay
  from the snapshot's param groups, the schedule and ``grad_clip`` from ``run.json``'s recipe;
* ``step``, ``data`` (the cursor; ``loader()`` the numpy loader at it), ``global_batch`` and
  ``microbatch_size`` (the snapshot's session), ``seed``, ``config`` (the recipe) and
  ``skeleton`` (the snapshot's JSON state, written back updated).

It refuses in one ``ValueError`` line naming the field and the fix (``load_checks``): another
optimizer; a model without a ready map and no ``layout``; a parameter without optimizer state
(but a declared tied alias) or at another step (optax keeps one count); a moment or parameter of
the wrong shape; param groups that disagree on betas or eps or hold two weight decays; a
schedule position other than the step; no ``run.json``. A sketched (BASIS) run is a warning.

``train_step(tokens)`` makes one update on a global batch ``(global_batch, seq_len)`` (the mean
next-token loss, as a Baton step), returning the loss. ``save_train_state(run_uri, state)``
commits snapshot ``state.step`` (``elastic.portable.write_snapshot``: lease, new generation,
manifest last) on the loaded snapshot's skeleton, so PyTorch restores it: parameters and moments
mapped back; every ``step``, the schedule, trainer steps, cursor, each group's lr (``lr_at``)
and the data origin (``trainer.train.story``) updated; other components carried as they were
(one holding tensors refused). Nothing is written unless the state tells one story
(``save_checks``: counts, cursor by ``StoryRule``, hyper-parameters, shapes): else a one-line
``ValueError`` naming the field and the fix.
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

from data_state import ResumableLoader
from elastic.errors import SnapshotMisfitError
from elastic.format import TENSOR_TAG, Manifest
from elastic.portable import PortableRun, write_snapshot
from trainer.on_jax.layout_map import LayoutMap
from trainer.on_jax.load_checks import (
    MOMENTS,
    adamw_settings,
    data_batches,
    module_shapes,
    trainer_step,
    warn_sketched,
)
from trainer.on_jax.load_checks import moments as read_moments
from trainer.on_jax.models import for_run
from trainer.on_jax.optim import AdamWSettings, adam_state, baton_adamw, set_adam_state
from trainer.on_jax.save_checks import (
    Loaded,
    check_counts,
    check_optimizer,
    check_settings,
    check_shapes,
    check_story,
    jax_origin,
)
from trainer.train import ORIGIN_KEY

_KNOWN = ("model", "optim", "sched", "data", "trainer")

LossFn = Callable[[nn.Module, Any, jax.Array], jax.Array]


@dataclass
class JaxTrainState:
    """A run's full training state in JAX (module contract)."""

    params: Any
    opt_state: Any
    tx: optax.GradientTransformation
    model: nn.Module | None  # None: the user's own model, to set before train_step
    loss_fn: LossFn
    step: int
    data: dict[str, Any]
    seed: int
    settings: AdamWSettings
    layout: LayoutMap
    config: dict[str, Any]
    skeleton: dict[str, Any]  # the snapshot's JSON state, written back updated
    global_batch: int  # sequences per step of the JAX session
    microbatch_size: int
    _loaded: Loaded  # what it was loaded from: the writer's reference
    dtypes: dict[str, Any] = field(default_factory=dict)  # snapshot key -> numpy dtype
    _dataset: Any = None  # the dataset of the last loader(): the writer checks the cursor on it
    _step_fn: Any = None
    _step_key: tuple[int, ...] = ()

    @property
    def loaded(self) -> Loaded:
        return self._loaded

    def loader(self, dataset: Any = None, *, rank: int = 0, world_size: int = 1
               ) -> ResumableLoader:
        """The run's data loader over numpy arrays at ``data`` (``dataset``: default the
        recipe's ``data.uri`` train split), ``global_batch`` sequences a step."""
        from data_state import TokenDataset, numpy_loader

        source = dataset if dataset is not None else TokenDataset(self.config["data"]["uri"],
                                                                  "train")
        self._dataset = source
        return numpy_loader(source, self.data, global_batch=self.global_batch,
                            microbatch_size=self.microbatch_size, rank=rank,
                            world_size=world_size)

    def data_source(self) -> tuple[Any, bool]:
        """The dataset to check the cursor on, and whether it was opened here (to close)."""
        if self._dataset is not None:
            return self._dataset, False
        from data_state import TokenDataset

        uri = self.config["data"]["uri"]
        try:
            return TokenDataset(uri, "train"), True
        except (OSError, ValueError) as err:
            raise ValueError(f"the run's dataset (recipe data.uri {uri!r}) cannot be opened to "
                             f"check the data cursor ({err}); pass the dataset the run trains "
                             "on: state.loader(dataset)") from None

    def train_step(self, tokens: Any) -> float:
        """One AdamW update on the global batch ``tokens``; returns its mean loss."""
        if self.model is None:
            raise ValueError("state.model is None: the run's model is your own; set "
                             "state.model to its Flax module (and state.loss_fn) first")
        key = (id(self.model), id(self.loss_fn), id(self.tx))
        if self._step_fn is None or key != self._step_key:
            model, loss_fn, tx = self.model, self.loss_fn, self.tx

            def step(params: Any, opt_state: Any, batch: jax.Array) -> tuple[Any, Any, Any]:
                loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, batch))(params)
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, loss

            self._step_fn, self._step_key = jax.jit(step), key
        self.params, self.opt_state, loss = self._step_fn(
            self.params, self.opt_state, jnp.asarray(tokens))
        self.step += 1
        return float(loss)


def load_train_state(run_uri: str, step: int | None = None, layout: LayoutMap | None = None,
                     storage_options: dict[str, Any] | None = None, *,
                     model: nn.Module | None = None,
                     loss_fn: LossFn | None = None
                     ) -> JaxTrainState:
    """The committed snapshot ``step`` (default: newest) as a ``JaxTrainState``."""
    run = PortableRun(run_uri, storage_options)
    snap = run.read(step)
    info = run.run_info()
    where = f"{run.run_uri} snapshot {snap.step}"
    if info is None or not isinstance(info.get("config"), dict):
        raise ValueError(f"{where}: run.json with the recipe is missing or unreadable; the "
                         "schedule and grad_clip are read from it")
    config = info["config"]
    step_now = trainer_step(snap, where)
    optim = snap.component("optim")
    settings = adamw_settings(config, optim, step_now, where)
    model_tensors = {k[len("model."):]: v for k, v in snap.tensors.items()
                     if k.startswith("model.")}
    spec = for_run(info, model_tensors, layout)  # the model is named before its state
    try:
        snap.check_optimizer_shapes("optim", "AdamW")
    except SnapshotMisfitError as err:
        raise SnapshotMisfitError(f"{run.run_uri}: {err}; read an earlier snapshot (step=)"
                                  ) from None
    layout = spec.layout
    moments = read_moments(optim, model_tensors, step_now, where, frozenset(layout.tied))
    params = jax.tree.map(jnp.asarray, layout.to_flax(model_tensors))
    mu, nu = (jax.tree.map(jnp.asarray, layout.to_flax(moments[m])) for m in MOMENTS)
    if model is None and spec.module is not None:
        model = spec.module(params)
    if model is not None:
        module_shapes(model, params, where)
    decayed = {n for g in optim["param_groups"] if g["weight_decay"] > 0 for n in g["params"]}
    tx = baton_adamw(settings, layout.decayed(decayed))
    opt_state = set_adam_state(tx.init(params), step_now, mu, nu)
    warn_sketched(config, where)
    global_batch, microbatch_size = data_batches(config, snap.state)
    return JaxTrainState(
        params=params, opt_state=opt_state, tx=tx, model=model,
        loss_fn=loss_fn or spec.loss_fn, step=step_now, data=dict(snap.state["data"]),
        seed=int(config.get("seed", snap.state["data"].get("seed", 0))), settings=settings,
        layout=layout, config=config, skeleton=copy.deepcopy(snap.state),
        global_batch=global_batch, microbatch_size=microbatch_size,
        dtypes={k: v.dtype for k, v in snap.tensors.items()},
        _loaded=Loaded(step=step_now, skeleton=copy.deepcopy(snap.state), settings=settings,
                       shapes={k: tuple(v.shape) for k, v in snap.tensors.items()}))


def save_train_state(run_uri: str, state: JaxTrainState,
                     storage_options: dict[str, Any] | None = None) -> Manifest:
    """Commit ``state`` as snapshot ``state.step`` of ``run_uri`` (module contract)."""
    where = f"{run_uri}: snapshot {state.step!r} not written"
    step = check_counts(state, where)
    check_settings(state, where)  # the written param groups' lr comes from them
    adam = adam_state(state.opt_state)
    as_np = jax.tree.map(np.asarray, state.params)
    tensors = {f"model.{k}": v for k, v in state.layout.to_torch(as_np).items()}
    for m, tree in zip(MOMENTS, (adam.mu, adam.nu), strict=True):
        moments = state.layout.to_torch(jax.tree.map(np.asarray, tree), tied=False)
        for name, value in moments.items():
            tensors[f"optim.state.{name}.{m}"] = value
    for name in state.layout.torch_names:
        tensors[f"optim.state.{name}.step"] = np.asarray(float(step))
    skeleton = _updated_skeleton(state, step)
    wanted = set(_tensor_refs(skeleton))
    if wanted != set(tensors):
        raise ValueError(f"{where}: the state does not fit the snapshot it was loaded from: "
                         f"tensors {sorted(wanted ^ set(tensors))[:5]} differ; use the layout "
                         "map it was loaded with")
    check_shapes(state, tensors, where)
    check_optimizer(state, skeleton, where)
    try:
        dataset, opened = state.data_source()
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    try:
        check_story(state, skeleton, dataset, where)
    finally:
        if opened:
            dataset.close()
    tensors = {k: np.asarray(v, dtype=state.dtypes.get(k, np.asarray(v).dtype))
               for k, v in tensors.items()}
    return write_snapshot(run_uri, step, tensors, skeleton, storage_options=storage_options,
                          versions={"jax": jax.__version__, "optax": optax.__version__})


def _updated_skeleton(state: JaxTrainState, step: int) -> dict[str, Any]:
    skeleton = copy.deepcopy(state.skeleton)
    for comp, tree in skeleton.items():
        if comp not in _KNOWN and any(True for _ in _tensor_refs(tree)):
            raise ValueError(f"component {comp!r} holds tensors that the JAX state does not "
                             "carry; it cannot be written back")
    skeleton["trainer"]["step"] = step
    skeleton["sched"]["step"] = step
    skeleton["data"] = dict(state.data)
    if ORIGIN_KEY in skeleton:  # the steps since the snapshot loaded are JAX's
        skeleton[ORIGIN_KEY] = jax_origin(state)
    for group in skeleton["optim"]["param_groups"]:
        group["lr"] = state.settings.lr(step)  # what LrSchedule sets at this step
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
