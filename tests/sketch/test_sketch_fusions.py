"""The memory fusions around linear layers: `norm_linear` (a LayerNorm fused into the linear
layer it feeds) and `gelu_mlp`'s norm and recompute modes. Each must give the composition's
values and gradients while keeping less for backward, on its own and inside the built-in GPT."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sketch_ops import SketchedLinear, gelu_mlp, norm_linear, sketch_model, sketch_seed
from sketch_ops.memory import saved_bytes
from trainer.config import ModelConfig
from trainer.train.model import GPT

F32 = 4  # bytes


def _norm(d: int, *, affine: bool = True, bias: bool = True) -> nn.LayerNorm:
    norm = nn.LayerNorm(d, elementwise_affine=affine, bias=bias).double()
    if affine:
        with torch.no_grad():  # non-trivial affine parameters, so their gradients are tested
            norm.weight.normal_(1.0, 0.3)
            if bias:
                norm.bias.normal_()
    return norm


def _grads(run, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    for t in tensors:
        t.grad = None
    out = run()
    weights = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    (out * weights).sum().backward()
    return out.detach(), [None if t.grad is None else t.grad.clone() for t in tensors]


def _assert_same(got: tuple, want: tuple) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)  # forward: the same ops
    for g, w in zip(got[1], want[1], strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, False)])
def test_norm_linear_equals_the_composition(affine: bool, bias: bool) -> None:
    norm, linear = _norm(12, affine=affine, bias=bias), nn.Linear(12, 7).double()
    x = torch.randn(3, 5, 12, dtype=torch.float64, requires_grad=True)
    tensors = [x, *norm.parameters(), *linear.parameters()]
    _assert_same(
        _grads(lambda: norm_linear(norm, linear, x), tensors),
        _grads(lambda: linear(norm(x)), tensors),
    )


def test_norm_linear_keeps_only_the_norm_input_and_its_row_statistics() -> None:
    n, d = 96, 16
    norm, linear = nn.LayerNorm(d), nn.Linear(d, 3 * d)
    both = nn.ModuleList([norm, linear])
    x = torch.randn(n, d, requires_grad=True)
    assert saved_bytes(lambda: norm_linear(norm, linear, x), both) == n * d * F32 + 2 * n * F32
    # Unfused, the linear layer keeps the n × d normalised rows as well.
    assert saved_bytes(lambda: linear(norm(x)), both) == 2 * n * d * F32 + 2 * n * F32


def test_norm_linear_leaves_a_sketched_layer_and_autocast_to_the_composition() -> None:
    norm = _norm(8)
    sketched = SketchedLinear.from_linear(nn.Linear(8, 6).double(), rank=3, name="layer")
    x = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    tensors = [x, *norm.parameters(), *sketched.parameters()]
    with sketch_seed(0, 0):  # the same sketch both times
        got = _grads(lambda: norm_linear(norm, sketched, x), tensors)
        want = _grads(lambda: sketched(norm(x)), tensors)
    _assert_same(got, want)
    norm32, linear32 = nn.LayerNorm(8), nn.Linear(8, 6)
    x32 = torch.randn(20, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm_linear(norm32, linear32, x32)
        want_out = linear32(norm32(x32))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)


def _mlp(d: int) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    return nn.Linear(d, 4 * d).double(), nn.Linear(4 * d, d).double()


@pytest.mark.parametrize("sketched", ["none", "proj", "both"])
def test_gelu_mlp_with_a_norm_equals_the_composition(sketched: str) -> None:
    d, n = 8, 30
    norm, (fc, proj) = _norm(d), _mlp(d)
    if sketched in ("proj", "both"):
        proj = SketchedLinear.from_linear(proj, rank=5, name="proj")
    if sketched == "both":
        fc = SketchedLinear.from_linear(fc, rank=5, name="fc")
    x = torch.randn(2, n // 2, d, dtype=torch.float64, requires_grad=True)
    tensors = [x, *norm.parameters(), *fc.parameters(), *proj.parameters()]
    with sketch_seed(0, 0):
        # recompute=True fuses even the all-exact MLP (selective recomputation).
        got = _grads(lambda: gelu_mlp(fc, proj, x, norm=norm, recompute=True), tensors)
        want = _grads(lambda: proj(F.gelu(fc(norm(x)))), tensors)
    # Sketched layers: the same BASIS estimate, from the same seeds, as the unfused layers.
    _assert_same(got, want)


def test_gelu_mlp_recompute_modes_trade_memory_as_documented() -> None:
    n, d, rank = 128, 16, 4
    norm, fc, proj = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
    sketched_proj = SketchedLinear.from_linear(proj, rank=rank, name="proj")
    x = torch.randn(n, d, requires_grad=True)
    every = nn.ModuleList([norm, fc, proj])
    stats = 2 * n * F32  # the LayerNorm's row means and 1/std
    seeds = 2 * 8  # the fused function's two int64 seeds (unused when both layers are exact)
    # Exact with recompute: only x, the norm's input (mean and 1/std are recomputed too).
    exact_recompute = saved_bytes(lambda: gelu_mlp(fc, proj, x, norm=norm, recompute=True), every)
    assert exact_recompute == n * d * F32 + seeds
    # Exact, not recomputed: x and statistics (the norm fused into fc), GELU's input, its output.
    exact = saved_bytes(lambda: gelu_mlp(fc, proj, x, norm=norm), every)
    assert exact == n * d * F32 + stats + 2 * n * 4 * d * F32
    # Sketched proj, recomputed by default: x, proj's sketch and hidden row mean, two seeds.
    auto = saved_bytes(lambda: gelu_mlp(fc, sketched_proj, x, norm=norm), every)
    assert auto == n * d * F32 + rank * 4 * d * F32 + 4 * d * F32 + seeds
    # recompute=False: GELU keeps its n × 4d input; proj its sketch, mean and seed.
    never = saved_bytes(
        lambda: gelu_mlp(fc, sketched_proj, x, norm=norm, recompute=False), every
    )
    assert never == n * d * F32 + stats + n * 4 * d * F32 + (rank + 1) * 4 * d * F32 + 8


def _gpt(**overrides: object) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2)
    return GPT(ModelConfig(**{**cfg, **overrides}), seq_len=32)


@pytest.mark.parametrize(
    "overrides,include",
    [
        ({}, None),
        ({"mlp_recompute": "always"}, None),
        ({}, ["blocks.*.mlp.proj"]),
        ({"mlp_recompute": "never"}, ["blocks.*.attn.*", "blocks.*.mlp.*"]),
    ],
)
def test_gpt_fusions_change_memory_not_the_gradients(overrides: dict, include: list | None) -> None:
    tokens = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(0))
    fused, plain = _gpt(**overrides), _gpt(fuse_norms=False, mlp_recompute="never")
    if include:
        for model in (fused, plain):
            sketch_model(model, rank=16, include=include)
    results = []
    for model in (fused, plain):
        with sketch_seed(0, 0):
            loss = model.loss(tokens)
            loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (fused_loss, fused_grads), (plain_loss, plain_grads) = results
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-6, atol=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_gpt_memory_per_configuration_is_ordered_as_the_readme_says() -> None:
    tokens = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(0))

    def kept(include: list | None = None, **overrides: object) -> int:
        model = _gpt(**overrides)
        if include:
            sketch_model(model, rank=8, include=include)
        with sketch_seed(0, 0):
            return saved_bytes(lambda: model.loss(tokens), model)

    unfused = kept(fuse_norms=False)
    exact = kept()
    n, d, layers = 4 * 32, 32, 2
    # Fusing the three norms that feed linear layers (ln1 -> qkv, ln2 -> fc, ln_f -> head)
    # saves exactly one n × d tensor each (the norm keeps its input and statistics either way).
    assert unfused - exact == (2 * layers + 1) * n * d * F32
    recompute = kept(mlp_recompute="always")
    mlp_sketched = kept(["blocks.*.mlp.proj"])
    speed = kept(["blocks.*.attn.*", "blocks.*.mlp.*"], mlp_recompute="never")
    assert recompute < mlp_sketched < speed < exact


def test_gpt_config_rejects_an_unknown_recompute_mode() -> None:
    with pytest.raises(ValueError, match="mlp_recompute"):
        ModelConfig(mlp_recompute="sometimes")
