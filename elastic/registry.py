"""The state registry: every stateful component of a run, under one fixed key each.

Contract
--------
The trainer registers each component once::

    registry = StateRegistry()
    registry.register("model", model)                 # nn.Module (plain, DDP or FSDP2)
    registry.register("optim", optimizer)             # bound to the registered "model"
    registry.register("sched", lr_scheduler)          # anything with state_dict()/load_state_dict()
    registry.register("data", data_cursor)
    registry.register("trainer", trainer_state)       # user extras: any other key

Models and optimizers go through ``torch.distributed.checkpoint.state_dict``
(``get_model_state_dict`` / ``get_optimizer_state_dict`` and the ``set_*`` twins), so
optimizer state is keyed by parameter FQN, never by position, and FSDP2 parameters come out
as DTensors (their local shards). Every other component's ``state_dict()`` must be a tree of
dicts, lists, tuples, str/int/float/bool/None and tensors.

``flatten()`` turns the registry into (a) a flat ``{name: tensor}`` map — names are
``"<key>.<path>"``, e.g. ``model.blocks.0.attn.weight`` or
``optim.state.blocks.0.attn.weight.exp_avg`` — and (b) one JSON *skeleton* per key in which
each tensor is replaced by ``{"__tensor__": name}``. ``load(tensors, skeletons)`` is the
inverse. Plain (non-DTensor) tensors are assumed identical on every rank (replicated): a
per-rank tensor state is not supported because it has no meaning at another world size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

TENSOR_TAG = "__tensor__"
_TUPLE_TAG = "__tuple__"
_ITEMS_TAG = "__items__"  # dicts whose keys are not all strings (e.g. int-keyed)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class ModelState:
    """A model seen through DCP's state-dict API (FQN keys; DTensor shards under FSDP2)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState:
    """An optimizer keyed by parameter FQN (DCP's ``get_optimizer_state_dict``)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


@dataclass
class FlatState:
    tensors: dict[str, torch.Tensor]
    skeletons: dict[str, Any]


class StateRegistry:
    def __init__(self) -> None:
        self._components: dict[str, Stateful] = {}
        self._model: nn.Module | None = None

    def register(self, key: str, obj: Any, *, model: nn.Module | None = None) -> None:
        """Register ``obj`` under ``key``. An optimizer is bound to ``model`` or, by
        default, to the module registered earlier."""
        if not key or "." in key or key.startswith("__"):
            raise ValueError(f"registry key {key!r} must be non-empty, without '.' or '__'")
        if key in self._components:
            raise ValueError(f"registry key {key!r} is already registered; keys are unique")
        if isinstance(obj, nn.Module):
            self._model = obj if self._model is None else self._model
            self._components[key] = ModelState(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            bound = model if model is not None else self._model
            if bound is None:
                raise ValueError(
                    f"optimizer {key!r}: register the model first or pass model=..., so its "
                    "state can be keyed by parameter name"
                )
            self._components[key] = OptimizerState(bound, obj)
        elif callable(getattr(obj, "state_dict", None)) and callable(
            getattr(obj, "load_state_dict", None)
        ):
            self._components[key] = obj
        else:
            raise ValueError(
                f"registry key {key!r}: {type(obj).__name__} has no state_dict()/"
                "load_state_dict(); wrap it in an object that has both"
            )

    def keys(self) -> list[str]:
        return list(self._components)

    def model_keys(self) -> list[str]:
        """Keys of models and optimizers: state that only ``optimizer.step()`` mutates."""
        return [k for k, c in self._components.items()
                if isinstance(c, (ModelState, OptimizerState))]

    def modules(self) -> list[nn.Module]:
        return [c.model for c in self._components.values() if isinstance(c, ModelState)]

    def flatten(self, keys: list[str] | None = None) -> FlatState:
        tensors: dict[str, torch.Tensor] = {}
        skeletons = {key: encode_tree(comp.state_dict(), key, tensors)
                     for key, comp in self._components.items() if keys is None or key in keys}
        return FlatState(tensors=tensors, skeletons=skeletons)

    def load(self, tensors: Mapping[str, torch.Tensor], skeletons: Mapping[str, Any]) -> None:
        missing = [k for k in self._components if k not in skeletons]
        if missing:
            raise ValueError(
                f"snapshot has no state for registered component(s) {missing}; it was saved "
                f"with components {sorted(skeletons)}"
            )
        for key, comp in self._components.items():
            comp.load_state_dict(decode_tree(skeletons[key], tensors))


def encode_tree(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON skeleton of ``value``; tensors go to ``tensors`` under their dotted path."""
    if isinstance(value, torch.Tensor):
        if path in tensors:
            raise ValueError(f"two tensors map to the name {path!r}; rename one of them")
        tensors[path] = value
        return {TENSOR_TAG: path}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: encode_tree(v, f"{path}.{k}", tensors) for k, v in value.items()}
        return {_ITEMS_TAG: [[encode_tree(k, f"{path}.key{i}", tensors),
                              encode_tree(v, f"{path}.{k}", tensors)]
                             for i, (k, v) in enumerate(value.items())]}
    if isinstance(value, tuple):
        return {_TUPLE_TAG: [encode_tree(v, f"{path}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode_tree(v, f"{path}.{i}", tensors) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(
        f"state at {path!r} is a {type(value).__name__}, which a snapshot cannot hold as JSON; "
        "return tensors, numbers, strings, lists or dicts from state_dict()"
    )


def decode_tree(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if TENSOR_TAG in value:
            name = value[TENSOR_TAG]
            if name not in tensors:
                raise ValueError(f"snapshot state refers to tensor {name!r}, which is absent")
            return tensors[name]
        if _TUPLE_TAG in value:
            return tuple(decode_tree(v, tensors) for v in value[_TUPLE_TAG])
        if _ITEMS_TAG in value:
            return {decode_tree(k, tensors): decode_tree(v, tensors)
                    for k, v in value[_ITEMS_TAG]}
        return {k: decode_tree(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_tree(v, tensors) for v in value]
    return value


def skeleton_tensor_names(value: Any) -> list[str]:
    """Every tensor name a skeleton refers to."""
    if isinstance(value, dict):
        if TENSOR_TAG in value:
            return [value[TENSOR_TAG]]
        return [n for v in value.values() for n in skeleton_tensor_names(v)]
    if isinstance(value, list):
        return [n for v in value for n in skeleton_tensor_names(v)]
    return []
