"""`sketch_model` on the built-in GPT: which layers it swaps, `include=` filters, and that the
swap keeps parameters, outputs and checkpoints interchangeable with the plain model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from sketch_ops import SketchedLinear, sketch_model
from trainer.config import ModelConfig
from trainer.train.model import GPT


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2), seq_len=8)


def _block_names(i: int) -> list[str]:
    return [f"blocks.{i}.{leaf}" for leaf in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]


def test_default_sketches_every_linear_of_the_gpt() -> None:
    model = _gpt()
    params = list(model.parameters())
    names = sketch_model(model, rank=4)
    assert names == [*_block_names(0), *_block_names(1), "lm_head"]
    for name in names:
        layer = model.get_submodule(name)
        assert isinstance(layer, SketchedLinear)
        assert layer.sketch_name == name and layer.rank == 4
    # Same Parameter objects: an optimizer built before the swap still drives the model.
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert sketch_model(model, rank=4) == []  # already sketched layers are left alone


@pytest.mark.parametrize(
    ("include", "expected"),
    [
        (
            ["blocks.*.mlp.*"],
            ["blocks.0.mlp.fc", "blocks.0.mlp.proj", "blocks.1.mlp.fc", "blocks.1.mlp.proj"],
        ),
        (["lm_head", "blocks.1.attn.qkv"], ["blocks.1.attn.qkv", "lm_head"]),
        (lambda name, m: m.out_features == 64, ["blocks.0.mlp.fc", "blocks.1.mlp.fc"]),
        ([], []),
    ],
)
def test_include_filters(include, expected: list[str]) -> None:
    model = _gpt()
    assert sketch_model(model, rank=4, include=include) == expected
    sketched = {n for n, m in model.named_modules() if isinstance(m, SketchedLinear)}
    assert sketched == set(expected)


def test_include_string_is_rejected_with_a_hint() -> None:
    with pytest.raises(ValueError, match=r"include=\['lm_head'\]"):
        sketch_model(_gpt(), rank=4, include="lm_head")


def test_bad_rank_is_rejected() -> None:
    with pytest.raises(ValueError, match="rank"):
        sketch_model(_gpt(), rank=0)


def test_sketched_gpt_is_interchangeable_with_the_plain_one() -> None:
    plain = _gpt()
    sketched = copy.deepcopy(plain)
    sketch_model(sketched, rank=4)
    tokens = torch.randint(0, 32, (3, 8))
    torch.testing.assert_close(sketched(tokens), plain(tokens), rtol=0, atol=0)
    assert plain.state_dict().keys() == sketched.state_dict().keys()
    fresh_plain, fresh_sketched = _gpt(), copy.deepcopy(sketched)
    for p in fresh_sketched.parameters():
        nn.init.zeros_(p)
    fresh_sketched.load_state_dict(plain.state_dict())
    fresh_plain.load_state_dict(sketched.state_dict())
    torch.testing.assert_close(fresh_sketched(tokens), plain(tokens), rtol=0, atol=0)
    # Loss and gradients flow through the sketched model.
    sketched.loss(tokens).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in sketched.parameters())


def test_under_autocast_a_float64_layer_stays_float64_like_nn_linear() -> None:
    """Autocast casts floating tensors other than float64: so does a sketched layer (before,
    its float64 input went to bfloat16: another dtype and precision than nn.Linear's)."""
    from sketch_ops.seeds import sketch_seed

    torch.manual_seed(0)
    lin = nn.Linear(6, 5).double()
    sketched = SketchedLinear.from_linear(lin, rank=100, name="l")
    x = torch.randn(8, 6, dtype=torch.float64)
    with sketch_seed(0, 0), torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = lin(x), sketched(x)
    assert got.dtype == want.dtype == torch.float64
    assert torch.allclose(got, want)
