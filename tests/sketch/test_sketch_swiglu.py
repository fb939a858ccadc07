"""The model-agnostic fusions for Llama-family models: `swiglu_mlp` (a gated MLP recomputed
around a sketched down-projection), `rms_norm` (an RMSNorm keeping only its input and row
statistics), and `fuse_swiglu_mlps` / `fuse_rms_norms`, which find them by structure. Each must
give the composition's values and gradients while keeping less for backward, on its own and
inside a Hugging Face LlamaForCausalLM."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from sketch_ops import (
    SketchedLinear,
    blocked,
    fuse_rms_norms,
    fuse_swiglu_mlps,
    rms_norm,
    sketch_model,
    sketch_seed,
    swiglu,
    swiglu_mlp,
)
from sketch_ops.memory import saved_bytes

transformers = pytest.importorskip("transformers")
from transformers.activations import ACT2FN  # noqa: E402
from transformers.models.gemma.modeling_gemma import GemmaMLP, GemmaRMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm  # noqa: E402

F32 = 4  # bytes
SEEDS = 3 * 8  # the fused MLP's three int64 seeds, one saved tensor


def _grads(run, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    for t in tensors:
        t.grad = None
    out = run()
    weights = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    (out * weights).sum().backward()
    return out.detach(), [None if t.grad is None else t.grad.clone() for t in tensors]


def _layers(d: int, hidden: int, bias: bool) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    return (
        nn.Linear(d, hidden, bias=bias).double(),
        nn.Linear(d, hidden, bias=bias).double(),
        nn.Linear(hidden, d, bias=bias).double(),
    )


ACTIVATIONS = {
    "nn.SiLU": lambda: nn.SiLU(),
    "hf-silu": lambda: ACT2FN["silu"],
    "nn.GELU-tanh": lambda: nn.GELU(approximate="tanh"),
    "hf-gelu_new": lambda: ACT2FN["gelu_new"],  # a Python formula: autograd's derivative
}


@pytest.mark.parametrize("act_name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("sketched", ["none", "down", "all"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("keep_gate", [False, True])
def test_swiglu_mlp_equals_the_composition(
    act_name: str, sketched: str, bias: bool, keep_gate: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blocked, "BLOCK_ROWS", 7)  # several row blocks, one partial (7x4 + 4)
    d, hidden, n = 6, 10, 32
    gate, up, down = _layers(d, hidden, bias)
    act = ACTIVATIONS[act_name]()
    if sketched in ("down", "all"):
        down = SketchedLinear.from_linear(down, rank=5, name="down")
    if sketched == "all":
        gate = SketchedLinear.from_linear(gate, rank=4, name="gate")
        up = SketchedLinear.from_linear(up, rank=6, name="up")
    x = torch.randn(2, n // 2, d, dtype=torch.float64, requires_grad=True)
    tensors = [x, *gate.parameters(), *up.parameters(), *down.parameters()]
    with sketch_seed(0, 0):  # the same sketches both times
        got = _grads(lambda: swiglu_mlp(gate, up, down, act, x, recompute=True,
                                        keep_gate=keep_gate), tensors)
        want = _grads(lambda: down(act(gate(x)) * up(x)), tensors)
    torch.testing.assert_close(got[0], want[0], rtol=1e-15, atol=1e-15)
    for g, w in zip(got[1], want[1], strict=True):
        assert g is not None and w is not None
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_swiglu_mlp_keeps_only_its_input_and_the_down_sketch() -> None:
    n, d, hidden, rank = 128, 16, 40, 4
    gate, up, down = nn.Linear(d, hidden), nn.Linear(d, hidden), nn.Linear(hidden, d)
    act = nn.SiLU()
    sketched_down = SketchedLinear.from_linear(down, rank=rank, name="down")
    every = nn.ModuleList([gate, up, down])
    x = torch.randn(n, d, requires_grad=True)
    # Unfused, exact: SiLU keeps its n × I input, the product both factors, down its input.
    plain = saved_bytes(lambda: down(act(gate(x)) * up(x)), every)
    assert plain == n * d * F32 + 4 * n * hidden * F32
    # Fused around the sketched down, keeping only x: x, down's R × I sketch and row mean, seeds.
    fused = saved_bytes(
        lambda: swiglu_mlp(gate, up, sketched_down, act, x, keep_gate=False), every)
    assert fused == n * d * F32 + rank * hidden * F32 + hidden * F32 + SEEDS
    # recompute=True with an exact down: x and the seeds only.
    exact = saved_bytes(
        lambda: swiglu_mlp(gate, up, down, act, x, recompute=True, keep_gate=False), every)
    assert exact == n * d * F32 + SEEDS
    # keep_gate (the default): gate's n × I output besides; backward recomputes only up.
    keep = saved_bytes(lambda: swiglu_mlp(gate, up, sketched_down, act, x), every)
    assert swiglu.KEEP_GATE and keep == fused + n * hidden * F32
    # recompute=False never fuses.
    never = saved_bytes(
        lambda: swiglu_mlp(gate, up, sketched_down, act, x, recompute=False), every
    )
    assert never == n * d * F32 + 3 * n * hidden * F32 + (rank + 1) * hidden * F32 + 8


@pytest.mark.parametrize("keep_gate", [False, True])
def test_swiglu_mlp_under_autocast_matches_the_composition(keep_gate: bool) -> None:
    gate, up, down = (layer.float() for layer in _layers(8, 12, bias=True))
    act = nn.SiLU()
    x = torch.randn(20, 8, requires_grad=True)
    tensors = [x, *gate.parameters(), *up.parameters(), *down.parameters()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _grads(lambda: swiglu_mlp(gate, up, down, act, x, recompute=True,
                                        keep_gate=keep_gate), tensors)
        want = _grads(lambda: down(act(gate(x)) * up(x)), tensors)
    assert got[0].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)  # bf16 rounding of the matmuls


class _Raises(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise TypeError("not an activation")


def test_silu_is_recognised_by_what_it_computes() -> None:
    # nn.SiLU and transformers' SiLUActivation (another class) take the fused SiLU path; a
    # GELU, a sigmoid, hard-swish (SiLU's piecewise cousin) and a module that fails do not.
    assert swiglu._acts_as_silu(nn.SiLU())
    assert swiglu._acts_as_silu(ACT2FN["silu"])
    for act in (nn.GELU(), nn.Sigmoid(), nn.Hardswish(), _Raises(), nn.Identity()):
        assert not swiglu._acts_as_silu(act), act


@pytest.mark.parametrize("sketched", ["none", "down"])
@pytest.mark.parametrize("keep_gate", [False, True])
def test_fused_silu_path_gives_the_general_paths_values_bitwise(
    sketched: str, keep_gate: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SiLU and its derivative called directly, in place in the block temporaries: the same
    output and gradients, to the bit, as the activation's autograd derivative (fp32, several
    row blocks, a partial one)."""
    monkeypatch.setattr(blocked, "BLOCK_ROWS", 16)
    gate, up, down = (layer.float() for layer in _layers(8, 24, bias=True))
    if sketched == "down":
        down = SketchedLinear.from_linear(down, rank=6, name="down")
    x = torch.randn(45, 8, requires_grad=True)
    tensors = [x, *gate.parameters(), *up.parameters(), *down.parameters()]
    act = nn.SiLU()

    def run() -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        with sketch_seed(0, 0):
            return _grads(lambda: swiglu_mlp(gate, up, down, act, x, recompute=True,
                                             keep_gate=keep_gate), tensors)

    fast = run()
    monkeypatch.setattr(swiglu, "_acts_as_silu", lambda act: False)
    general = run()
    assert torch.equal(fast[0], general[0])
    for f, g in zip(fast[1], general[1], strict=True):
        assert f is not None and g is not None and torch.equal(f, g)


