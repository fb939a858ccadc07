"""A model and its optimizer as the state registry sees them: state dicts keyed by parameter FQN,
exactly as DCP's state-dict API (``torch.distributed.checkpoint.state_dict``) keys them.

- ``ModelState(model)``: ``state_dict()`` equals ``get_model_state_dict(model)`` (FQN keys;
  FSDP2 parameters as DTensors, their local shards); ``load_state_dict(sd)`` does what
  ``set_model_state_dict(model, sd)`` does (strict), after adopting loaded tensors (below).
- ``OptimizerState(model, optimizer)``: ``state_dict()`` equals
  ``get_optimizer_state_dict(model, optimizer)`` (state and param groups keyed by the FQNs of
  ``model``'s parameters) except that it never steps the optimizer; ``load_state_dict(sd)``
  does what ``set_optimizer_state_dict`` does. A snapshot's ``state`` may name a subset of the
  trainable parameters (only those that had a gradient hold state); the others load without
  state, as in the uninterrupted run.
- ``plain_prefix(model)``: ``"module."`` for a DDP whose module is plain, ``""`` for a plain
  module, None otherwise. *Plain*: no parameter or buffer is a tensor subclass (FSDP2's
  DTensors) and no module renames the state below it (DDP, FSDP1, ``torch.compile``'s
  ``OptimizedModule``, the activation-checkpoint wrapper, DCP's ``_fqn_modifiers``). For a
  plain model both classes compute DCP's result from the module's and optimizer's own state
  dicts, without DCP's per-call cost; any other model goes through DCP. The two paths give
  equal state dicts and load alike (tests/elastic/test_elastic_module_state.py).
- Loading adopts rather than copies where it can: a plain parameter or buffer whose loaded
  tensor has its dtype, device, shape and strides, and whose storage no other live tensor
  shares, takes the loaded tensor's storage (``tensor.data = loaded``; the Parameter, its
  ``requires_grad`` and the optimizer's references stay); the loaded tensor must not be written
  afterwards. Everything else is copied.
- No fake step: DCP makes up an empty optimizer's state with an ``optimizer.step()`` at learning
  rate 0, which on a capture's side thread would deadlock on the capture and zero the learning
  rates. A plain model's ``state_dict()`` is the optimizer's own (empty ``state`` when it has
  none yet); for any other a post-step hook records whether the last step left state, and
  once one has left none (plain SGD) the same. Why and what it saves: docs/design.md, "Module
  state without DCP's per-call cost".
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.distributed.checkpoint.state_dict import (  # _get_fqns: DCP's own parameter names
    StateDictOptions,
    _get_fqns,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

# Modules under which DCP's FQNs differ from the state-dict keys (or state is not plain);
# torch.compile's OptimizedModule too, once torch._dynamo is loaded (importing it costs
# ~0.5 s, and without it no module can be one).
_RENAMING = (DistributedDataParallel, FullyShardedDataParallel, ActivationWrapper)
_DDP_PREFIX = "module."


def plain_prefix(model: nn.Module) -> str | None:
    """The prefix DCP strips from a plain model's state-dict keys; None: not plain (module
    contract)."""
    root = model.module if isinstance(model, DistributedDataParallel) else model
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    renaming = _RENAMING + ((eval_frame.OptimizedModule,) if eval_frame is not None else ())
    for module in root.modules():
        if isinstance(module, renaming) or hasattr(type(module), "_fqn_modifiers"):
            return None
    for tensor in itertools.chain(root.parameters(), root.buffers()):
        if type(tensor) not in (torch.Tensor, nn.Parameter):
            return None
    return _DDP_PREFIX if root is not model else ""


def _fqn_function(model: nn.Module, prefix: str | None) -> Callable[[str], str | None]:
    """name in ``model.named_parameters()`` (or buffers) -> its FQN, None where DCP maps
    it to several (FSDP1's flat parameters); ``prefix`` is ``plain_prefix(model)``."""
    if prefix is not None:
        return lambda name: name[len(prefix):]

    def dcp_fqn(name: str) -> str | None:
        fqns = _get_fqns(model, name)
        return next(iter(fqns)) if len(fqns) == 1 else None
    return dcp_fqn


class ModelState:
    """A model seen through DCP's state-dict API (module contract)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        prefix = plain_prefix(self.model)
        if prefix is None:
            return get_model_state_dict(self.model)
        own = self.model.state_dict()
        return {key[len(prefix):]: value for key, value in own.items()}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        prefix = plain_prefix(self.model)
        adopted = self._adopt(dict(state_dict), prefix)
        if prefix is None:
            set_model_state_dict(self.model, adopted)
        else:  # what DCP calls once it has named the keys
            self.model.load_state_dict({prefix + k: v for k, v in adopted.items()},
                                       strict=True)

    def _adopt(self, state_dict: dict[str, Any], prefix: str | None) -> dict[str, Any]:
        """``state_dict`` with each adopted entry replaced by the live tensor itself (a
        ``copy_`` of a tensor onto itself does nothing)."""
        live = [(name, tensor) for name, tensor in (
            *self.model.named_parameters(remove_duplicate=False),
            *self.model.named_buffers(remove_duplicate=False))
            if type(tensor) in (torch.Tensor, nn.Parameter) and tensor.device.type != "meta"]
        owners: dict[int, set[int]] = {}  # storage address -> ids of live tensors on it
        for _, tensor in live:
            owners.setdefault(tensor.untyped_storage().data_ptr(), set()).add(id(tensor))
        fqn_of = _fqn_function(self.model, prefix)
        for name, tensor in live:
            fqn = fqn_of(name)
            if fqn is None:
                continue
            loaded = state_dict.get(fqn)
            if (type(loaded) is torch.Tensor
                    and loaded.dtype == tensor.dtype and loaded.device == tensor.device
                    and loaded.shape == tensor.shape and loaded.stride() == tensor.stride()
                    and len(owners.get(tensor.untyped_storage().data_ptr(), ())) == 1):
                tensor.data = loaded
                state_dict[fqn] = tensor
        return state_dict


class OptimizerState:
    """An optimizer keyed by parameter FQN (module contract)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self._stateless = False  # a step ran and left no state
        optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self._stateless = not optimizer.state

    def state_dict(self) -> dict[str, Any]:
        # A sharded or wrapped model's state needs DCP (which makes up a state that has none
        # yet with its fake step; see the module docstring).
        stateless = self._stateless and not self.optimizer.state
        prefix = plain_prefix(self.model)
        if stateless or prefix is not None:
            keyed = self._keyed_by_fqn(prefix)
            if keyed is not None:
                return keyed
        return get_optimizer_state_dict(self.model, self.optimizer)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """FQN -> global shape of each parameter, for an optimizer of ``torch.optim`` whose
        state is per element (every one but L-BFGS); None for any other optimizer, whose
        state may take any shape (a preconditioner, flat history vectors)."""
        kind = type(self.optimizer)
        if not kind.__module__.startswith("torch.optim") or kind is torch.optim.LBFGS:
            return None
        fqns = self._parameter_fqns(plain_prefix(self.model))
        return {fqn: tuple(param.shape) for _, param in self.model.named_parameters()
                if (fqn := fqns.get(id(param))) is not None}

    def _parameter_fqns(self, prefix: str | None) -> dict[int, str | None]:
        """id(parameter) -> its FQN, named as DCP names it (the first of tied names)."""
        fqn_of = _fqn_function(self.model, prefix)
        return {id(param): fqn_of(name) for name, param in self.model.named_parameters()}

    def _keyed_by_fqn(self, prefix: str | None) -> dict[str, Any] | None:
        """The optimizer's own state dict with each parameter position replaced by its FQN
        (DCP's layout); None when a parameter has no single FQN (DCP then decides)."""
        saved = self.optimizer.state_dict()  # params as positions over all param groups
        fqns = self._parameter_fqns(prefix)
        fqn_at = [fqns.get(id(p)) for g in self.optimizer.param_groups for p in g["params"]]
        if any(fqn is None for fqn in fqn_at):
            return None
        state = {fqn_at[position]: value for position, value in saved["state"].items()}
        for group in saved["param_groups"]:
            group["params"] = [fqn_at[position] for position in group["params"]]
        return {"state": state, "param_groups": saved["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        prefix = plain_prefix(self.model)
        loadable = self._positional(state_dict, prefix) if prefix is not None else None
        if loadable is None:  # state of a subset of the parameters is a real state (above)
            set_optimizer_state_dict(self.model, self.optimizer, state_dict,
                                     options=StateDictOptions(strict=False))
        else:
            self.optimizer.load_state_dict(loadable)

    def _positional(self, state_dict: dict[str, Any], prefix: str) -> dict[str, Any] | None:
        """What DCP hands ``Optimizer.load_state_dict`` for a plain model, when the snapshot's
        param groups name the live groups' parameters in the same order (its state may hold
        any subset of the trainable ones); None otherwise (DCP then regroups)."""
        groups, state = state_dict.get("param_groups"), state_dict.get("state")
        live = self.optimizer.param_groups
        if not isinstance(groups, list) or not isinstance(state, dict) \
                or len(groups) != len(live):
            return None
        fqns = self._parameter_fqns(prefix)
        trainable: list[str] = []  # in the live groups' order, as DCP builds the state
        for group, live_group in zip(groups, live, strict=True):
            names = [fqns.get(id(p)) for p in live_group["params"]]
            if not isinstance(group, dict) or group.get("params") != names:
                return None
            trainable.extend(n for n, p in zip(names, live_group["params"], strict=True)
                             if p.requires_grad and n is not None)
        # Optimizer.load_state_dict pairs saved and live parameters by position; the FQNs
        # stand for the ids. Like DCP, state of frozen or unknown parameters is left out.
        return {"state": {n: state[n] for n in trainable if n in state},
                "param_groups": groups}
