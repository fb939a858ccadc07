"""The built-in GPT in Flax: the forward of ``trainer.train.model.GPT``, for a loaded snapshot.

Contract: ``FlaxGPT.for_params(params, n_heads)`` maps token ids ``(batch, seq)`` to logits
``(batch, seq, vocab)`` with the parameters ``trainer.on_jax.layout_map.gpt_map`` builds from a
Baton snapshot (vocabulary, width, depth and longest sequence come from their shapes);
``next_token_loss(model, params, tokens)`` is
``trainer.train.model_build.next_token_loss``: the mean
cross-entropy of predicting ``tokens[:, 1:]`` from ``tokens[:, :-1]``. fp32 throughout.

The same maths as the PyTorch model, layer by layer: pre-norm blocks (LayerNorm eps 1e-5,
variance as ``mean((x - mean)^2)``), causal softmax attention scaled by ``1/sqrt(head_dim)``
with a bias on queries and values only (``qv_bias``, the key bias being zero), exact (erf)
GELU MLP of width ``4 * d_model``, untied LM head. What the PyTorch model adds for memory
(fused norms, recomputed MLP, activation checkpointing) changes no value and is left out; so
is BASIS sketching: a run that sketches continues here with exact gradients. No
initialisation: the parameters always come from a snapshot.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

_LN_EPS = 1e-5  # torch.nn.LayerNorm's default


def _norm(name: str) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=_LN_EPS, use_fast_variance=False, name=name)


class Attention(nn.Module):
    n_heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        batch, seq, d = x.shape
        qkv = nn.Dense(3 * d, use_bias=False, name="qkv")(x)
        qv_bias = self.param("qv_bias", nn.initializers.zeros, (2 * d,))
        # The key gets no bias: softmax ignores a per-query constant (trainer/train/model.py).
        bias = jnp.concatenate([qv_bias[:d], jnp.zeros((d,), x.dtype), qv_bias[d:]])
        q, k, v = jnp.split(qkv + bias, 3, axis=-1)
        q, k, v = (t.reshape(batch, seq, self.n_heads, d // self.n_heads) for t in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.n_heads)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, d)
        return nn.Dense(d, name="proj")(y)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        hidden = jax.nn.gelu(nn.Dense(4 * d, name="fc")(x), approximate=False)
        return nn.Dense(d, name="proj")(hidden)


class Block(nn.Module):
    n_heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + Attention(self.n_heads, name="attn")(_norm("ln1")(x))
        return x + MLP(name="mlp")(_norm("ln2")(x))


class FlaxGPT(nn.Module):
    vocab: int
    d_model: int
    seq_len: int  # rows of the position table: the longest sequence
    n_layers: int
    n_heads: int

    @classmethod
    def for_params(cls, params: dict, n_heads: int) -> FlaxGPT:
        """The module whose shapes are those of ``params`` (a ``gpt_map`` tree)."""
        vocab, d_model = params["tok_emb"]["embedding"].shape
        n_layers = sum(1 for k in params if k.startswith("blocks_"))
        return cls(vocab, d_model, params["pos_emb"]["embedding"].shape[0], n_layers, n_heads)

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.d_model, name="tok_emb")(tokens)
        x = x + nn.Embed(self.seq_len, self.d_model, name="pos_emb")(
            jnp.arange(tokens.shape[1]))[None]
        for i in range(self.n_layers):
            x = Block(self.n_heads, name=f"blocks_{i}")(x)
        return nn.Dense(self.vocab, use_bias=False, name="lm_head")(_norm("ln_f")(x))


def next_token_loss(model: nn.Module, params: dict, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting ``tokens[:, 1:]`` from ``tokens[:, :-1]``."""
    logits = model.apply({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