class _RenamedSwiglu(nn.Module):
    """SwiGLU with names that give no hint, and up created before gate."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.w3 = nn.Linear(d, hidden, bias=False)  # up
        self.w1 = nn.Linear(d, hidden, bias=False)  # gate
        self.w2 = nn.Linear(hidden, d, bias=False)
        self.nonlinearity = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.nonlinearity(self.w1(x)) * self.w3(x))


class _AdditiveGlu(_RenamedSwiglu):
    """The same structure, another formula: must not be fused."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.nonlinearity(self.w1(x)) + self.w3(x))


class _GeluMlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.act, self.proj = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


def test_fuse_swiglu_mlps_matches_by_structure_and_verifies_by_probe() -> None:
    config = transformers.LlamaConfig(
        hidden_size=12, intermediate_size=20, num_attention_heads=2, hidden_act="silu"
    )
    gemma_config = transformers.GemmaConfig(
        hidden_size=12, intermediate_size=20, num_attention_heads=2, head_dim=6,
        hidden_act="gelu_pytorch_tanh",
    )
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "llama": LlamaMLP(config),
            "gemma": GemmaMLP(gemma_config),  # another family, a tanh-GELU gate
            "renamed": _RenamedSwiglu(12, 20),
            "additive": _AdditiveGlu(12, 20),
            "gelu": _GeluMlp(12),
        }
    )
    rng_before = torch.get_rng_state()
    assert fuse_swiglu_mlps(model) == ["llama", "gemma", "renamed"]
    assert torch.equal(torch.get_rng_state(), rng_before)  # the probe drew nothing globally
    assert model["renamed"]._swiglu_parts == ("w1", "w3", "w2", "nonlinearity")
    assert "forward" not in vars(model["additive"]) and "forward" not in vars(model["gelu"])
    assert type(model["llama"]) is LlamaMLP  # the instance's forward, not its class
    # Fused modules compute the same values and gradients as their own forward.
    for name in ("llama", "gemma", "renamed"):
        module = model[name]
        x = torch.randn(3, 5, 12, requires_grad=True)
        tensors = [x, *module.parameters()]
        got = _grads(lambda m=module, x=x: m(x), tensors)
        want = _grads(lambda m=module, x=x: type(m).forward(m, x), tensors)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        for g, w in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # A deep copy's forward is bound to the copy (its own children).
    copied = copy.deepcopy(model["llama"])
    assert copied.forward.__self__ is copied
    # Idempotent; sketching down afterwards switches the default recompute on.
    assert fuse_swiglu_mlps(model) == ["llama", "gemma", "renamed"]
    sketch_model(model, rank=4, include=["llama.down_proj"])
    x = torch.randn(64, 12, requires_grad=True)
    # Kept: x, gate's output (the default keep_gate), down's R × I sketch and row mean, seeds.
    assert saved_bytes(lambda: model["llama"](x), model["llama"]) == (
        64 * 12 * F32 + 64 * 20 * F32 + 4 * 20 * F32 + 20 * F32 + SEEDS
    )


