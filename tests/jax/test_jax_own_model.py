"""The user's own model in JAX, and the Hugging Face families (issue 36 point 10: 3 and 4).

* A run of the user's own model (`FitConfig.model_factory`: a bigram LM, embedding + linear
  head) continues in JAX with the user's Flax module and `LayoutMap` (`layout=`, `model=`):
  4 PyTorch + 4 JAX steps end within 1e-5 of 8 PyTorch steps, parameters and both moments;
  what JAX writes, PyTorch continues to step 12 within 1e-5 of the uninterrupted run.
  Without `layout=` the run is refused naming `model_factory` and what to pass; with
  `layout=` and no `model=`, `train_step` asks for `state.model` in one line.
* A Hugging Face Qwen2 with tied embeddings is refused naming the family and what is
  supported, not a parameter without a gradient; a tied Llama (its `lm_head.weight` an alias
  of the embedding, with no optimizer state) continues in JAX and back like the untied one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from elastic.portable import PortableRun
from trainer.config import FitConfig, load_recipe
from trainer.on_jax import JaxTrainState, load_train_state, save_train_state
from trainer.on_jax.layout_map import LayoutMap, Rule
from trainer.on_jax.optim import adam_state
from trainer.train.loop import WorkerEnv, run_worker

ROOT = Path(__file__).resolve().parents[2]
VOCAB, WIDTH = 256, 16


class Bigram(torch.nn.Module):
    """The user's own PyTorch model."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.out = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(tokens))


def bigram_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


class FlaxBigram(nn.Module):
    """The same model in Flax, the user's too."""

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        return nn.Dense(VOCAB, name="out")(nn.Embed(VOCAB, WIDTH, name="emb")(tokens))


LAYOUT = LayoutMap("bigram", [Rule(("emb", "embedding"), ("emb.weight",)),
                              Rule(("out", "kernel"), ("out.weight",), transpose=True),
                              Rule(("out", "bias"), ("out.bias",))])


def _cfg(recipe: str, run: Path, dataset: str, *more: str) -> FitConfig:
    return load_recipe(ROOT / "recipes" / recipe, [
        f'snapshots.run_uri="{run}"', f'data.uri="{dataset}"', "steps=12", "eval.every=0",
        "sketch.rank=0", "snapshots.snapshot_every=4", *more])


def _run(cfg: FitConfig, stop_after: int | None) -> Any:
    torch.set_num_threads(1)
    return run_worker(cfg, WorkerEnv(stop_after=stop_after))


def _steps(state: JaxTrainState, n: int) -> None:
    loader = state.loader()
    try:
        for _ in range(n):
            state.train_step(np.concatenate([mb.tokens for mb in loader.next_step()]))
            loader.advance()
        state.data = loader.state_dict()
    finally:
        loader.close()


def _written(state: JaxTrainState) -> dict[str, np.ndarray]:
    adam = adam_state(state.opt_state)
    out = {f"model.{k}": v for k, v in
           state.layout.to_torch(jax.tree.map(np.asarray, state.params)).items()}
    for moment, tree in (("exp_avg", adam.mu), ("exp_avg_sq", adam.nu)):
        out.update({f"optim.state.{k}.{moment}": v for k, v in state.layout.to_torch(
            jax.tree.map(np.asarray, tree), tied=False).items()})
    return out


