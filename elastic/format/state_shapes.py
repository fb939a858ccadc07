"""The shapes an optimizer's per-parameter state may have, torch-free: one rule for the
PyTorch restore (``elastic.state.skeleton_check.SkeletonCheck.state_shapes``) and the neutral
reader (``elastic.portable.Snapshot.check_optimizer_shapes``).

Contract
--------
``check_state_shapes(where, saved, params, shapes, path, optimizer="")`` raises
``SnapshotMisfitError`` — one line: ``<where>: state <path>.state.<fqn>.<name>: a tensor of
shape [...] for a parameter of shape [...] (<why>); the snapshot does not fit the registered
component`` — for the first tensor of ``saved`` (an optimizer's state dict skeleton:
``{"state": {fqn: {name: {"__tensor__": key} | scalar}}, ...}``, untrusted) whose shape
(``shapes[key]``) torch's ``optimizer`` (its class name) would not give it for the parameter
of shape ``params[fqn]``:

* ``step`` is a scalar; the scalars an optimizer keeps by name (NAdam's ``mu_product``,
  ASGD's ``eta`` and ``mu``) are scalars;
* any other tensor has exactly the parameter's shape for torch.optim's per-element
  optimizers (``EXACT``: Adam's, AdamW's moments, SGD's momentum, ...);
* an optimizer that factors (``FACTORED``: Adafactor) keeps row and column variances of the
  parameter's rank, each size the parameter's or 1;
* an optimizer not named keeps the looser rule (a scalar, or the parameter's rank with each
  size the parameter's or 1): doubt never refuses.

Entries that name no parameter of ``params``, or that are not tensors, are left to the
caller's other checks. A fresh optimizer adopts saved state as it is: a crafted shape would
load, then fail at the first optimizer step, or broadcast (a ``step`` of shape [1] trained on
and was saved so). Imports the error vocabulary and the records' tags only: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from elastic.errors import SnapshotMisfitError
from elastic.format.records import TENSOR_TAG

# Per-parameter state torch.optim keeps as scalars besides ``step``, by optimizer class name.
SCALAR_STATE = {"NAdam": ("mu_product",), "ASGD": ("eta", "mu")}
# Optimizers whose state factors a parameter's shape (sizes of 1 where it sums a dimension).
FACTORED = ("Adafactor",)
# torch.optim's per-element optimizers whose every other state tensor has the parameter's
# exact shape (Adam's, AdamW's moments, SGD's momentum buffer, ...).
EXACT = ("Adam", "AdamW", "SGD", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam",
         "RMSprop", "Rprop", "SparseAdam")


def check_state_shapes(where: str, saved: Any, params: Mapping[str, tuple[int, ...]],
                       shapes: Mapping[str, tuple[int, ...]], path: str,
                       optimizer: str = "") -> None:
    """Refuse the first state tensor of a shape ``optimizer`` would not give it (contract)."""
    state = saved.get("state") if isinstance(saved, dict) else None
    for fqn, entry in state.items() if isinstance(state, dict) else ():
        param = params.get(fqn)
        if param is None or not isinstance(entry, dict):
            continue  # not a live parameter's: the caller's other checks refuse it
        for name, ref in entry.items():
            tensor = ref.get(TENSOR_TAG) if isinstance(ref, dict) else None
            shape = shapes.get(tensor) if isinstance(tensor, str) else None
            if shape is None:
                continue  # not a tensor
            why = allowed_shape(optimizer, name, shape, param)
            if why:
                raise SnapshotMisfitError(
                    f"{where}: state {path}.state.{fqn}.{name}: a tensor of shape "
                    f"{list(shape)} for a parameter of shape {list(param)} ({why}); the "
                    "snapshot does not fit the registered component")


def allowed_shape(optimizer: str, name: str, shape: tuple[int, ...],
                  param: tuple[int, ...]) -> str:
    """Why ``optimizer``'s state ``name`` cannot have ``shape`` for a parameter of shape
    ``param`` ("" when it can)."""
    if name == "step":
        return "" if shape == () else "step is a scalar"
    if shape == () and (name in SCALAR_STATE.get(optimizer, ()) or optimizer not in EXACT
                        and optimizer not in FACTORED):
        return ""
    if optimizer in EXACT:
        return "" if shape == param else f"{optimizer} keeps it in the parameter's shape"
    factored = len(shape) == len(param) and all(
        size in (want, 1) for size, want in zip(shape, param, strict=True))
    return "" if factored else "each size must be the parameter's or 1"
