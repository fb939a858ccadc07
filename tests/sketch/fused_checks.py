"""Checks of the fused sketch path (`sketch_ops.fused_kernels`), run by
tests/sketch/test_sketch_fused.py in a subprocess under Triton's CPU interpreter:
`python tests/sketch/fused_checks.py NAME`.

`TRITON_INTERPRET` is read when a kernel is decorated (at import), so these run in a fresh
process with it set, and with `BATON_SKETCH_BACKEND=triton` so that the layer and the fused MLPs
take the kernels on CPU tensors. Sizes are tiny: the interpreter runs each program in Python.
Each check prints "<NAME> OK" at the end.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from sketch_ops import fused_kernels as fk
from sketch_ops import reference
from sketch_ops.function import input_sketch, weight_grad_estimate
from sketch_ops.seeds import make_plan


def _reference_grad(x: torch.Tensor, dy: torch.Tensor, rank: int, seed: int, centred: bool,
                    scalars: bool = True) -> torch.Tensor:
    """The torch reference's dW estimate (fp32), as the layer's reference path computes it."""
    n = x.shape[0]
    plan = make_plan(n, rank, seed)
    sketch, sq = reference.bucket_sum(x, plan)
    row_sum = x.sum(0, dtype=torch.float32) if centred else None
    hat, mean = input_sketch(sketch, sq, row_sum, plan, n, invariant_scalars=scalars)
    dy_sketch, dy_sq = reference.bucket_sum(dy, plan)
    return weight_grad_estimate(dy_sketch, dy_sq, dy.sum(0, dtype=torch.float32),
                                hat.to(x.dtype), mean, plan, n, invariant_scalars=scalars)


def _fused_grad(x: torch.Tensor, dy: torch.Tensor, rank: int, seed: int, centred: bool,
                groups: int | None, scalars: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(dW, db) through the kernels: forward sketch (order saved as int32), dY sketch, GEMM."""
    n = x.shape[0]
    rank = min(rank, n)
    order = fk.plan_order(n, seed, x.device)
    order32 = torch.empty(n, dtype=torch.int32)
    xs = fk.BlockSketch(n, rank, seed, x.shape[1], order, center=centred, dtype=x.dtype,
                        order_out=order32, groups=groups)
    xs.add(0, n, x)
    db = torch.empty(dy.shape[1], dtype=dy.dtype)
    ds = fk.BlockSketch(n, rank, seed, dy.shape[1], order32, center=centred, dtype=dy.dtype,
                        sum_out=db, groups=groups)
    ds.add(0, n, dy)
    grad = fk.weight_grad(ds.finish(), xs.finish(), n, scale=scalars, dtype=torch.float32)
    assert torch.equal(order32.long(), order)
    return grad, db


def kernels() -> None:
    """Plans bitwise; sketches, sums and dW against the reference: fp32/bf16, centred or not,
    strided inputs, one launch or bucket groups, with and without the invariant scalars."""
    for n, seed in ((1, 0), (300, 5), (1025, 2**63 - 1)):
        plan = make_plan(n, 7, seed)
        bucket = torch.empty(n, dtype=torch.int64)
        bucket[fk.plan_order(n, seed, torch.device("cpu"))] = torch.arange(n) % plan.rank
        assert torch.equal(bucket, plan.hash), n  # the same plan, bitwise
    # A microbatch's plans drawn together (32 seeds per keys launch, one sort): each bitwise
    # its own. At R = n the bucket-major rows are the order itself.
    seeds = [2**63 - 1 - 7919 * j for j in range(35)]
    orders = fk.plan_orders(50, seeds, torch.device("cpu"))
    for seed, order in zip(seeds, orders, strict=True):
        assert torch.equal(order, make_plan(50, 50, seed).rows), seed
    gen = torch.Generator().manual_seed(0)
    cases = [(37, 24, 20, 5, None), (40, 70, 33, 40, 3), (64, 40, 17, 1, None),
             (90, 36, 24, 16, 2)]
    for n, n_in, n_out, rank, groups in cases:
        for centred in (True, False):
            for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
                seed = 7 * n + rank
                x = (torch.randn(n, n_in + 5, generator=gen) + 0.5).to(dtype)[:, 2 : 2 + n_in]
                dy = (torch.randn(n_out, n, generator=gen) + 0.2).to(dtype).t()  # column-major
                got, db = _fused_grad(x, dy, rank, seed, centred, groups)
                want = _reference_grad(x, dy, rank, seed, centred)
                scale = want.abs().max().item()
                torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale)
                torch.testing.assert_close(db, dy.sum(0, dtype=torch.float32).to(dtype),
                                           rtol=tol, atol=tol)
    x, dy = torch.randn(30, 12, generator=gen), torch.randn(30, 9, generator=gen)
    got, _ = _fused_grad(x, dy, 6, 1, True, None, scalars=False)
    torch.testing.assert_close(got, _reference_grad(x, dy, 6, 1, True, scalars=False),
                               rtol=2e-5, atol=2e-5)
    print("kernels OK")


