"""The registry's model and optimizer state, computed without DCP for a plain or DDP model,
equal DCP's and load alike (elastic/state/module_state.py); wrapped and sharded models go through
DCP."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from elastic.state.module_state import ModelState, OptimizerState, plain_prefix
from elastic.testing import run_group


class _Net(nn.Module):
    """Tied embedding and output, a frozen parameter the optimizer holds, a persistent and a
    non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 16, bias=False)
        self.out.weight = self.embed.weight
        self.gain = nn.Parameter(torch.ones(8), requires_grad=False)
        self.register_buffer("counts", torch.zeros(3))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mid(self.embed(x)) * self.gain)


def _build(seed: int) -> tuple[_Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = _Net()
    optim = torch.optim.AdamW([
        {"params": [net.mid.weight, net.embed.weight]},
        {"params": [net.mid.bias, net.gain], "weight_decay": 0.0},
    ], lr=1e-2)
    return net, optim


def _step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    optim.zero_grad(set_to_none=True)
    model(torch.randint(0, 16, (4, 5), generator=gen)).square().mean().backward()
    optim.step()


def _assert_same(a: Any, b: Any, path: str = "") -> None:
    """Equal trees: the same keys in the same order, equal leaves, bitwise tensors."""
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), path
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            _assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    else:
        assert a == b, path


def _cloned(tree: Any) -> Any:
    """``tree`` with every tensor copied: a loaded optimizer keeps the very tensors it is
    given, so loading the source's own would tie the two optimizers' moments together."""
    if isinstance(tree, dict):
        return {k: _cloned(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_cloned(v) for v in tree]
    return tree.clone() if isinstance(tree, torch.Tensor) else tree


def _assert_equivalent(model: nn.Module, optim: torch.optim.Optimizer, fresh: nn.Module,
                       fresh_optim: torch.optim.Optimizer, twin: nn.Module,
                       twin_optim: torch.optim.Optimizer) -> None:
    """Ours equals DCP's state; ``fresh`` loaded by ours and ``twin`` by DCP end alike, and
    ours never steps the fresh optimizer to make up its state."""
    ours_model = ModelState(model).state_dict()
    ours_optim = OptimizerState(model, optim).state_dict()
    _assert_same(ours_model, get_model_state_dict(model))
    _assert_same(ours_optim, get_optimizer_state_dict(model, optim))

    steps: list[int] = []
    fresh_optim.register_step_pre_hook(lambda *_: steps.append(1))
    ModelState(fresh).load_state_dict(_cloned(ours_model))
    OptimizerState(fresh, fresh_optim).load_state_dict(_cloned(ours_optim))
    assert steps == []  # no fake step at learning rate 0
    set_model_state_dict(twin, _cloned(ours_model))
    set_optimizer_state_dict(twin, twin_optim, _cloned(ours_optim))
    _assert_same(get_model_state_dict(fresh), get_model_state_dict(twin))
    _assert_same(get_optimizer_state_dict(fresh, fresh_optim),
                 get_optimizer_state_dict(twin, twin_optim))
    _assert_same(get_optimizer_state_dict(fresh, fresh_optim), ours_optim)


def test_plain_model_state_equals_dcp_and_loads_alike() -> None:
    model, optim = _build(0)
    for seed in (1, 2):
        _step(model, optim, seed)
    assert plain_prefix(model) == ""
    fresh, fresh_optim = _build(7)
    twin, twin_optim = _build(8)
    _assert_equivalent(model, optim, fresh, fresh_optim, twin, twin_optim)
    # The loaded pair trains on exactly as the source does.
    for pair in ((model, optim), (fresh, fresh_optim)):
        _step(*pair, 3)
    _assert_same(get_model_state_dict(fresh), get_model_state_dict(model))
    assert fresh.out.weight is fresh.embed.weight  # ties survive the load


def test_regrouped_snapshot_loads_through_dcp() -> None:
    """A snapshot whose param groups differ from the live optimizer's (one group saved, two
    live) is left to DCP, which regroups it by FQN: the state lands on the same parameters."""
    torch.manual_seed(0)
    model = _Net()
    trainable = [p for p in model.parameters() if p.requires_grad]
    one_group = torch.optim.AdamW(trainable, lr=1e-2)
    _step(model, one_group, 1)
    saved = OptimizerState(model, one_group).state_dict()
    fresh, fresh_optim = _build(3)
    OptimizerState(fresh, fresh_optim).load_state_dict(_cloned(saved))
    loaded = get_optimizer_state_dict(fresh, fresh_optim)
    assert [g["params"] for g in loaded["param_groups"]] == [
        ["mid.weight", "embed.weight"], ["mid.bias", "gain"]]
    _assert_same({k: loaded["state"][k] for k in saved["state"]}, saved["state"])


def test_wrapped_submodules_are_not_plain() -> None:
    for wrap in (checkpoint_wrapper, torch.compile):
        model = _Net()
        model.mid = wrap(model.mid)
        assert plain_prefix(model) is None, wrap


def _ddp_and_fsdp_rank(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model, optim = _build(0)
    ddp = DistributedDataParallel(model)
    for seed in (1, 2):
        _step(ddp, optim, seed)
    assert plain_prefix(ddp) == "module."
    fresh, fresh_optim = _build(7)
    twin, twin_optim = _build(8)
    fresh_ddp, twin_ddp = DistributedDataParallel(fresh), DistributedDataParallel(twin)
    _assert_equivalent(ddp, optim, fresh_ddp, fresh_optim, twin_ddp, twin_optim)

    sharded, _ = _build(0)
    fully_shard(sharded)
    assert plain_prefix(sharded) is None  # DTensor parameters: DCP's path
    _assert_same(ModelState(sharded).state_dict(), get_model_state_dict(sharded))


def test_ddp_state_equals_dcp_and_fsdp2_goes_through_dcp(tmp_path) -> None:
    run_group(_ddp_and_fsdp_rank, 1, tmp_dir=str(tmp_path))
