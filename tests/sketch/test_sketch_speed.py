"""`include="auto"` deciding from cost as well as memory (`sketch.max_quality_cost`,
`sketch_ops.cost`, `sketch_ops.speed_plan`), and `baton sketch-plan`'s predicted times.

The decision logic runs on injected numbers (rates, shapes, errors): no GPU, no timing. The
default (`max_quality_cost = 0`) must leave today's plans exactly as they were."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from sketch_ops import SketchedLinear, sketched_linear
from sketch_ops.cost import (
    Rates,
    balanced_collision,
    layer_delta_s,
    relative_error,
    target_rates,
)
from sketch_ops.model import auto_plan
from sketch_ops.speed_plan import LayerStats, judge
from tests.inprocess_fit import baton
from trainer.config import ConfigError, ModelConfig, SketchConfig, load_recipe
from trainer.train.model import GPT, SKETCH_LAYERS
from trainer.train.model_build import build_model

ROOT = Path(__file__).resolve().parents[2]
LLAMA_RECIPE = str(ROOT / "recipes" / "llama-tiny.toml")
GPT_RECIPE = str(ROOT / "recipes" / "tiny.toml")
H100 = target_rates("h100", torch.bfloat16)
# GEMMs so slow that every dW saved pays: the speed rule then hinges on the error alone.
SLOW_GEMMS = Rates(1e9, 1e12, 0.0, "test", "given", True)


def _stats(n: int, d: int, error: float, calls: int = 1) -> LayerStats:
    return LayerStats(rows=n, in_features=d, out_features=d, itemsize=2, calls=calls,
                      error_sq=error**2)


def test_the_roofline_says_where_a_sketch_is_faster() -> None:
    """On an H100 in bf16 a sketched d x d layer's step gets faster from d ~ 500 on (the
    field's crossover, c = 1), and at d 256 the extra pass and launches cost more."""
    n, rank = 16384, 1024
    assert layer_delta_s(n, 256, 256, rank, 2, H100) > 0
    assert layer_delta_s(n, 1024, 1024, rank, 2, H100) < 0
    assert layer_delta_s(n, 4096, 4096, rank, 2, H100) < layer_delta_s(n, 1024, 1024, rank, 2,
                                                                       H100)
    assert layer_delta_s(n, 1024, 1024, n, 2, H100) > 0  # R = n saves no FLOPs
    assert H100.source == "modelled" and H100.fused_path
    with pytest.raises(ValueError, match="no rates for a GPU named 'v100'"):
        target_rates("v100", torch.bfloat16)


def test_the_error_formula_is_exact_for_a_balanced_plan() -> None:
    """`relative_error` against the layer's own estimates over many seeds (BASIS, no scalars):
    the mean squared error matches the closed form within Monte Carlo noise."""
    gen = torch.Generator().manual_seed(0)
    n, rank = 48, 8
    x = torch.randn(n, 6, generator=gen, dtype=torch.float64)
    dy = torch.randn(n, 5, generator=gen, dtype=torch.float64)
    exact = dy.t() @ x
    errors = []
    for seed in range(400):
        w = torch.zeros(5, 6, dtype=torch.float64, requires_grad=True)
        sketched_linear(x, w, None, rank=rank, seed=seed, estimator="basis",
                        invariant_scalars=False).backward(dy)
        errors.append((w.grad - exact).square().sum().item())
    want = relative_error(n, rank, x.square().sum().item(), dy.square().sum().item(),
                          exact.square().sum().item(),
                          (x.square().sum(1) * dy.square().sum(1)).sum().item(),
                          exact.square().sum().item())
    got = sum(errors) / len(errors) / exact.square().sum().item()
    assert abs(got / want - 1) < 0.15, (got, want)
    assert balanced_collision(n, n) == 0 and balanced_collision(n, 1) == 1


def test_judge_sketches_a_class_when_faster_and_within_the_cost() -> None:
    def rank_of(name: str) -> int:
        return 1024

    big = {f"b.{i}.q": _stats(16384, 2048, error=0.8) for i in range(2)}
    names = list(big)
    chosen = judge("b.#.q", names, big, rank_of, H100, max_quality_cost=1.0)
    assert chosen.chosen and chosen.delta_s < 0 and chosen.error == pytest.approx(0.8)
    assert "faster by" in chosen.reason and "<= max_quality_cost 1" in chosen.reason
    strict = judge("b.#.q", names, big, rank_of, H100, max_quality_cost=0.5)
    assert not strict.chosen and "> max_quality_cost 0.5" in strict.reason
    small = {name: _stats(16384, 128, error=0.1) for name in names}
    slower = judge("b.#.q", names, small, rank_of, H100, max_quality_cost=1.0)
    assert not slower.chosen and slower.delta_s > 0 and "slower by" in slower.reason
    # One layer of the class ran twice (or not at all): its error is not measured.
    mixed = {**big, names[1]: _stats(16384, 2048, error=0.1, calls=2)}
    unmeasured = judge("b.#.q", names, mixed, rank_of, H100, max_quality_cost=10.0)
    assert not unmeasured.chosen and math.isnan(unmeasured.error)
    # The class's error is its worst layer's.
    worst = {**big, names[1]: _stats(16384, 2048, error=1.5)}
    assert not judge("b.#.q", names, worst, rank_of, H100, max_quality_cost=1.0).chosen


def _gpt() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2), seq_len=64)
    return model, torch.randint(0, 64, (4, 65), generator=torch.Generator().manual_seed(1))


