"""A Llama in Flax with Hugging Face ``LlamaForCausalLM``'s maths, for its ready layout map.

Contract: ``FlaxLlama.from_hf_config(config)`` (a ``config.json`` dict of ``model_type``
"llama") maps token ids ``(batch, seq)`` to logits ``(batch, seq, vocab)`` with the
parameters ``llama_map_for(config)`` builds from the PyTorch names (q/k/v fused into one
kernel); its loss is ``trainer.train.hf.causal_lm_loss``'s quantity, the mean cross-entropy of
``tokens[:, 1:]`` given the prefix (``trainer.on_jax.gpt.next_token_loss``).

As in transformers: RMSNorm ``x / sqrt(mean(x^2) + eps) * w`` in fp32; rotary embeddings on
the two halves of each head (``rotate_half``) with ``rope_theta`` (the default rope type
only: a scaled rope is refused); grouped-query attention; SwiGLU MLP
``down(silu(gate(x)) * up(x))``; an LM head or, with ``tie_word_embeddings``, the embedding
transposed. No attention or MLP biases (a config with ``attention_bias`` or ``mlp_bias`` is
refused). No initialisation: parameters come from a snapshot.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from trainer.on_jax.layout_map import LayoutMap, llama_map


def _shapes(config: dict[str, Any]) -> dict[str, Any]:
    """The numbers the module and the map need, checked."""
    if config.get("model_type") != "llama":
        raise ValueError(f"model_type is {config.get('model_type')!r}; the Llama map reads "
                         "Hugging Face Llama configs only")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias: the ready Llama map has no biases")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope type {rope.get('rope_type')!r}: only the default rope is "
                         "mapped")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    return {"hidden": hidden, "n_heads": heads,
            "n_kv_heads": int(config.get("num_key_value_heads") or heads),
            "head_dim": int(config.get("head_dim") or hidden // heads),
            "n_layers": int(config["num_hidden_layers"]),
            "vocab": int(config["vocab_size"]), "inter": int(config["intermediate_size"]),
            "eps": float(config.get("rms_norm_eps", 1e-6)),
            "theta": float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            "tied": bool(config.get("tie_word_embeddings", False))}


def llama_map_for(config: dict[str, Any]) -> LayoutMap:
    s = _shapes(config)
    return llama_map(s["n_layers"], hidden=s["hidden"], n_heads=s["n_heads"],
                     n_kv_heads=s["n_kv_heads"], head_dim=s["head_dim"], tied=s["tied"])


class RMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        return scale * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps))


def _rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class Attention(nn.Module):
    n_heads: int
    n_kv_heads: int
    head_dim: int
    theta: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        batch, seq, hidden = x.shape
        hd, h, kv = self.head_dim, self.n_heads, self.n_kv_heads
        qkv = nn.Dense((h + 2 * kv) * hd, use_bias=False, name="qkv")(x)
        q, k, v = jnp.split(qkv, [h * hd, (h + kv) * hd], axis=-1)
        q, k, v = (t.reshape(batch, seq, -1, hd) for t in (q, k, v))
        inv_freq = 1.0 / (self.theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
        angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None]
        emb = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]
        q = q * jnp.cos(emb) + _rotate_half(q) * jnp.sin(emb)
        k = k * jnp.cos(emb) + _rotate_half(k) * jnp.sin(emb)
        k, v = (jnp.repeat(t, h // kv, axis=2) for t in (k, v))  # grouped-query attention
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, h * hd)
        return nn.Dense(hidden, use_bias=False, name="o")(y)


class MLP(nn.Module):
    inter: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gate = nn.Dense(self.inter, use_bias=False, name="gate")(x)
        up = nn.Dense(self.inter, use_bias=False, name="up")(x)
        return nn.Dense(x.shape[-1], use_bias=False, name="down")(jax.nn.silu(gate) * up)


class FlaxLlama(nn.Module):
    shapes: tuple[tuple[str, Any], ...]  # _shapes(config) as items (a hashable attribute)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> FlaxLlama:
        return cls(tuple(sorted(_shapes(config).items())))

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        s = dict(self.shapes)
        embed = nn.Embed(s["vocab"], s["hidden"], name="embed")
        x = embed(tokens)
        for i in range(s["n_layers"]):
            x = _Layer(attn_args=(s["n_heads"], s["n_kv_heads"], s["head_dim"], s["theta"]),
                       inter=s["inter"], eps=s["eps"], name=f"layers_{i}")(x)
        x = RMSNorm(s["eps"], name="norm")(x)
        if s["tied"]:
            return embed.attend(x)
        return nn.Dense(s["vocab"], use_bias=False, name="lm_head")(x)


class _Layer(nn.Module):
    attn_args: tuple[int, int, int, float]
    inter: int
    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + Attention(*self.attn_args, name="attn")(RMSNorm(self.eps, name="input_norm")(x))
        return x + MLP(self.inter, name="mlp")(RMSNorm(self.eps, name="post_norm")(x))
