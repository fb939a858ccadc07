"""`include="auto"`: the probe's plan on a Hugging Face Llama and on the built-in GPT, checked
against independent measurements (`memory.saved_bytes` of whole steps), the probe leaving the
model untouched, the trainer's default, and `baton sketch-plan`. No Ray; a few seconds."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from sketch_ops import SketchedLinear, sketch_model, sketch_seed
from sketch_ops.memory import saved_bytes
from sketch_ops.model import auto_plan
from sketch_ops.policy import selector
from sketch_ops.probe import MIN_SAVING, plan_sketch
from sketch_ops.swiglu import KEEP_GATE
from tests.inprocess_fit import baton
from trainer.config import ConfigError, ModelConfig, SketchConfig, load_recipe
from trainer.train.model import GPT, SKETCH_LAYERS
from trainer.train.model_build import build_model

ROOT = Path(__file__).resolve().parents[2]
LLAMA_RECIPE = str(ROOT / "recipes" / "llama-tiny.toml")
GPT_RECIPE = str(ROOT / "recipes" / "tiny.toml")
RANK = 8


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls: threads only add overhead on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    model.config.use_cache = False
    return model


def _llama_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


def _tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, 128), generator=torch.Generator().manual_seed(1))


def _measure(model: nn.Module, tokens: torch.Tensor, loss=_llama_loss) -> int:
    with sketch_seed(0, 0):
        return saved_bytes(lambda: loss(model, tokens), model)


def _sketched(model: nn.Module, names: list[str]) -> nn.Module:
    """A copy of `model` with exactly `names` sketched."""
    model = copy.deepcopy(model)
    sketch_model(model, rank=RANK, include=lambda name, module: name in names)
    return model


def _by_leaf(plan) -> dict[str, set[str]]:
    """Decision per layer kind: {"mlp.down_proj": {"sketch"}, ...}."""
    kinds: dict[str, set[str]] = {}
    for layer in plan.layers:
        kinds.setdefault(re.sub(r"^.*\.\d+\.", "", layer.name), set()).add(layer.decision)
    return kinds


def test_auto_plan_on_a_llama_sketches_the_down_projections_and_what_pays() -> None:
    model, tokens = _llama(), _tokens()
    exact = _measure(model, tokens)
    plan = auto_plan(model, tokens, rank=RANK, loss_fn=_llama_loss)
    kinds = _by_leaf(plan)
    assert kinds["mlp.down_proj"] == {"sketch"}
    assert kinds["self_attn.o_proj"] == {"keep"}  # its input is attention's output, kept anyway
    # The fused SwiGLU MLP recomputes from its input once down_proj is sketched: gate and up
    # are exact for free.
    assert kinds["mlp.gate_proj"] == kinds["mlp.up_proj"] == {"recomputed"}
    # q/k/v's and the LM head's inputs (the fused norms' outputs) are kept for their weight
    # gradients alone, but each class frees a few % of the step's bytes: under MIN_SAVING.
    for leaf in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "lm_head"):
        assert kinds[leaf] == {"keep"}, leaf
    reasons = {layer.reason for layer in plan.layers if layer.name.endswith(("q_proj", "lm_head"))}
    assert all("under min_saving 0.1" in reason for reason in reasons), reasons
    assert plan.fused  # the SwiGLU MLPs and RMSNorms were fused before the probe
    down = [layer for layer in plan.layers if layer.decision == "sketch"]
    assert sum(layer.freed_bytes for layer in down) >= MIN_SAVING * plan.exact_bytes

    planned = _measure(_sketched(model, plan.sketched), tokens)
    assert planned < 0.55 * exact
    assert abs(planned / plan.predicted_bytes - 1) < 0.02  # the prediction holds


def test_auto_plan_without_threshold_sketches_exactly_what_frees_memory() -> None:
    model, tokens = _llama(), _tokens()
    plan = auto_plan(model, tokens, rank=RANK, loss_fn=_llama_loss, min_saving=0.0)
    kinds = _by_leaf(plan)
    # The fused RMSNorm keeps its own input; its output is kept only for q/k/v's weight
    # gradients (and the final norm's for the LM head's): sketching them frees it.
    for leaf in ("mlp.down_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                 "lm_head"):
        assert kinds[leaf] == {"sketch"}, leaf
    assert kinds["mlp.gate_proj"] == kinds["mlp.up_proj"] == {"recomputed"}
    # Each kind's share is what the default threshold compares: q/k/v and the LM head under it.
    share = {kind: sum(layer.freed_bytes for layer in plan.layers if layer.name.endswith(kind))
             / plan.exact_bytes for kind in ("down_proj", "q_proj", "k_proj", "v_proj", "lm_head")}
    assert share["down_proj"] > MIN_SAVING, share
    assert 0 < share["q_proj"] + share["k_proj"] + share["v_proj"] < MIN_SAVING, share
    assert 0 < share["lm_head"] < MIN_SAVING, share

    chosen = plan.sketched
    planned = _measure(_sketched(model, chosen), tokens)
    assert abs(planned / plan.predicted_bytes - 1) < 0.02  # the prediction holds
    # Each chosen kind really frees memory: leaving it exact costs more bytes ...
    for kind in {re.sub(r"\.\d+\.", ".#.", n) for n in chosen}:
        rest = [n for n in chosen if re.sub(r"\.\d+\.", ".#.", n) != kind]
        assert _measure(_sketched(model, rest), tokens) > planned, kind
    # ... and sketching a layer it keeps or recomputes frees none.
    for leaf in ("self_attn.o_proj", "mlp.gate_proj"):
        more = chosen + [n for n in (layer.name for layer in plan.layers) if n.endswith(leaf)]
        assert _measure(_sketched(model, more), tokens) >= planned, leaf


def test_min_saving_out_of_range_is_one_value_error() -> None:
    for bad in (-0.1, 1.0, True, "0.1"):
        with pytest.raises(ValueError, match=r"min_saving must be a share .* in \[0, 1\)"):
            plan_sketch(nn.Linear(2, 2), torch.zeros(1, 2), rank=1, min_saving=bad)


def test_auto_plan_on_the_builtin_gpt_is_its_default_policy() -> None:
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2), seq_len=64)
    tokens = torch.randint(0, 64, (4, 65))
    plan = auto_plan(model, tokens, rank=RANK, loss_fn=lambda m, t: m.loss(t))
    assert plan.fused == []  # GELU MLP and LayerNorms: the GPT fuses them itself
    default = selector(list(SKETCH_LAYERS))
    assert plan.sketched == [n for n, m in model.named_modules() if n and default(n, m)]
    kinds = _by_leaf(plan)
    # qkv, fc and the LM head run fused with their LayerNorm; attention's proj reads SDPA's
    # output, which SDPA keeps.
    assert kinds["attn.qkv"] == kinds["mlp.fc"] == kinds["lm_head"] == {"recomputed"}
    assert kinds["attn.proj"] == {"keep"}


def test_the_probe_leaves_parameters_grads_buffers_and_rng_alone() -> None:
    model, tokens = _llama(), _tokens()
    params = list(model.parameters())
    for i, p in enumerate(params):  # some grads set, some None
        p.grad = torch.randn_like(p) if i % 2 else None
    before = [(p.detach().clone(), None if p.grad is None else p.grad.clone()) for p in params]
    buffers = [b.clone() for b in model.buffers()]
    modules = [(n, type(m), m.forward) for n, m in model.named_modules()]
    rng = torch.get_rng_state()
    plan_sketch(model, tokens, rank=RANK, loss_fn=_llama_loss)
    assert torch.equal(torch.get_rng_state(), rng)
    assert [(n, type(m), m.forward) for n, m in model.named_modules()] == modules
    for p, (value, grad) in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, value)
        assert (p.grad is None) if grad is None else torch.equal(p.grad, grad)
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), buffers, strict=True))


def test_auto_needs_a_probe_batch_and_is_refused_where_no_probe_runs() -> None:
    with pytest.raises(ValueError, match="probe_batch"):
        sketch_model(_llama(), rank=RANK, include="auto")
    with pytest.raises(ValueError, match="probe step"):
        selector("auto")


def test_recipe_include_auto_and_the_trainer_default(tmp_path: Path) -> None:
    run = f'snapshots.run_uri="{tmp_path / "run"}"'
    llama = build_model(load_recipe(LLAMA_RECIPE, [run]))  # HF model: "auto" by default
    sketched = {n for n, m in llama.named_modules() if isinstance(m, SketchedLinear)}
    assert "model.layers.0.mlp.down_proj" in sketched
    assert not any(n.endswith(("o_proj", "gate_proj", "up_proj")) for n in sketched)
    gpt = build_model(load_recipe(GPT_RECIPE, [run, 'sketch.include="auto"', "sketch.rank=4"]))
    default = selector(list(SKETCH_LAYERS))
    assert {n for n, m in gpt.named_modules() if isinstance(m, SketchedLinear)} == {
        n for n, m in gpt.named_modules() if n and default(n, m)}


def test_recipe_min_saving_and_keep_gate_reach_the_model(tmp_path: Path) -> None:
    """`[sketch] min_saving` and `keep_gate` are auto's threshold and SwiGLU mode in a run."""
    pytest.importorskip("transformers")
    run = f'snapshots.run_uri="{tmp_path / "run"}"'
    assert SketchConfig().min_saving == MIN_SAVING and SketchConfig().keep_gate is KEEP_GATE

    def built(*overrides: str) -> tuple[set[str], set[bool]]:
        model = build_model(load_recipe(LLAMA_RECIPE, [run, *overrides]))
        return ({n for n, m in model.named_modules() if isinstance(m, SketchedLinear)},
                {m._swiglu_keep_gate for m in model.modules() if hasattr(m, "_swiglu_keep_gate")})

    default, default_modes = built()
    assert default == {f"model.layers.{i}.mlp.down_proj" for i in range(2)}
    assert default_modes == {True}
    everything, _ = built("sketch.min_saving=0")  # q/k/v and the LM head free a little too
    assert everything > default and "lm_head" in everything
    assert {n for n in everything if n.endswith("q_proj")}, everything
    only_x, modes = built("sketch.keep_gate=false")
    assert only_x == default and modes == {False}