def blocks() -> None:
    """Row blocks accumulate to the one-launch sketch; the producer fusions (GELU, SiLU·up)
    write the hidden rows as torch computes them (to an ulp) and sketch exactly those."""
    gen = torch.Generator().manual_seed(1)
    n, width, rank, seed = 50, 40, 6, 9
    order = fk.plan_order(n, seed, torch.device("cpu"))
    for dtype in (torch.float32, torch.bfloat16):
        pre = torch.randn(n, width, generator=gen).to(dtype)
        up = torch.randn(n, width, generator=gen).to(dtype)
        cases = ((fk.ACT_NONE, pre, None), (fk.ACT_GELU, F.gelu(pre), None),
                 (fk.ACT_SILU_MUL, F.silu(pre).mul_(up), up))
        for act, want_hidden, other in cases:
            parts = fk.BlockSketch(n, rank, seed, width, order, center=True, dtype=dtype)
            hidden = torch.empty_like(pre)
            for start, end in ((20, 50), (0, 20)):  # any order
                parts.add(start, end, pre[start:end].clone(), act=act,
                          other=None if other is None else other[start:end],
                          hidden=hidden[start:end])
            got = parts.finish()
            whole = fk.BlockSketch(n, rank, seed, width, order, center=True, dtype=dtype)
            whole.add(0, n, hidden if act != fk.ACT_NONE else pre)  # what the blocks wrote
            want = whole.finish()
            if act != fk.ACT_NONE:
                # Within an ulp of torch's: erf / exp differ in the last bit, and the
                # interpreter truncates to bf16 where a GPU rounds to nearest, as torch does.
                ulp = 2e-6 if dtype == torch.float32 else 1.6e-2  # two roundings: 2 ulps
                torch.testing.assert_close(hidden, want_hidden, rtol=ulp, atol=1e-5)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.values.float(), want.values.float(), rtol=tol,
                                       atol=tol)
            torch.testing.assert_close(got.stats.sum(1), want.stats.sum(1), rtol=1e-4, atol=1e-3)
            assert got.mean is not None and want.mean is not None
            torch.testing.assert_close(got.mean, want.mean, rtol=1e-5, atol=1e-5)
    print("blocks OK")


def layer() -> None:
    """The layer through the kernels: R = n gives exact backprop's dW, forward and dX exact, and
    a step of a lone call (no `sketch_seed`: its plan drawn alone) launches 7 device kernels (4
    for nn.Linear) and no host sync."""
    from sketch_ops import sketched_linear
    from sketch_ops.launch_count import LaunchCounter

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 20, 24, generator=gen)
    w, b = torch.randn(16, 24, generator=gen), torch.randn(16, generator=gen)
    g = torch.randn(3, 20, 16, generator=gen)

    def grads(fn):  # noqa: ANN001, ANN202
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        out = fn(*leaves)
        out.backward(g)
        return out.detach(), *(t.grad for t in leaves)

    exact = grads(F.linear)
    for estimator in ("centered", "basis"):
        got = grads(lambda x, w, b, e=estimator: sketched_linear(x, w, b, rank=60, seed=4,
                                                                 estimator=e))
        assert torch.equal(got[0], exact[0])
        for a, e in zip(got[1:], exact[1:], strict=True):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    sketched_linear(*leaves, rank=8, seed=3).backward(g)  # compile before counting
    counts = {}
    for name, fn in (("sketched", lambda *a: sketched_linear(*a, rank=8, seed=3)),
                     ("linear", F.linear)):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        with LaunchCounter() as count:
            fn(*leaves).backward(g)
        assert not count.syncs, count.syncs
        counts[name] = count
    assert counts["linear"].total == 4, counts["linear"].kernels
    sketched = counts["sketched"].kernels
    assert counts["sketched"].total == 7, sketched
    assert sketched["triton._sketch_kernel"] == 2 and sketched["triton._grad_kernel"] == 1
    assert sketched["aten.sort.default"] == 1, "the plan is drawn once per step, not twice"
    print("layer OK")


