"""The mean-centred estimator (`estimator="centered"`) and the budget policy (issue 6).

Statistics are proven the way `test_sketch_statistics.py` proves BASIS's: unbiasedness by
exact enumeration of every sign pattern for a fixed hash, the closed-form error (docs/design.md §4
with the centred matrices) by Monte Carlo, exactness at R = n. Then the wiring: the layer and
the fused MLP compute exactly the reference estimate, what they save, and `ranks_for_budget`.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sketch_ops import SketchedLinear, gelu_mlp, reference, sketch_model, sketch_seed
from sketch_ops.function import sketched_linear
from sketch_ops.memory import saved_bytes
from sketch_ops.policy import ranks_for_budget
from sketch_ops.seeds import SketchPlan, make_plan
from trainer.config import ModelConfig
from trainer.train.model import GPT

SEED_BYTES = 8


def _shifted_data(n: int, n_in: int, n_out: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Rows with a large common mean (like GELU outputs) and unequal norms."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(n, 1, dtype=torch.float64, generator=gen) + 0.5
    x = torch.randn(n, n_in, dtype=torch.float64, generator=gen) * scale + 2.0
    dy = torch.randn(n, n_out, dtype=torch.float64, generator=gen) * scale.flip(0) - 1.0
    return x, dy


def _centred_raw(x: torch.Tensor, dy: torch.Tensor, plan: SketchPlan) -> torch.Tensor:
    """The centred estimate without the invariant scalars, from the reference functions."""
    n, counts = x.shape[0], reference.signed_counts(plan).double()
    x_mean, dy_mean = x.mean(0), dy.mean(0)
    sx, qx = reference.center(*reference.bucket_sum(x, plan), x_mean, counts, n)
    sdy, qdy = reference.center(*reference.bucket_sum(dy, plan), dy_mean, counts, n)
    one = torch.tensor(1.0, dtype=torch.float64)
    return reference.weight_grad(sdy, sx, one, x.dtype) + reference.mean_outer(dy_mean, x_mean, n)


def test_centred_estimator_is_unbiased_for_a_fixed_hash() -> None:
    n, rank = 10, 3
    x, dy = _shifted_data(n, 5, 4)
    plan = make_plan(n, rank, seed=7)
    total = torch.zeros(4, 5, dtype=torch.float64)
    for bits in itertools.product((-1.0, 1.0), repeat=n):  # all 1024 sign patterns
        total += _centred_raw(x, dy, replace(plan, signs=torch.tensor(bits)))
    torch.testing.assert_close(total / 2**n, dy.T @ x, rtol=0, atol=1e-10)


def test_center_gives_the_sketch_and_norm_of_the_centred_matrix() -> None:
    x, _ = _shifted_data(12, 6, 1)
    plan = make_plan(12, 5, seed=3)
    counts = reference.signed_counts(plan).double()
    got_sketch, got_sq = reference.center(*reference.bucket_sum(x, plan), x.mean(0), counts, 12)
    centred = x - x.mean(0)
    want_sketch, want_sq = reference.bucket_sum(centred, plan)
    torch.testing.assert_close(got_sketch, want_sketch, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_sq, want_sq, rtol=1e-12, atol=1e-12)


def _closed_form(x: torch.Tensor, dy: torch.Tensor, p: float) -> float:
    rows = (x.square().sum(1) * dy.square().sum(1)).sum()
    return float(p * (x.square().sum() * dy.square().sum() + (dy.T @ x).square().sum() - 2 * rows))


@pytest.mark.parametrize("rank", [4, 16])
def test_centred_error_is_the_closed_form_of_the_centred_matrices(rank: int) -> None:
    n, draws = 64, 1500
    x, dy = _shifted_data(n, 16, 12)
    exact = dy.T @ x
    errors = {"basis": 0.0, "centered": 0.0}
    for k in range(draws):
        plan = make_plan(n, rank, seed=50_000 * rank + k)
        sx, _ = reference.bucket_sum(x, plan)
        sdy, _ = reference.bucket_sum(dy, plan)
        one = torch.tensor(1.0, dtype=torch.float64)
        basis = reference.weight_grad(sdy, sx, one, x.dtype)
        errors["basis"] += float((basis - exact).square().sum()) / draws
        errors["centered"] += float((_centred_raw(x, dy, plan) - exact).square().sum()) / draws
    p = (n / rank - 1) / (n - 1)
    xc, dyc = x - x.mean(0), dy - dy.mean(0)
    assert errors["centered"] == pytest.approx(_closed_form(xc, dyc, p), rel=0.10)
    assert errors["basis"] == pytest.approx(_closed_form(x, dy, p), rel=0.10)
    assert errors["centered"] < 0.2 * errors["basis"]  # the common mean was most of the error


@pytest.mark.parametrize("estimator", ["basis", "centered"])
def test_layer_computes_the_reference_estimate(estimator: str) -> None:
    n, rank, seed = 20, 6, 11
    x, dy = _shifted_data(n, 7, 5)
    weight = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    x_in = x.clone().requires_grad_()
    out = sketched_linear(x_in, weight, None, rank=rank, seed=seed, estimator=estimator)
    out.backward(dy)
    torch.testing.assert_close(x_in.grad, dy @ weight.detach())  # dX stays exact
    plan = make_plan(n, rank, seed)
    counts = reference.signed_counts(plan).double()
    sx, qx = reference.bucket_sum(x, plan)
    sdy, qdy = reference.bucket_sum(dy, plan)
    want = None
    if estimator == "centered":
        sx, qx = reference.center(sx, qx, x.mean(0), counts, n)
        sdy, qdy = reference.center(sdy, qdy, dy.mean(0), counts, n)
    scale = reference.invariant_scale(qx, sx) * reference.invariant_scale(qdy, sdy)
    want = reference.weight_grad(sdy, sx, scale, x.dtype)
    if estimator == "centered":
        want = want + reference.mean_outer(dy.mean(0), x.mean(0), n)
    torch.testing.assert_close(weight.grad, want, rtol=1e-10, atol=1e-10)


def test_centred_layer_is_exact_at_rank_n() -> None:
    x, dy = _shifted_data(16, 5, 3)
    weight = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    sketched_linear(x, weight, None, rank=16, seed=2, estimator="centered").backward(dy)
    # Up to the scalars' eps (1e-8 against norms of ~10): ~1e-9 relative.
    torch.testing.assert_close(weight.grad, dy.T @ x, rtol=1e-7, atol=0)


def test_unknown_estimator_is_rejected_with_the_choices() -> None:
    with pytest.raises(ValueError, match="'basis', 'centered'"):
        SketchedLinear(4, 4, rank=2, estimator="topk")
    with pytest.raises(ValueError, match="estimator"):
        sketch_model(nn.Sequential(nn.Linear(4, 4)), rank=2, estimator="nope")


def test_centred_layer_saves_the_sketch_and_the_row_mean() -> None:
    n, n_in, rank = 256, 24, 8
    layer = SketchedLinear(n_in, 10, rank=rank, estimator="centered")
    x = torch.randn(n, n_in, requires_grad=True)
    assert saved_bytes(lambda: layer(x), layer) == rank * n_in * 4 + n_in * 4 + SEED_BYTES


@pytest.mark.parametrize("fc_kind", ["sketched", "plain"])
@pytest.mark.parametrize("estimator", ["basis", "centered"])
def test_fused_mlp_equals_the_unfused_composition(
    monkeypatch: pytest.MonkeyPatch, fc_kind: str, estimator: str
) -> None:
    from sketch_ops import blocked

    monkeypatch.setattr(blocked, "BLOCK_ROWS", 7)  # several row blocks, a ragged last one:
    # 33 rows make 5 blocks of 7, 7, 7, 7 and 5
    torch.manual_seed(0)
    if fc_kind == "sketched":
        fc: nn.Linear = SketchedLinear(16, 40, rank=5, name="fc", estimator=estimator)
    else:
        fc = nn.Linear(16, 40)
    fc = fc.double()
    proj = SketchedLinear(40, 16, rank=6, name="proj", estimator=estimator).double()
    x = torch.randn(3, 11, 16, dtype=torch.float64)
    g = torch.randn(3, 11, 16, dtype=torch.float64)
    results = []
    for run in (lambda x: gelu_mlp(fc, proj, x), lambda x: proj(F.gelu(fc(x)))):
        x_in = x.clone().requires_grad_()
        for p in (*fc.parameters(), *proj.parameters()):
            p.grad = None
        with sketch_seed(0, 1):
            y = run(x_in)
        y.backward(g)
        grads = [p.grad.clone() for p in (*fc.parameters(), *proj.parameters())]
        results.append([y.detach(), x_in.grad, *grads])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_fused_mlp_with_a_plain_fc_keeps_only_its_input_and_the_proj_sketch() -> None:
    n, d, rank = 128, 16, 4
    fc, proj = nn.Linear(d, 4 * d), SketchedLinear(4 * d, d, rank=rank, estimator="centered")
    both = nn.ModuleList([fc, proj])
    x = torch.randn(n, d, requires_grad=True)
    fused = saved_bytes(lambda: gelu_mlp(fc, proj, x), both)
    # x, proj's sketch, the hidden row mean (4d, fp32) and the two seeds: nothing n × 4d.
    assert fused == n * d * 4 + rank * 4 * d * 4 + 4 * d * 4 + 2 * SEED_BYTES


# --------------------------------------------------------------------------- the budget policy


def _gpt() -> GPT:
    return GPT(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2), seq_len=64)


NO_FC = ["blocks.*.attn.*", "blocks.*.mlp.proj", "lm_head"]


def test_budget_ranks_fit_the_budget_and_favour_narrow_layers() -> None:
    model = _gpt()
    widths = {n: m.in_features for n, m in model.named_modules() if type(m) is nn.Linear}
    budget = 16 * 4 * sum(widths[n] for n in widths if not n.endswith("mlp.fc"))
    ranks = ranks_for_budget(model, memory_budget=budget, rows=256, include=NO_FC)
    assert set(ranks) == {n for n in widths if not n.endswith("mlp.fc")}
    used = sum(r * widths[n] * 4 for n, r in ranks.items())
    assert budget - 4 * sum(widths.values()) < used <= budget  # fits, within one row per layer
    # R ∝ 1/√N: the 4d-wide down-projection gets half the rank of a d-wide layer.
    assert ranks["blocks.0.mlp.proj"] == pytest.approx(ranks["blocks.0.attn.qkv"] / 2, abs=1)


def test_budget_ranks_are_clamped_to_the_rows_and_the_rest_is_shared() -> None:
    model = _gpt()
    huge = ranks_for_budget(model, memory_budget=10**9, rows=100)
    assert set(huge.values()) == {100}
    widths = {n: m.in_features for n, m in model.named_modules() if type(m) is nn.Linear}
    # A budget where the narrow layers would exceed rows=40: they clamp, the wide ones get more.
    budget = 4 * sum(40 * w for w in widths.values()) - 4 * 10 * 128 * 2
    ranks = ranks_for_budget(model, memory_budget=budget, rows=40)
    assert max(ranks.values()) == 40
    assert sum(r * widths[n] * 4 for n, r in ranks.items()) <= budget
    assert math.isclose(min(ranks.values()), 30, abs_tol=3)


def test_budget_errors_name_the_fix() -> None:
    model = _gpt()
    with pytest.raises(ValueError, match="below .* rank 1"):
        ranks_for_budget(model, memory_budget=10, rows=64)
    with pytest.raises(ValueError, match="no nn.Linear layer selected"):
        ranks_for_budget(model, memory_budget=10**6, rows=64, include=["nothing.*"])
    with pytest.raises(ValueError, match="exactly one of rank= and memory_budget="):
        sketch_model(model, rank=4, memory_budget=10**6, rows=64)
    with pytest.raises(ValueError, match="needs rows="):
        sketch_model(model, memory_budget=10**6)
    with pytest.raises(ValueError, match="not selectable"):
        sketch_model(model, rank={"blocks.0.attn.qkv": 4, "blocks.9.mlp.fc": 4})


def test_sketch_model_with_a_budget_sets_the_per_layer_ranks() -> None:
    model = _gpt()
    budget = 8 * 4 * (32 * 2 * 2 + 128 * 2 + 32)
    names = sketch_model(model, memory_budget=budget, rows=256, include=NO_FC)
    want = ranks_for_budget(_gpt(), memory_budget=budget, rows=256, include=NO_FC)
    assert {n: model.get_submodule(n).rank for n in names} == want
    assert type(model.get_submodule("blocks.0.mlp.fc")) is nn.Linear


# --------------------------------------------------------------------------- the benchmark


def test_quality_benchmark_builds_every_variant_and_picks_the_equal_memory_batch() -> None:
    from benchmarks.sketch_quality import variants as bench
    from benchmarks.sketch_quality.worker import build

    names = [v.name for v in bench.VARIANTS]
    assert len(names) == len(set(names)) and "exact" in names and bench.MEMORY_BASE in names
    for v in bench.VARIANTS:  # every configuration builds (budget, include, estimator)
        model, _, schedule = build(v, 0)
        sketched = [m for m in model.modules() if isinstance(m, SketchedLinear)]
        assert bool(sketched) == bool(v.rank or v.budget_rank)
        assert all(m.estimator == v.estimator for m in sketched)
        assert schedule.lr_at(bench.STEPS - 1) < schedule.lr_at(bench.WARMUP)
    probes = {"exact": {"step_peak_mib": 100.0}}
    for i, mb in enumerate(bench.MEMORY_CANDIDATES):  # only the first two fit under 100 MiB
        peak = 90.0 + 5 * i if i < 2 else 130.0 + i
        probes[f"{bench.MEMORY_BASE}-mb{mb}"] = {"step_peak_mib": peak, "step_time_ratio": 2.0}
    (fast,) = bench.SPEED_BASES
    # Over exact's peak (beyond MEMORY_TOLERANCE), a speed variant is left out.
    probes[fast] = {"step_peak_mib": 120.0, "step_time_ratio": 0.5}
    assert not [v for v in bench.derived_variants(probes) if v.name.endswith("-time")]
    probes[fast] = {"step_peak_mib": 80.0, "step_time_ratio": 0.8}
    derived = {v.group: [] for v in bench.derived_variants(probes)}
    for v in bench.derived_variants(probes):
        derived[v.group].append(v)
    by_time, by_tokens, speed_time, speed_time_lr = derived["equal memory"]
    fitting = bench.MEMORY_CANDIDATES[1]  # the largest microbatch under exact's 100 MiB
    assert by_time.microbatch == by_tokens.microbatch == fitting
    assert by_time.steps == round(bench.STEPS / 2.0)  # each step costs twice exact's
    assert by_tokens.steps == bench.STEPS * bench.MICROBATCH // fitting  # exact's tokens
    # The fast variant trains for exact's wall time: 1 / 0.8 as many steps; exact gets those
    # steps too, as the reference.
    assert speed_time.name == f"{fast}-time" and speed_time.steps == round(bench.STEPS / 0.8)
    (reference,) = derived["reference"]
    assert reference.rank == 0 and reference.steps == speed_time.steps
    assert bench.probe_key(speed_time) == fast and bench.probe_key(reference) == "exact"
    # ... and again at the learning rate sketched training prefers, measured by the same probe.
    assert speed_time_lr.steps == speed_time.steps and speed_time_lr.lr_scale < 1.0
    assert bench.probe_key(speed_time_lr) == fast
    assert bench.probe_key(by_time) == f"{bench.MEMORY_BASE}-mb{fitting}"
    # Learning-rate variants share their base's probe; every other variant has its own.
    for v in bench.VARIANTS:
        assert bench.probe_key(v) in names
        assert (bench.probe_key(v) == v.name) == (v.lr_scale == 1.0)


def test_quality_benchmark_keeps_each_variants_seeds_apart(tmp_path, monkeypatch) -> None:
    from benchmarks.sketch_quality import report as bench

    monkeypatch.setattr(bench, "RUNS", tmp_path)
    for name in ("exact-s0", "exact-s1", "exact-steps356-s0", "exact-recompute-s0"):
        (tmp_path / f"{name}.json").write_text(json.dumps({"name": name}))
    assert [r["name"] for r in bench.saved_runs("exact")] == ["exact-s0", "exact-s1"]
    assert [r["name"] for r in bench.saved_runs("exact-steps356")] == ["exact-steps356-s0"]