def _gpt_plan(model: nn.Module, tokens: torch.Tensor, **kwargs) -> list[str]:
    return auto_plan(model, tokens, rank=8, loss_fn=lambda m, t: m.loss(t), **kwargs).sketched


def test_the_default_keeps_todays_plans_on_the_gpt_and_the_llama() -> None:
    model, tokens = _gpt()
    default = [f"blocks.{i}.mlp.proj" for i in range(2)]
    assert [p.replace("*", "0") for p in SKETCH_LAYERS] == ["blocks.0.mlp.proj"]
    assert _gpt_plan(model, tokens) == default
    assert _gpt_plan(model, tokens, max_quality_cost=0.0, rates=SLOW_GEMMS) == default
    pytest.importorskip("transformers")
    from tests.sketch.test_sketch_auto import _llama, _llama_loss, _tokens

    llama = _llama()
    plan = auto_plan(llama, _tokens(), rank=8, loss_fn=_llama_loss, rates=SLOW_GEMMS)
    assert plan.sketched == [f"model.layers.{i}.mlp.down_proj" for i in range(4)]
    assert plan.speed == []


def test_a_quality_budget_sketches_the_faster_classes_and_says_why() -> None:
    model, tokens = _gpt()
    default = _gpt_plan(model, tokens)
    plan = auto_plan(model, tokens, rank=8, loss_fn=lambda m, t: m.loss(t),
                     max_quality_cost=1e3, rates=SLOW_GEMMS)
    assert set(plan.sketched) > set(default)
    assert {c.key for c in plan.speed if c.chosen} == {
        "blocks.#.attn.qkv", "blocks.#.attn.proj", "blocks.#.mlp.fc", "lm_head"}
    for layer in plan.layers:
        if layer.name not in default:
            assert layer.decision == "sketch" and layer.reason.startswith("for speed: faster")
            assert layer.freed_bytes < 0  # the sketch's own bytes: its input is kept anyway
    errors = [c.error for c in plan.speed]
    assert all(0 < e < math.inf for e in errors), errors
    # A budget under every measured error: nothing more, each class saying why.
    tight = auto_plan(model, tokens, rank=8, loss_fn=lambda m, t: m.loss(t),
                      max_quality_cost=min(errors) / 2, rates=SLOW_GEMMS)
    assert tight.sketched == default
    assert all("> max_quality_cost" in layer.reason for layer in tight.layers
               if layer.name not in default)
    # On an H100 a d-32 model is launch-bound: every sketch would be slower.
    h100 = auto_plan(model, tokens, rank=8, loss_fn=lambda m, t: m.loss(t),
                     max_quality_cost=1e3, rates=H100)
    assert h100.sketched == default and all(c.delta_s > 0 for c in h100.speed)
    assert not any(isinstance(m, SketchedLinear) for m in model.modules())  # left as it was


def test_max_quality_cost_is_validated_and_reaches_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for bad, needle in ((-1.0, "must be a finite number >= 0"), (math.inf, "finite number")):
        with pytest.raises(ConfigError, match=rf"^sketch\.max_quality_cost: .*{needle}"):
            SketchConfig(rank=4, include="auto", max_quality_cost=bad)
    with pytest.raises(ValueError, match="max_quality_cost must be a finite number"):
        auto_plan(nn.Sequential(nn.Linear(2, 2)), torch.zeros(1, 2), rank=1,
                  max_quality_cost=-1)
    run = f'snapshots.run_uri="{tmp_path / "run"}"'
    # The built-in GPT chooses by name unless include = "auto": an auto-only field is refused.
    with pytest.raises(ConfigError, match=r'sketch\.max_quality_cost: applies to sketch\.'
                                          r'include = "auto"'):
        load_recipe(GPT_RECIPE, [run, "sketch.max_quality_cost=1"])
    import sketch_ops

    # The model build reads the rates through sketch_ops' face, where the patch goes.
    monkeypatch.setattr(sketch_ops, "device_rates", lambda *a, **k: SLOW_GEMMS)
    cfg = load_recipe(GPT_RECIPE, [run, 'sketch.include="auto"', "sketch.max_quality_cost=1e3"])
    sketched = {n for n, m in build_model(cfg).named_modules() if isinstance(m, SketchedLinear)}
    assert {"blocks.0.attn.qkv", "blocks.0.mlp.fc", "blocks.0.mlp.proj", "lm_head"} <= sketched


def test_sketch_plan_predicts_memory_and_time_against_exact_and_recompute(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out = baton(capsys, ["sketch-plan", GPT_RECIPE])
    assert code == 0, out
    assert "predicted step (measured: cpu" in out and "sketches on the torch path" in out, out
    rows = dict(re.findall(r"(exact recompute|exact|plan) +[\d.]+ ms +([\d.]+)x exact", out))
    assert set(rows) == {"exact", "exact recompute", "plan"} and rows["exact"] == "1.00", out
    memory = dict(re.findall(r"(exact recompute|exact|plan) +[\d.]+ ms +[\d.]+x exact "
                             r"activation [\d.]+ MiB ([\d.]+)x exact", out))
    assert float(memory["exact recompute"]) < 1 and float(memory["plan"]) < 1, out
    code, out = baton(capsys, ["sketch-plan", GPT_RECIPE, "--target", "h100", "--set",
                               'precision.dtype="bf16"'])
    assert code == 0 and "predicted step (modelled: H100" in out, out
    assert "sketches on the fused path" in out and "x 0.5 for the training dtype" in out, out
    code, out = baton(capsys, ["sketch-plan", GPT_RECIPE, "--target", "v100"])
    assert code == 2 and "no rates for a GPU named 'v100'" in out, out