def test_bad_include_is_one_config_error() -> None:
    with pytest.raises(ConfigError, match=r'^sketch\.include: must be "auto" or a list'):
        SketchConfig(rank=4, include="Auto")


def test_sketch_plan_prints_the_table_and_the_measured_ratio(
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    code, out = baton(capsys, ["sketch-plan", LLAMA_RECIPE, "--rows", "128"])
    assert code == 0, out
    assert "layer in->out decision R input freed why" in out
    assert re.search(r"model\.layers\.1\.mlp\.down_proj 128->64 sketched 8 ", out), out
    assert re.search(r"model\.layers\.0\.self_attn\.o_proj 64->64 kept - ", out), out
    ratio = re.search(r"measured [\d.]+ MiB \(([\d.]+)x exact\)", out)
    assert ratio is not None and 0 < float(ratio.group(1)) < 1, out


def test_sketch_plan_follows_the_recipes_min_saving_and_keep_gate(
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")

    def plan(*overrides: str) -> tuple[int, float, str]:
        argv = ["sketch-plan", LLAMA_RECIPE]
        for override in overrides:
            argv += ["--set", override]
        code, out = baton(capsys, argv)
        assert code == 0, out
        sketched = re.search(r"(\d+) sketched, \d+ kept", out)
        predicted = re.search(r"planned: predicted ([\d.]+) MiB", out)
        assert sketched is not None and predicted is not None, out
        return int(sketched.group(1)), float(predicted.group(1)), out

    count, predicted, out = plan()
    assert count == 2 and "min_saving 0.1, keep_gate true)" in out, out  # the two down_proj
    more, fewer_bytes, out = plan("sketch.min_saving=0")
    assert more > count and fewer_bytes < predicted and "min_saving 0, keep_gate true)" in out, out
    same, fewer_bytes, out = plan("sketch.keep_gate=false")
    assert same == count and fewer_bytes < predicted and "keep_gate false)" in out, out


@pytest.mark.parametrize(("argv", "needle"), [
    (["--set", 'sketch.include="autox"'], 'sketch.include: must be "auto"'),
    (["--set", "sketch.min_saving=1"], "sketch.min_saving: must be a share"),
    (["--set", "sketch.min_saving=-0.1"], "sketch.min_saving: must be a share"),
    (["--set", "sketch.keep_gate=1"], "sketch.keep_gate: must be true or false"),
    # tiny.toml's built-in GPT picks its layers by name: auto's options would be ignored.
    (["--set", "sketch.keep_gate=false"], 'sketch.keep_gate: applies to sketch.include = "auto"'),
    (["--set", "sketch.min_saving=0"], 'sketch.min_saving: applies to sketch.include = "auto"'),
    (["--rows", "33"], "--rows 33"),
    (["--set", "sketch.rank=0"], "--rank R"),
])
def test_sketch_plan_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                           needle: str) -> None:
    from trainer.cli import main

    assert main(["sketch-plan", GPT_RECIPE, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0], err