def _assert_close(ref: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> None:
    """Parameters and each moment within 1e-5 relative, over all tensors of the kind."""
    assert set(got) <= set(ref), sorted(set(got) - set(ref))
    kinds = {"params": [k for k in got if k.startswith("model.")],
             "exp_avg": [k for k in got if k.endswith(".exp_avg")],
             "exp_avg_sq": [k for k in got if k.endswith(".exp_avg_sq")]}
    for kind, keys in kinds.items():
        assert keys, kind
        x = np.concatenate([ref[k].ravel().astype(np.float64) for k in keys])
        y = np.concatenate([got[k].ravel().astype(np.float64) for k in keys])
        rel = float(np.linalg.norm(x - y) / np.linalg.norm(x))
        assert rel <= 1e-5, f"{kind}: relative difference {rel:.2e}"


def _round_trip(make: Any, root: Path, **load: Any) -> None:
    """4 PyTorch + 4 JAX steps against 8 PyTorch ones; then PyTorch to 12 from the JAX
    snapshot against 12 PyTorch ones (the reference stops at 8, so that it has a snapshot
    there, and resumes: Baton's resume is exact)."""
    _run(make(root / "reference"), 8)
    reference = PortableRun(str(root / "reference"))
    at_8 = reference.read(8).tensors
    _run(make(root / "reference"), None)
    run = root / "mixed"
    _run(make(run), 4)
    state = load_train_state(str(run), **load)
    _steps(state, 4)
    _assert_close(at_8, _written(state))
    assert save_train_state(str(run), state).step == 8
    result = _run(make(run), None)
    assert (result.start_step, result.step) == (8, 12)
    _assert_close(reference.read(12).tensors, {
        k: v for k, v in PortableRun(str(run)).read(12).tensors.items()
        if not k.endswith(".step")})


# ------------------------------------------------------------------ the user's own model


def test_own_model_continues_in_jax_with_its_layout_map(tmp_path: Path,
                                                        tiny_dataset: str) -> None:
    def make(run: Path) -> FitConfig:
        return dataclasses.replace(_cfg("tiny.toml", run, tiny_dataset),
                                   model_factory=Bigram, loss_fn=bigram_loss)

    _round_trip(make, tmp_path, layout=LAYOUT, model=FlaxBigram())
    run = str(tmp_path / "mixed")
    with pytest.raises(ValueError, match="model_factory .*Bigram.* pass layout=") as err:
        load_train_state(run)
    assert "\n" not in str(err.value)
    state = load_train_state(run, layout=LAYOUT)  # the model set afterwards, as documented
    assert state.model is None
    with pytest.raises(ValueError, match="state.model is None"):
        state.train_step(np.zeros((8, 32), dtype=np.int64))
    state.model = FlaxBigram()
    assert np.isfinite(state.train_step(np.zeros((8, 32), dtype=np.int64)))


# ------------------------------------------------------------------ Hugging Face families


def _hf_config(directory: Path, family: str) -> Path:
    transformers = pytest.importorskip("transformers")
    shape = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48,
             "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 64, "tie_word_embeddings": True}
    config = (transformers.LlamaConfig(**shape) if family == "llama"
              else transformers.Qwen2Config(**shape))
    config.save_pretrained(directory)
    return directory / "config.json"


def test_a_tied_qwen2_is_named_with_what_is_supported(tmp_path: Path,
                                                      tiny_dataset: str) -> None:
    config = _hf_config(tmp_path / "qwen2", "qwen2")
    run = tmp_path / "run"
    _run(_cfg("llama-tiny.toml", run, tiny_dataset, f'model.hf_config="{config}"'), 4)
    with pytest.raises(ValueError) as err:
        load_train_state(str(run))
    message = str(err.value)
    assert "\n" not in message
    assert "Hugging Face 'qwen2' with tied embeddings" in message, message
    assert "ready maps are the built-in GPT's and a Hugging Face Llama's" in message, message
    assert "pass layout=" in message and "gradient" not in message, message


def test_a_tied_llama_continues_in_jax_and_back(tmp_path: Path, tiny_dataset: str) -> None:
    config = _hf_config(tmp_path / "llama", "llama")
    _round_trip(lambda run: _cfg("llama-tiny.toml", run, tiny_dataset,
                                 f'model.hf_config="{config}"'), tmp_path)
    written = PortableRun(str(tmp_path / "mixed")).read(8).tensors
    assert np.array_equal(written["model.lm_head.weight"],
                          written["model.model.embed_tokens.weight"])
    assert "optim.state.lm_head.weight.exp_avg" not in written
