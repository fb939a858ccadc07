"""The fused path's plan store (`sketch_ops.plan_cache`), with a stand-in for the Triton kernels
(the plans the torch reference draws, and a log of the draws): a microbatch draws the plans its
predecessor asked for in one call per (rows, device), later requests and blocks of the same
microbatch hit, and the plans are dropped when another microbatch opens. The kernels
themselves, bitwise and counted, are tests/sketch/fused_checks.py's (`model`)."""

from __future__ import annotations

import gc
import types
import weakref

import torch

from sketch_ops import plan_cache, sketch_seed
from sketch_ops.seeds import derive_seed, layer_seed, make_plan, plan_order

CPU = torch.device("cpu")


def _kernels() -> tuple[types.ModuleType, list[tuple[int, list[int]]]]:
    """A stand-in for `kernels`: `plan_orders` as the reference draws plans, logged."""
    draws: list[tuple[int, list[int]]] = []

    def plan_orders(n: int, seeds: list[int], device: torch.device) -> torch.Tensor:
        draws.append((n, list(seeds)))
        # At R = n the bucket-major rows are the scrambled order itself.
        return torch.stack([make_plan(n, n, s, device=device).rows for s in seeds])

    fake = types.ModuleType("fake_kernels")
    fake.plan_orders = plan_orders
    fake.plan_order = lambda n, seed, device: plan_orders(n, [seed], device)[0]
    return fake, draws


def _microbatch(kernels: types.ModuleType, step: int,
                layers: dict[str, int]) -> dict[str, torch.Tensor]:
    """What a microbatch's layers do: draw a seed by name, then ask for the plan of n rows."""
    with sketch_seed(11, step):
        return {name: plan_order(kernels, n, layer_seed(name), CPU) for name, n in layers.items()}


def test_a_microbatch_draws_its_plans_together() -> None:
    kernels, draws = _kernels()
    layers = {"a": 10, "b": 10, "c": 10, "d": 7}
    _microbatch(kernels, 100, {"other": 3})  # whatever earlier tests ran: not these layers
    draws.clear()
    first = _microbatch(kernels, 101, layers)
    assert [len(seeds) for _, seeds in draws] == [1, 1, 1, 1]  # nothing to predict from yet
    draws.clear()
    second = _microbatch(kernels, 102, layers)
    seeds = {name: derive_seed(11, 102, 0, name) for name in layers}
    assert draws == [(10, [seeds["a"], seeds["b"], seeds["c"]]), (7, [seeds["d"]])]
    for name, n in layers.items():  # the same plans, bitwise, as drawn one by one
        assert torch.equal(second[name], make_plan(n, n, seeds[name]).rows)
        assert not torch.equal(second[name], first[name])  # another step, another plan


def test_repeats_and_blocks_of_the_same_microbatch_hit() -> None:
    kernels, draws = _kernels()
    _microbatch(kernels, 200, {"a": 5, "b": 5})
    draws.clear()
    with sketch_seed(11, 201):  # forward
        plan_a = plan_order(kernels, 5, layer_seed("a"), CPU)
        assert plan_order(kernels, 5, layer_seed("a"), CPU) is plan_a  # a layer called twice
    with sketch_seed(11, 201):  # backward (and recompute) in a block of its own
        assert plan_order(kernels, 5, layer_seed("a"), CPU) is plan_a
        plan_order(kernels, 5, layer_seed("b"), CPU)
    assert draws == [(5, [derive_seed(11, 201, 0, "a"), derive_seed(11, 201, 0, "b")])]
    outside = plan_order(kernels, 5, 123, CPU)  # no block: drawn alone, never held
    assert torch.equal(outside, make_plan(5, 5, 123).rows) and len(draws) == 2


def test_plans_are_dropped_when_another_microbatch_opens() -> None:
    kernels, _ = _kernels()
    layers = {"a": 16, "b": 16, "c": 9}
    _microbatch(kernels, 300, layers)
    held = _microbatch(kernels, 301, layers)
    assert plan_cache.held_bytes() == 8 * (2 * 16 + 9)  # int64 orders of one microbatch
    batch = weakref.ref(held["a"]._base if held["a"]._base is not None else held["a"])
    del held
    for step in range(302, 306):
        _microbatch(kernels, step, layers)
        gc.collect()
        assert batch() is None
        assert plan_cache.held_bytes() == 8 * (2 * 16 + 9)  # bounded: one microbatch's