def _hf_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return type(norm).forward(norm, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_bitwise_llama_rms_norm_and_keeps_x_and_row_statistics(
    dtype: torch.dtype,
) -> None:
    n, d = 64, 24
    norm = LlamaRMSNorm(d, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    x = (3 * torch.randn(4, n // 4, d)).to(dtype).requires_grad_()
    tensors = [x, norm.weight]
    got = _grads(lambda: rms_norm(x, norm.weight, norm.variance_epsilon), tensors)
    want = _grads(lambda: _hf_norm(norm, x), tensors)
    assert got[0].dtype == want[0].dtype == torch.float32  # fp32 weight × cast rows: promoted
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    size = x.element_size()
    lean = saved_bytes(lambda: rms_norm(x, norm.weight, norm.variance_epsilon), norm)
    assert lean == n * d * size + n * F32
    # Llama's own keeps x in fp32 (for bf16 input a copy, in place of x), the row statistics
    # and the normalised rows in x's dtype.
    hf = saved_bytes(lambda: _hf_norm(norm, x), norm)
    assert hf == n * d * F32 + n * F32 + n * d * size


def test_fuse_rms_norms_matches_by_structure_and_leaves_other_norms_alone() -> None:
    model = nn.ModuleDict(
        {
            "llama": LlamaRMSNorm(16),
            "gemma": GemmaRMSNorm(16),  # scales by 1 + weight: the probe rejects it
            "layer_norm": nn.LayerNorm(16),  # two parameters
            "torch_rms": nn.RMSNorm(16),  # eps None
            "linear": nn.Linear(16, 16),
        }
    )
    assert fuse_rms_norms(model) == ["llama"]
    assert fuse_rms_norms(model) == ["llama"]
    assert type(model["llama"]) is LlamaRMSNorm
    x = torch.randn(5, 16)
    torch.testing.assert_close(model["llama"](x), _hf_norm(model["llama"], x), rtol=0, atol=0)


def _llama(layers: int, d: int, hidden: int, vocab: int) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


@pytest.mark.parametrize("keep_gate", [False, True])
def test_fused_llama_gradients_equal_the_unfused_model(keep_gate: bool) -> None:
    tokens = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(0))
    plain, fused = _llama(2, 32, 88, 64), _llama(2, 32, 88, 64)
    assert len(fuse_swiglu_mlps(fused, recompute=True, keep_gate=keep_gate)) == 2
    assert len(fuse_rms_norms(fused)) == 5
    for model in (plain, fused):
        _loss(model, tokens).backward()
    grads = dict(plain.named_parameters())
    for name, param in fused.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)


def test_keep_gate_gives_the_sketched_llama_the_same_gradients_for_one_more_tensor() -> None:
    """keep_gate trades one n × I tensor per MLP for the recompute of gate's matmul: the
    sketched model's gradients (the same sketches) and loss are the recomputing one's."""
    tokens = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(0))
    n, hidden = tokens.numel(), 88
    models = []
    for keep_gate in (False, True):
        model = _llama(2, 32, hidden, 64)
        fuse_swiglu_mlps(model, keep_gate=keep_gate)
        fuse_rms_norms(model)
        sketch_model(model, rank=8, include=["*.mlp.down_proj"])
        models.append(model)
    recomputing, keeping = models
    with sketch_seed(0, 0):
        lean = saved_bytes(lambda: _loss(recomputing, tokens), recomputing)
    with sketch_seed(0, 0):
        kept = saved_bytes(lambda: _loss(keeping, tokens), keeping)
    assert kept - lean == 2 * n * hidden * F32  # one gate output per MLP, two MLPs
    losses = []
    for model in models:
        with sketch_seed(0, 0):
            loss = _loss(model, tokens)
            loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    grads = dict(recomputing.named_parameters())
    for name, param in keeping.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    # Fusing again sets the mode anew: back to recomputing both, the lean bytes.
    fuse_swiglu_mlps(keeping, keep_gate=False)
    with sketch_seed(0, 0):
        assert saved_bytes(lambda: _loss(keeping, tokens), keeping) == lean


@pytest.mark.slow
def test_llama_activation_bytes_exact_vs_fused_and_sketched() -> None:
    """The issue's Llama shape at 2 × 512 tokens: what the fusions and a sketched down save,
    predicted per MLP and per norm and measured with saved-tensor hooks."""
    layers, d, hidden, vocab, rank = 4, 256, 688, 512, 64
    tokens = torch.randint(0, vocab, (2, 512), generator=torch.Generator().manual_seed(0))
    n = tokens.numel()
    plain = _llama(layers, d, hidden, vocab)
    exact_bytes = saved_bytes(lambda: _loss(plain, tokens), plain)

    recomputed = _llama(layers, d, hidden, vocab)
    assert len(fuse_swiglu_mlps(recomputed, recompute=True, keep_gate=False)) == layers
    assert len(fuse_rms_norms(recomputed)) == 2 * layers + 1
    recompute_bytes = saved_bytes(lambda: _loss(recomputed, tokens), recomputed)

    sketched = _llama(layers, d, hidden, vocab)
    fuse_swiglu_mlps(sketched, keep_gate=False)
    fuse_rms_norms(sketched)
    assert len(sketch_model(sketched, rank=rank, include=["*.mlp.down_proj"])) == layers
    with sketch_seed(0, 0):
        sketched_bytes = saved_bytes(lambda: _loss(sketched, tokens), sketched)

    # Per MLP, exact keeps 4 n × I tensors besides its input; fused only its input (the norm's
    # output, which gate and up shared) and the seeds, plus down's R × I sketch and row mean.
    # Per norm, the lean one drops the n × d normalised rows.
    per_norm = n * d * F32
    per_mlp_recompute = 4 * n * hidden * F32 - SEEDS
    per_mlp_sketched = per_mlp_recompute - (rank + 1) * hidden * F32
    norms = (2 * layers + 1) * per_norm
    assert exact_bytes - recompute_bytes == layers * per_mlp_recompute + norms
    assert exact_bytes - sketched_bytes == layers * per_mlp_sketched + norms
    assert sketched_bytes < 0.5 * exact_bytes
    print(
        f"\nLlama d={d} L={layers} I={hidden} n={n} R={rank}: exact {exact_bytes} B, "
        f"fused+recompute {recompute_bytes} B ({recompute_bytes / exact_bytes:.3f}x), "
        f"fused+down sketched {sketched_bytes} B ({sketched_bytes / exact_bytes:.3f}x)"
    )

    # The exact fused model's gradients are the unfused model's.
    for model in (plain, recomputed):
        model.zero_grad()
        _loss(model, tokens).backward()
    grads = dict(plain.named_parameters())
    for name, param in recomputed.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-5, msg=name)
