"""BASIS estimator statistics: unbiasedness without the scalars (exact enumeration), the
closed-form error of docs/design.md §4 (Monte Carlo, balanced and uniform hash), and the effect of
the invariant scalars. Sketches come from `make_plan`, the generator the layers use."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from sketch_ops import reference
from sketch_ops.seeds import SketchPlan, make_plan


def _data(n: int, n_in: int, n_out: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Rows of unequal norms, so every term of the closed form matters.
    scale = torch.rand(n, 1, dtype=torch.float64, generator=gen) * 2 + 0.1
    x = torch.randn(n, n_in, dtype=torch.float64, generator=gen) * scale
    dy = torch.randn(n, n_out, dtype=torch.float64, generator=gen) * scale.flip(0)
    return x, dy


def _raw_estimate(x: torch.Tensor, dy: torch.Tensor, plan: SketchPlan) -> torch.Tensor:
    sx, _ = reference.bucket_sum(x, plan)
    sdy, _ = reference.bucket_sum(dy, plan)
    return reference.weight_grad(sdy, sx, torch.tensor(1.0, dtype=torch.float64), x.dtype)


def test_raw_estimator_is_unbiased_for_a_fixed_hash() -> None:
    n, rank = 10, 3
    x, dy = _data(n, 5, 4)
    plan = make_plan(n, rank, seed=7)
    total = torch.zeros(4, 5, dtype=torch.float64)
    for bits in itertools.product((-1.0, 1.0), repeat=n):  # all 1024 sign patterns
        total += _raw_estimate(x, dy, replace(plan, signs=torch.tensor(bits)))
    torch.testing.assert_close(total / 2**n, dy.T @ x, rtol=0, atol=1e-10)


def test_invariant_scalars_are_biased_but_norm_matching() -> None:
    n, rank = 10, 3
    base = torch.randn(1, 6, dtype=torch.float64)
    x = base + 0.3 * torch.randn(n, 6, dtype=torch.float64)  # strongly correlated rows
    dy = x @ torch.randn(6, 4, dtype=torch.float64)
    plan = make_plan(n, rank, seed=1)
    total = torch.zeros(4, 6, dtype=torch.float64)
    for bits in itertools.product((-1.0, 1.0), repeat=n):
        signed = replace(plan, signs=torch.tensor(bits))
        sx, qx = reference.bucket_sum(x, signed)
        sdy, qdy = reference.bucket_sum(dy, signed)
        gx, gdy = reference.invariant_scale(qx, sx), reference.invariant_scale(qdy, sdy)
        torch.testing.assert_close((gx * sx).norm(), x.norm(), rtol=1e-6, atol=0)
        total += reference.weight_grad(sdy, sx, gx * gdy, x.dtype)
    mean, exact = total / 2**n, dy.T @ x
    assert (mean - exact).norm() / exact.norm() > 1e-3  # documented: biased
    cosine = (mean * exact).sum() / (mean.norm() * exact.norm())
    assert cosine > 0.95  # ... but pointing the right way


def _closed_form(x: torch.Tensor, dy: torch.Tensor, p: float) -> float:
    row_terms = (x.square().sum(1) * dy.square().sum(1)).sum()
    total = x.square().sum() * dy.square().sum() + (dy.T @ x).square().sum() - 2 * row_terms
    return float(p * total)


def _monte_carlo_error(
    x: torch.Tensor, dy: torch.Tensor, rank: int, balanced: bool, draws: int
) -> float:
    n = x.shape[0]
    sketches = torch.zeros(draws, rank, n, dtype=torch.float64)
    for k in range(draws):
        plan = make_plan(n, rank, seed=10_000 * rank + k, balanced=balanced)
        sketches[k, plan.hash, torch.arange(n)] = plan.signs.double()
    estimates = (sketches @ dy).transpose(1, 2) @ (sketches @ x)
    return float((estimates - dy.T @ x).square().sum((1, 2)).mean())


@pytest.mark.parametrize("rank", [8, 32])
def test_monte_carlo_error_matches_closed_form(rank: int) -> None:
    n, draws = 64, 4000
    x, dy = _data(n, 32, 48)
    p_balanced = (n / rank - 1) / (n - 1)
    balanced = _monte_carlo_error(x, dy, rank, True, draws)
    uniform = _monte_carlo_error(x, dy, rank, False, draws)
    assert balanced == pytest.approx(_closed_form(x, dy, p_balanced), rel=0.10)
    assert uniform == pytest.approx(_closed_form(x, dy, 1 / rank), rel=0.10)
    assert balanced / uniform == pytest.approx((n - rank) / (n - 1), rel=0.10)


def test_balanced_hash_has_no_error_at_rank_n() -> None:
    x, dy = _data(16, 4, 3)
    assert _monte_carlo_error(x, dy, 16, True, 20) < 1e-20