def model() -> None:
    """A step of a model with k sketched layers inside `sketch_seed`: from the second
    microbatch on, the plans of all k are one keys launch and one sort, so the step launches
    exact backprop's kernels + k + 2 (each sketched layer 5 against nn.Linear's 4, and the
    shared 2): 5 + 2/k per sketched layer, at most 6 from k = 2. Activation checkpointing
    recomputes from the held plans (same gradients, bitwise); the plans held are one
    microbatch's, dropped when the next opens."""
    import copy
    import gc
    import weakref

    from torch import nn
    from torch.utils.checkpoint import checkpoint

    from sketch_ops import plan_cache, sketch_model, sketch_seed
    from sketch_ops.launch_count import LaunchCounter
    from sketch_ops.seeds import derive_seed, plan_order

    torch.manual_seed(4)
    exact = nn.Sequential(nn.Linear(24, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                          nn.Linear(32, 16))
    sketched = copy.deepcopy(exact)
    names = sketch_model(sketched, rank=8)
    k, n = len(names), 40
    x, g = torch.randn(n, 24), torch.randn(n, 16)

    def step(net: nn.Module, number: int, recompute: bool = False) -> LaunchCounter:
        net.zero_grad(set_to_none=True)
        with LaunchCounter() as count, sketch_seed(5, number):
            rows = x.clone().requires_grad_()
            out = checkpoint(net, rows, use_reentrant=False) if recompute else net(rows)
            out.backward(g)
        assert not count.syncs, count.syncs
        return count

    exact_total = step(exact, 0).total
    first = step(sketched, 0)  # compiles; no earlier microbatch: each plan drawn alone
    assert first.total == exact_total + k + 2 * k, first.kernels
    assert step(exact, 1).total == exact_total
    counted = step(sketched, 1)
    assert counted.total == exact_total + k + 2, counted.kernels
    assert counted.total - (exact_total - 4 * k) <= 6 * k  # nn.Linear's 4 each, replaced
    assert counted.kernels["triton._plan_keys_kernel"] == 1
    assert counted.kernels["aten.sort.default"] == 1
    step(sketched, 2)
    plain = [p.grad.clone() for p in sketched.parameters()]
    again = step(sketched, 2, recompute=True)  # the same microbatch: its plans are held
    assert again.kernels["aten.sort.default"] == 0, again.kernels
    assert all(torch.equal(p.grad, q) for p, q in zip(sketched.parameters(), plain, strict=True))
    fresh = step(sketched, 3, recompute=True)  # a new microbatch: recompute finds its plans
    assert fresh.kernels["aten.sort.default"] == 1, fresh.kernels
    with sketch_seed(5, 3):
        held = plan_order(fk, n, derive_seed(5, 3, 0, names[0]), x.device)
    assert plan_cache.held_bytes() == 8 * k * n  # int64 orders, one microbatch's
    batch = weakref.ref(held._base if held._base is not None else held)
    del held
    for number in range(4, 7):
        step(sketched, number)
        gc.collect()
        assert batch() is None and plan_cache.held_bytes() == 8 * k * n
    print("model OK")


def mlps() -> None:
    """The fused MLPs (GELU with a norm, SwiGLU keeping gate or not) through the kernels equal
    the torch reference path, sketching every layer or only the down-projection."""
    import os

    from torch import nn

    from sketch_ops import SketchedLinear, blocked, gelu_mlp, sketch_seed, swiglu_mlp

    blocked.BLOCK_ROWS = 16  # several row blocks
    torch.manual_seed(3)
    d, hidden = 12, 20
    x = torch.randn(2, 19, d, requires_grad=True)
    g = torch.randn(2, 19, d)
    norm = nn.LayerNorm(d)
    gate, up, down = (SketchedLinear(d, hidden, rank=5, name="g"),
                      SketchedLinear(d, hidden, bias=False, rank=6, name="u"),
                      SketchedLinear(hidden, d, rank=7, name="d"))
    plain_gate = nn.Linear(d, hidden, bias=False)
    modules = (norm, gate, up, down, plain_gate)

    def grads() -> list[torch.Tensor]:
        for t in (x, *(p for m in modules for p in m.parameters())):
            t.grad = None
        with sketch_seed(1, 2):
            gelu_mlp(gate, down, x, norm=norm).backward(g)
            swiglu_mlp(gate, up, down, nn.SiLU(), x, keep_gate=False).backward(g)
            swiglu_mlp(plain_gate, up, down, nn.SiLU(), x).backward(g)
        return [t.grad.clone() for t in (x, *(p for m in modules for p in m.parameters()))]

    fused = grads()
    os.environ["BATON_SKETCH_BACKEND"] = "torch"
    for got, want in zip(fused, grads(), strict=True):
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    print("mlps OK")


if __name__ == "__main__":
    checks = {"kernels": kernels, "blocks": blocks, "layer": layer, "model": model, "mlps": mlps}
    checks[sys.argv[1]]()
