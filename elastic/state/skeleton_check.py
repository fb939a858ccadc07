"""Does a snapshot's JSON state fit a live component? ``SkeletonCheck`` compares the two
skeletons (``elastic.state.registry``'s encoding: JSON with tagged tensor references, tuples
and non-string-keyed items) and raises ``SnapshotMisfitError`` naming the first path that
differs. The snapshot's side is untrusted: its depth is bounded by the JSON reader that
parsed it. Used by ``StateRegistry.check_state``; the rules per component are in the
registry's module docstring."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NoReturn

from elastic.errors import SnapshotMisfitError
from elastic.format import (
    ITEMS_TAG,
    TENSOR_TAG,
    TUPLE_TAG,
    check_state_shapes,
    json_kind,
    short_repr,
)


class SkeletonCheck:
    """Compares a snapshot skeleton with a live one; the first difference is raised."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, path: str, what: str) -> NoReturn:
        raise SnapshotMisfitError(f"{self.where}: state {path}: {what}; the snapshot does not "
                                  "fit the registered component")

    def compare(self, exp: Any, got: Any, path: str, null_ok: bool = False) -> None:
        ek, gk = _node_kind(exp), _node_kind(got)
        if ek == "null":
            return  # the live value does not say what type it takes
        if gk == "null" and null_ok and ek in _SCALARS:
            return
        if ek == "float" and gk == "int":
            return  # JSON writes 2.0 as 2.0, but a hand-written or other writer's 2 is fine
        if ek != gk:
            self.fail(path, f"expected {ek}, got {gk} {short_repr(got)}")
        if ek == "tensor":
            if got[TENSOR_TAG] != exp[TENSOR_TAG]:
                self.fail(path, f"expected tensor {exp[TENSOR_TAG]!r}, got "
                                f"{short_repr(got[TENSOR_TAG])}")
        elif ek == "dict":
            self.same_keys(list(exp), list(got), path)
            for k in exp:
                self.compare(exp[k], got[k], f"{path}.{k}", null_ok)
        elif ek == "items":
            want = {_key_id(k): (k, v) for k, v in exp[ITEMS_TAG]}
            have = {_key_id(k): v for k, v in got[ITEMS_TAG]}
            self.same_keys(list(want), list(have), path)
            for kid, (k, v) in want.items():
                self.compare(v, have[kid], f"{path}[{short_repr(k)}]", null_ok)
        elif ek == "tuple":
            if len(got[TUPLE_TAG]) != len(exp[TUPLE_TAG]):
                self.fail(path, f"expected a tuple of {len(exp[TUPLE_TAG])}, got "
                                f"{len(got[TUPLE_TAG])} items")
            for i, (e, g) in enumerate(zip(exp[TUPLE_TAG], got[TUPLE_TAG], strict=True)):
                self.compare(e, g, f"{path}[{i}]", null_ok)
        elif ek == "list" and exp:
            for i, g in enumerate(got):
                self.compare(exp[min(i, len(exp) - 1)], g, f"{path}[{i}]", null_ok)

    def same_keys(self, exp: list[Any], got: list[Any], path: str) -> None:
        have, want = set(got), set(exp)
        missing = [k for k in exp if k not in have]
        unexpected = [k for k in got if k not in want]
        if missing or unexpected:
            self.fail(path, f"missing key(s) {short_repr(missing)}, unexpected "
                            f"{short_repr(unexpected)}")

    def optimizer(self, exp: Any, got: Any, path: str) -> None:
        """DCP's optimizer state: ``state`` per parameter, for any subset of the live
        parameters (an optimizer has state only for those that had a gradient), each entry
        like a live one; param groups may hold null for any scalar flag, and must name live
        parameters."""
        if _node_kind(exp) != "dict" or _node_kind(got) != "dict":
            self.compare(exp, got, path)  # not DCP's layout: compare it like any state
            return
        self.same_keys(list(exp), list(got), path)
        groups, live = got.get("param_groups"), exp.get("param_groups")
        params = {p for g in live if isinstance(g, dict)
                  for p in g.get("params", []) if isinstance(p, str)} \
            if isinstance(live, list) else set()
        for k in exp:
            if k == "state" and _node_kind(exp[k]) == "dict" and params:
                self.parameter_states(exp[k], got[k], params, f"{path}.state")
            elif k != "param_groups":
                self.compare(exp[k], got[k], f"{path}.{k}")
        if not isinstance(live, list) or not live:
            self.compare(live, groups, f"{path}.param_groups")
            return
        if not isinstance(groups, list):
            self.fail(f"{path}.param_groups", f"expected list, got {_node_kind(groups)}")
        for i, group in enumerate(groups):
            where = f"{path}.param_groups[{i}]"
            self.compare(live[min(i, len(live) - 1)], group, where, null_ok=True)
            for name in group.get("params", []) if isinstance(group, dict) else []:
                if not isinstance(name, str) or name not in params:
                    self.fail(f"{where}.params", f"names parameter {short_repr(name)}, which "
                                                 "the optimizer does not have")

    def state_shapes(self, saved: Any, params: Mapping[str, tuple[int, ...]],
                     shapes: Mapping[str, tuple[int, ...]], path: str,
                     optimizer: str = "") -> None:
        """Each tensor of a parameter's saved state has the shape torch's ``optimizer`` (its
        class name) gives it (``elastic.format.state_shapes``, the rule the neutral reader
        applies too): ``step`` a scalar; the scalars it keeps by name (NAdam's
        ``mu_product``, ASGD's ``eta`` and ``mu``) scalars; any other exactly the parameter's
        shape (Adam's moments), except in an optimizer that factors (Adafactor: its row and
        column variances have the parameter's rank, each size the parameter's or 1). An
        optimizer of torch.optim not named here keeps the looser rule (a scalar, or the
        parameter's rank with each size the parameter's or 1): doubt never refuses. A fresh
        optimizer adopts saved state as it is: a crafted shape would load, then fail at the
        first optimizer step (or, a ``step`` of shape [1], train on and be saved so)."""
        check_state_shapes(self.where, saved, params, shapes, path, optimizer)

    def parameter_states(self, exp: dict[str, Any], got: Any, params: set[str],
                         path: str) -> None:
        """Each saved entry names a live parameter and is a dict like that parameter's
        live entry; where it has none yet (no step ran, or the parameter never had a
        gradient) its kinds are its own (Adafactor keeps other keys for a vector than for a
        matrix), but every tensor it refers to is its own: named by its path, never another
        parameter's state or a model weight."""
        if _node_kind(got) != "dict":
            self.fail(path, f"expected dict, got {_node_kind(got)}")
        for name, entry in got.items():
            where = f"{path}.{name}"
            if name not in params:
                self.fail(where, "names a parameter the optimizer does not have")
            if _node_kind(entry) != "dict":
                self.fail(where, f"expected dict, got {_node_kind(entry)}")
            self.compare(exp[name] if name in exp else _own_refs(entry, where), entry, where)


