"""What ``save_train_state`` checks before it writes a byte: the state tells one story.

Contract
--------
``Loaded`` is what a ``JaxTrainState`` was loaded from, kept apart from the fields a user
may change: the step, a copy of the snapshot's JSON state, the AdamW settings read then and
each tensor's shape. Each check takes the state, ``where`` (the run and the step, for
messages) and raises ``ValueError`` in one line naming the field and the fix; nothing is
written then.

* ``check_counts(state, where)``: ``state.step`` is an integer past the loaded step, and every
  count optax keeps (``ScaleByAdamState``, ``ScaleByScheduleState``) equals it.
* ``jax_origin(state)``: where the JAX steps started — the loaded step and data cursor, at
  the state's global batch (``state.global_batch``; ``drop_last``, as Baton's loaders) — the
  ``data_origin`` (``trainer.train.story``) of the snapshot it writes.
* ``check_story(state, skeleton, dataset, where)``: the trainer's own rule
  (``trainer.train.story.StoryRule``, the one the PyTorch restore applies, not a second
  copy of it) on the state to write, with ``jax_origin`` as its data origin: the cursor
  (``state.data``) fits the dataset and seed, and is exactly where ``state.step`` minus the
  loaded step steps of ``state.global_batch`` lead from the loaded cursor, epochs included.
  A cursor not handed back (``state.data = loader.state_dict()`` forgotten) or a step moved
  ahead of the updates made is refused here.
* ``check_optimizer(state, skeleton, where)`` (``check_settings`` its first half, before the
  skeleton is built from the settings): the hyper-parameters are the run's —
  ``state.settings`` as loaded (betas, eps, weight decay, grad clip, learning rates: the
  recipe's), and every param-group field but ``lr`` (set from the schedule) as loaded. A
  PyTorch restore takes the param groups' values over the recipe's, so a changed weight
  decay would train on silently.
* ``check_shapes(state, tensors, where)``: every tensor to write has the shape it was loaded
  with (each moment its parameter's, as the PyTorch restore requires).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from data_state import numpy_loader
from trainer.on_jax.optim import AdamWSettings, counts
from trainer.train import ORIGIN_KEY, StoryRule

_STORY_FIX = ("set state.data = loader.state_dict() after the loop and let state.step count "
              "the updates made (state.train_step adds one each; docs/jax.md)")
_HYPER_FIX = ("put it back to the run's value (as load_train_state gave it): a continued run "
              "trains with its recipe's optimizer, and PyTorch would take the written value "
              "over the recipe's")


class JaxTrainState(Protocol):
    """The fields of ``trainer.on_jax.state.JaxTrainState`` the checks read (that module
    imports this one)."""

    step: Any
    opt_state: Any
    settings: AdamWSettings
    global_batch: int
    microbatch_size: int

    @property
    def loaded(self) -> Loaded: ...


@dataclass(frozen=True)
class Loaded:
    """The snapshot a state was loaded from (module contract)."""

    step: int
    skeleton: dict[str, Any]  # a copy of its JSON state, never handed out
    settings: AdamWSettings
    shapes: dict[str, tuple[int, ...]]  # snapshot key -> shape


def check_counts(state: JaxTrainState, where: str) -> int:
    """``state.step`` as an int, checked against the loaded step and optax's counts."""
    try:
        step = operator.index(state.step)
    except TypeError:
        raise ValueError(f"{where}: field state.step is {state.step!r}, not an integer; it "
                         "counts the updates made") from None
    if step <= state.loaded.step:
        raise ValueError(f"{where}: field state.step is {step}, not past the step it was "
                         f"loaded at ({state.loaded.step}); train a step before saving")
    found = counts(state.opt_state)
    if not found:
        raise ValueError(f"{where}: field state.opt_state holds no optax count; build it with "
                         "trainer.on_jax.optim.baton_adamw (state.tx)")
    wrong = [c for c in found if c != step]
    if wrong:
        raise ValueError(f"{where}: field state.opt_state count is {wrong[0]} but state.step "
                         f"is {step}; both count the updates made: train with "
                         "state.train_step (or state.tx) and leave both as it sets them")
    return step


