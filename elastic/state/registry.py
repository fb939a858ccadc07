"""The state registry: every stateful component of a run, under one fixed key each.

The trainer registers each component once (``registry.register("model", model)``; ``optim``
bound to the registered model, ``sched``, ``data``, any extra key). Models and optimizers are
seen as ``torch.distributed.checkpoint.state_dict`` sees them (``elastic.state.module_state``):
optimizer state keyed by parameter FQN, never by position, FSDP2 parameters as DTensors (local
shards). Any other ``state_dict()`` is a tree of dicts, lists, tuples, JSON scalars and tensors.

``flatten()`` gives (a) a flat ``{name: tensor}`` map, names ``"<key>.<path>"`` (e.g.
``optim.state.blocks.0.attn.weight.exp_avg``), and (b) one JSON *skeleton* per key with each
tensor replaced by ``{"__tensor__": name}``; ``load(tensors, skeletons)`` is the inverse. Plain
(non-DTensor) tensors are replicated: a per-rank tensor state means nothing at another size.

Skeletons read from a snapshot are untrusted (P8). ``check_state(skeletons)`` compares each
component's snapshot skeleton with its live ``state_dict()``'s before anything is loaded and
raises ``SnapshotMisfitError`` naming the component and path (``data.epoch: expected int, got
str``) unless: objects (and optimizer param groups) have the same keys; leaves the same JSON
type (an int may stand for a float; anything where the live value is null, and in
``param_groups`` a null for any scalar); tuples the live length, list elements compared in
turn (past the live end, with its last: lists may grow); tensor references where the live state
has a tensor, same name; ``param_groups[*].params`` name live parameters; optimizer tensors the
shapes it gives them (``elastic.state.skeleton_check``: ``step`` a scalar, the parameter's
shape, sizes of 1 only for a factored optimizer).

Rules: what only the trainer knows (its step, counts, schedule and cursor tell one story) is a
``SnapshotRule`` (``add_rule``). Restore reads the scalars they need (``rule_scalars``,
verified) and runs ``check_rules`` before writing a live byte; a rule's ``ValueError`` is a
``SnapshotMisfitError``. ``load`` calls each rule's ``loaded()`` at the end. A snapshot lacking a
registered component raises ``SnapshotMismatchError`` unless it was registered ``optional=True``
(it keeps its fresh state); a component nothing registered is ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from elastic.errors import ManifestError, SnapshotMisfitError
from elastic.format import ITEMS_TAG, TENSOR_TAG, TUPLE_TAG, short_repr
from elastic.state.module_state import ModelState, OptimizerState
from elastic.state.skeleton_check import SkeletonCheck


class SnapshotMismatchError(ValueError):
    """The snapshot holds a different model (or set of components) than the one registered."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class SnapshotRule(Protocol):
    """A check of a snapshot's whole state that no component can make alone (module
    contract, "Rules")."""

    def scalars(self, skeletons: Mapping[str, Any]) -> list[str]:
        """The scalar tensors (by snapshot key) whose values ``check`` needs."""
        ...

    def check(self, skeletons: Mapping[str, Any], scalars: Mapping[str, float]) -> None:
        """Raise ``ValueError`` (one line naming the field) unless the state holds."""
        ...

    def loaded(self) -> None:
        """Called once a snapshot was loaded into every component."""
        ...


@dataclass
class FlatState:
    tensors: dict[str, torch.Tensor]
    skeletons: dict[str, Any]