_SCALARS = ("bool", "int", "float", "str")

def _own_refs(node: Any, path: str) -> Any:
    """``node`` as it stands at ``path``: every tensor reference renamed to where it
    stands, the name ``encode_tree`` gives it."""
    if isinstance(node, dict):
        if TENSOR_TAG in node:
            return {TENSOR_TAG: path}
        if TUPLE_TAG in node and isinstance(node[TUPLE_TAG], list):
            return {TUPLE_TAG: [_own_refs(v, f"{path}.{i}") for i, v in
                                enumerate(node[TUPLE_TAG])]}
        return {k: _own_refs(v, f"{path}.{k}") for k, v in node.items()}
    if isinstance(node, list):
        return [_own_refs(v, f"{path}.{i}") for i, v in enumerate(node)]
    return node


def _node_kind(value: Any) -> str:
    """The kind of a skeleton node: JSON kinds plus the tagged tensor/tuple/items objects."""
    if isinstance(value, dict):
        if TENSOR_TAG in value:
            return "tensor" if isinstance(value[TENSOR_TAG], str) else "malformed tensor"
        if TUPLE_TAG in value:
            return "tuple" if isinstance(value[TUPLE_TAG], list) else "malformed tuple"
        if ITEMS_TAG in value:
            pairs = value[ITEMS_TAG]
            ok = isinstance(pairs, list) and all(isinstance(p, list) and len(p) == 2
                                                 for p in pairs)
            return "items" if ok else "malformed items"
        return "dict"
    return {"object": "dict"}.get(json_kind(value), json_kind(value))


def _key_id(key: Any) -> str:
    # Keys of an items-dict are JSON scalars or tagged tuples; their JSON text identifies them.
    return json.dumps(key, sort_keys=True)