def jax_origin(state: JaxTrainState) -> dict[str, Any]:
    """The data origin of the JAX steps (module contract)."""
    cursor = state.loaded.skeleton["data"]
    return {"step": state.loaded.step, "epoch": cursor.get("epoch"),
            "samples_consumed": cursor.get("samples_consumed"),
            "global_batch": int(state.global_batch), "drop_last": True}


def check_story(state: JaxTrainState, skeleton: dict[str, Any], dataset: Any,
                where: str) -> None:
    """The trainer's story rule on the state to write (module contract)."""
    try:
        loader = numpy_loader(dataset, state.loaded.skeleton["data"],
                              global_batch=int(state.global_batch),
                              microbatch_size=int(state.microbatch_size))
    except ValueError as err:
        raise ValueError(f"{where}: the data cursor cannot be checked on {dataset!r}: {err}; "
                         "pass the dataset the run trains on (state.loader(dataset))") from None
    try:
        StoryRule({"data": loader}, "trainer", None).check(
            {**skeleton, ORIGIN_KEY: jax_origin(state)}, {})
    except ValueError as err:
        raise ValueError(f"{where}: {err}; {_STORY_FIX}") from None
    finally:
        loader.close()


def check_settings(state: JaxTrainState, where: str) -> None:
    """``state.settings`` are the run's (module contract: ``check_optimizer``)."""
    if not isinstance(state.settings, AdamWSettings):
        raise ValueError(f"{where}: field state.settings is {type(state.settings).__name__}, "
                         "not the AdamWSettings load_train_state gave; put it back")
    for item in dataclasses.fields(AdamWSettings):
        got, want = (getattr(s, item.name) for s in (state.settings, state.loaded.settings))
        if got != want:
            shown = (f"{_brief(got)} but the run's is {_brief(want)}" if item.name != "lrs"
                     else "not the run's schedule (its recipe's lr_at at every step)")
            raise ValueError(f"{where}: field state.settings.{item.name} is {shown}; "
                             f"{_HYPER_FIX}")


def check_optimizer(state: JaxTrainState, skeleton: dict[str, Any], where: str) -> None:
    """The optimizer's hyper-parameters are the run's (module contract)."""
    check_settings(state, where)
    groups = skeleton.get("optim", {}).get("param_groups")
    loaded = state.loaded.skeleton["optim"]["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(loaded):
        raise ValueError(f"{where}: field optim.param_groups is not the {len(loaded)} groups "
                         f"it was loaded with; {_HYPER_FIX}")
    for i, (group, want) in enumerate(zip(groups, loaded, strict=True)):
        if not isinstance(group, dict):
            raise ValueError(f"{where}: field optim.param_groups[{i}] is not a group; "
                             f"{_HYPER_FIX}")
        for key in sorted(set(group) | set(want)):
            if key != "lr" and group.get(key, _ABSENT) != want.get(key, _ABSENT):
                raise ValueError(f"{where}: field optim.param_groups[{i}].{key} is "
                                 f"{_brief(group.get(key, _ABSENT))} but the run's is "
                                 f"{_brief(want.get(key, _ABSENT))}; {_HYPER_FIX}")


def check_shapes(state: JaxTrainState, tensors: dict[str, Any], where: str) -> None:
    """Every tensor has the shape it was loaded with (module contract)."""
    for key, value in sorted(tensors.items()):
        want = state.loaded.shapes.get(key)
        if want is not None and tuple(np.shape(value)) != want:
            raise ValueError(f"{where}: tensor {key} has shape {list(np.shape(value))}, the "
                             f"snapshot it was loaded from has {list(want)}; the layout map's "
                             "to_torch must give back the PyTorch shapes")


class _Absent:
    def __repr__(self) -> str:
        return "absent"


_ABSENT = _Absent()


def _brief(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
