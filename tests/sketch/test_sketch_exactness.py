"""BASIS layers: what must be exact (output, dX, db, dW at R >= n), the shared sketch of x and
dY, dtypes, N-D inputs, input validation, and nn.Linear state_dict compatibility."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sketch_ops import SketchedLinear, sketch_seed, sketched_linear
from sketch_ops.seeds import make_plan


def _problem(n_lead: tuple[int, ...] = (4, 24), n_in: int = 40, n_out: int = 24):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*n_lead, n_in, dtype=torch.float64, generator=gen)
    w = torch.randn(n_out, n_in, dtype=torch.float64, generator=gen)
    b = torch.randn(n_out, dtype=torch.float64, generator=gen)
    g = torch.randn(*n_lead, n_out, dtype=torch.float64, generator=gen)
    return x, w, b, g


def _grads(fn, x, w, b, g):
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = fn(x, w, b)
    y.backward(g)
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("rank", [1, 7, 32, 96])
def test_forward_dx_db_match_autograd(rank: int) -> None:
    x, w, b, g = _problem()
    y_ref, dx_ref, dw_ref, db_ref = _grads(F.linear, x, w, b, g)
    y, dx, dw, db = _grads(lambda *a: sketched_linear(*a, rank=rank, seed=11), x, w, b, g)
    assert torch.equal(y, y_ref)
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(db, db_ref, rtol=0, atol=1e-10)
    assert dw.shape == dw_ref.shape and torch.isfinite(dw).all()
    if rank < x.shape[0] * x.shape[1]:
        assert not torch.allclose(dw, dw_ref)  # a real estimate, not the exact gradient


@pytest.mark.parametrize("rank", [96, 97, 10_000])
def test_rank_at_least_n_gives_exact_weight_grad(rank: int) -> None:
    x, w, b, g = _problem()  # n = 96 rows
    _, _, dw_ref, _ = _grads(F.linear, x, w, b, g)
    raw = lambda *a: sketched_linear(*a, rank=rank, seed=3, invariant_scalars=False)  # noqa: E731
    torch.testing.assert_close(_grads(raw, x, w, b, g)[2], dw_ref, rtol=0, atol=1e-10)
    # With the invariant scalars, gamma = ||x|| / (||x|| + 1e-8): exact up to that epsilon.
    scaled = lambda *a: sketched_linear(*a, rank=rank, seed=3)  # noqa: E731
    torch.testing.assert_close(_grads(scaled, x, w, b, g)[2], dw_ref, rtol=1e-8, atol=1e-8)


def test_same_sketch_for_x_and_dy_gives_symmetric_psd_estimate() -> None:
    x, _, _, _ = _problem(n_lead=(50,), n_in=12)
    w = torch.eye(12, dtype=torch.float64, requires_grad=True)
    y = sketched_linear(x, w, None, rank=5, seed=21, estimator="basis")
    y.backward(x)  # dY = x, so dW_est = gamma^2 (S x)ᵀ (S x)
    dw = w.grad
    torch.testing.assert_close(dw, dw.T, rtol=0, atol=1e-12)
    assert torch.linalg.eigvalsh(dw).min() > -1e-10
    # And it is exactly that product, computed from the plan regenerated from the seed.
    plan = make_plan(50, 5, 21)
    sx = torch.zeros(5, 12, dtype=torch.float64).index_add_(0, plan.hash, x * plan.signs[:, None])
    gamma = x.norm() / (sx.norm() + 1e-8)
    torch.testing.assert_close(dw, gamma**2 * sx.T @ sx, rtol=1e-12, atol=1e-12)


def test_backward_after_leaving_sketch_seed_uses_the_forward_sketch() -> None:
    x, _, _, g = _problem()
    torch.manual_seed(0)
    layer = SketchedLinear(40, 24, rank=5, name="l").double()
    with sketch_seed(1, 2, 3):
        y_in = layer(x)
        y_in.backward(g)
    inside = layer.weight.grad.clone()
    layer.weight.grad = None
    with sketch_seed(1, 2, 3):
        y_out = layer(x)
    y_out.backward(g)  # after the context is gone
    torch.testing.assert_close(layer.weight.grad, inside, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype: torch.dtype) -> None:
    layer = SketchedLinear(16, 8, rank=4).to(dtype)
    ref = nn.Linear(16, 8).to(dtype)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(3, 5, 16).to(dtype).requires_grad_()
    y = layer(x)
    assert y.dtype == dtype and y.shape == (3, 5, 8)
    torch.testing.assert_close(y, ref(x))
    y.float().square().sum().backward()
    assert layer.weight.grad.dtype == dtype and torch.isfinite(layer.weight.grad.float()).all()
    assert layer.bias.grad.dtype == dtype and x.grad.dtype == dtype


def test_autocast_casts_like_f_linear() -> None:
    layer = SketchedLinear(16, 8, rank=4)
    x = torch.randn(10, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


def test_no_grad_is_plain_linear() -> None:
    layer = SketchedLinear(16, 8, rank=4)
    x = torch.randn(10, 16)
    state = torch.get_rng_state()
    with torch.no_grad():
        y = layer(x)
    assert torch.equal(torch.get_rng_state(), state)  # no sketch work, no seed drawn
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 0}, "rank must be an int >= 1"),
        ({"rank": 2.5}, "rank must be an int >= 1"),
        ({"x": torch.randn(4, 7)}, "in_features=6"),
        ({"x": torch.ones(4, 6, dtype=torch.int64)}, "floating-point"),
        ({"bias": torch.randn(5)}, "bias must have shape"),
        ({"weight": torch.randn(3, 6, 1)}, "weight must be 2-D"),
        ({"x": torch.randn(4, 6, dtype=torch.float64)}, "dtypes must match"),
    ],
)
def test_bad_input_raises_value_error(kwargs: dict, message: str) -> None:
    args = {"x": torch.randn(4, 6), "weight": torch.randn(3, 6, requires_grad=True)}
    args.update(bias=torch.randn(3), rank=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        sketched_linear(args["x"], args["weight"], args["bias"], rank=args["rank"], seed=0)


def test_layer_rejects_bad_rank() -> None:
    with pytest.raises(ValueError, match="rank"):
        SketchedLinear(4, 4, rank=0)


@pytest.mark.parametrize("bias", [True, False])
def test_state_dicts_load_into_each_other(bias: bool) -> None:
    plain = nn.Linear(9, 5, bias=bias)
    sketched = SketchedLinear(9, 5, bias=bias, rank=3)
    assert plain.state_dict().keys() == sketched.state_dict().keys()
    sketched.load_state_dict(plain.state_dict())
    x = torch.randn(7, 9)
    torch.testing.assert_close(sketched(x), plain(x))
    other = nn.Linear(9, 5, bias=bias)
    other.load_state_dict(SketchedLinear(9, 5, bias=bias, rank=3).state_dict(), strict=True)


def test_gelu_mlp_of_plain_layers_is_the_plain_composition() -> None:
    # The sketched cases (fc sketched or plain, both estimators) are in test_sketch_centered.py.
    from sketch_ops import gelu_mlp

    torch.manual_seed(0)
    x = torch.randn(3, 10, 16, dtype=torch.float64)
    plain_fc, plain_proj = nn.Linear(16, 40), nn.Linear(40, 16)
    x32 = x.float()
    torch.testing.assert_close(
        gelu_mlp(plain_fc, plain_proj, x32), plain_proj(F.gelu(plain_fc(x32)))
    )