class StateRegistry:
    def __init__(self) -> None:
        self._components: dict[str, Stateful] = {}
        self._optional: set[str] = set()
        self._model: nn.Module | None = None
        self._rules: list[SnapshotRule] = []

    def register(self, key: str, obj: Any, *, model: nn.Module | None = None,
                 optional: bool = False) -> None:
        """Register ``obj`` under ``key``. An optimizer is bound to ``model`` or, by
        default, to the module registered earlier. An ``optional`` component may be absent
        from a snapshot (it then keeps its state); it must hold no tensors."""
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
        if optional:
            self._optional.add(key)

    def add_rule(self, rule: SnapshotRule) -> None:
        """Check every snapshot's state with ``rule`` before it is restored (module
        contract, "Rules")."""
        self._rules.append(rule)

    def rule_scalars(self, skeletons: Mapping[str, Any]) -> list[str]:
        """The scalar tensors the rules need, in the order they name them (no repeats)."""
        names: dict[str, None] = {}
        for rule in self._rules:
            names.update(dict.fromkeys(rule.scalars(skeletons)))
        return list(names)

    def check_rules(self, skeletons: Mapping[str, Any], scalars: Mapping[str, float],
                    where: str = "snapshot") -> None:
        """Every rule on ``skeletons`` and the values of ``scalars``; the first that fails
        is ``SnapshotMisfitError`` naming ``where`` and the rule's one line."""
        for rule in self._rules:
            try:
                rule.check(skeletons, scalars)
            except ValueError as err:
                raise SnapshotMisfitError(f"{where}: {err}") from err

    def keys(self) -> list[str]:
        return list(self._components)

    def model_keys(self) -> list[str]:
        """Keys of models and optimizers: state that only ``optimizer.step()`` mutates."""
        return [k for k, c in self._components.items()
                if isinstance(c, (ModelState, OptimizerState))]

    def module_keys(self) -> list[str]:
        """Keys of registered models (their tensors must match the snapshot's exactly)."""
        return [k for k, c in self._components.items() if isinstance(c, ModelState)]

    def components(self) -> dict[str, Any]:
        """Key -> the registered component (models and optimizers as their
        ``module_state`` views, ``.model`` / ``.optimizer``), in registration order."""
        return dict(self._components)

    def modules(self) -> list[nn.Module]:
        return [c.model for c in self._components.values() if isinstance(c, ModelState)]

    def flatten(self, keys: list[str] | None = None) -> FlatState:
        tensors: dict[str, torch.Tensor] = {}
        skeletons = {key: encode_tree(comp.state_dict(), key, tensors)
                     for key, comp in self._components.items() if keys is None or key in keys}
        return FlatState(tensors=tensors, skeletons=skeletons)

    def load(self, tensors: Mapping[str, torch.Tensor], skeletons: Mapping[str, Any],
             where: str = "snapshot", *, checked: bool = False) -> None:
        """Load every component from ``skeletons`` (tensors resolved from ``tensors``), after
        checking all of them: nothing is loaded unless everything fits. ``checked``: the
        caller ran ``check_state(skeletons)`` itself and nothing changed the registry since
        (a restore checks before it reads; checking again would flatten the state again)."""
        if not checked:
            self.check_state(skeletons, where,
                             shapes={name: tuple(t.shape) for name, t in tensors.items()})
        present = [key for key in self._components if key in skeletons]  # optional: absent
        for key in present:
            for path, name in _tensor_refs(skeletons[key], key):
                if not isinstance(name, str) or name not in tensors:
                    raise ManifestError(f"{where}: state {path}: tensor {short_repr(name)} was "
                                        "not read from the snapshot")
        for key in present:
            self._components[key].load_state_dict(decode_tree(skeletons[key], tensors))
        for rule in self._rules:
            rule.loaded()

    def check_state(self, skeletons: Mapping[str, Any], where: str = "snapshot",
                    live: Mapping[str, Any] | None = None,
                    shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
        """Raise unless each component's snapshot skeleton fits its live state (see the
        module contract); ``where`` names the snapshot in the message. ``live``: the
        registry's own skeletons when the caller has just flattened it (``flatten()``
        calls every component's state_dict, DCP's included: tens of ms per call).
        ``shapes``: the saved tensors' global shapes (a manifest's), to check the
        optimizers' state against their parameters (``SkeletonCheck.state_shapes``)."""
        missing = [k for k in self._components if k not in skeletons and k not in self._optional]
        if missing:
            raise SnapshotMismatchError(
                f"{where} has no state for registered component(s) {missing}; it was saved "
                f"with components {sorted(skeletons)}"
            )
        if live is None:
            live = self.flatten().skeletons
        for key, comp in self._components.items():
            if key not in skeletons:
                continue  # optional, and not in this snapshot
            checker = SkeletonCheck(where)
            if isinstance(comp, OptimizerState):
                checker.optimizer(live[key], skeletons[key], key)
                params = comp.parameter_shapes()
                if shapes is not None and params is not None:
                    checker.state_shapes(skeletons[key], params, shapes, key,
                                         type(comp.optimizer).__name__)
            else:
                checker.compare(live[key], skeletons[key], key)


def _tensor_refs(value: Any, path: str) -> list[tuple[str, str]]:
    """(path, name) of every tensor reference in a skeleton, iteratively (no deep recursion
    on untrusted input)."""
    out: list[tuple[str, str]] = []
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            if TENSOR_TAG in node:
                out.append((where, node[TENSOR_TAG]))
            else:
                stack.extend((v, f"{where}.{k}") for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(node))
    return out


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
        return {ITEMS_TAG: [[encode_tree(k, f"{path}.key{i}", tensors),
                              encode_tree(v, f"{path}.{k}", tensors)]
                             for i, (k, v) in enumerate(value.items())]}
    if isinstance(value, tuple):
        return {TUPLE_TAG: [encode_tree(v, f"{path}.{i}", tensors) for i, v in enumerate(value)]}
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
        if TUPLE_TAG in value:
            return tuple(decode_tree(v, tensors) for v in value[TUPLE_TAG])
        if ITEMS_TAG in value:
            return {decode_tree(k, tensors): decode_tree(v, tensors)
                    for k, v in value[ITEMS_TAG]}
        return {k: decode_tree(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_tree(v, tensors) for v in value]
    return value
