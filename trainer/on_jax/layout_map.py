"""Declared name/layout maps between a snapshot's PyTorch tensors and a Flax parameter tree.

A ``LayoutMap`` is a list of ``Rule``s, each mapping one leaf of a Flax parameter tree (a path
of dict keys) to one or more PyTorch parameter names (the ``<fqn>`` of ``model.<fqn>``) and back:

* ``transpose``: a ``torch.nn.Linear`` weight is ``(out, in)``, a Flax ``Dense`` kernel
  ``(in, out)``; embeddings, norms and biases keep their layout;
* several ``sources`` are fused along ``axis`` of the Flax leaf (after the transpose), e.g.
  ``q_proj``, ``k_proj``, ``v_proj`` into one ``qkv`` kernel; going back the leaf is split at
  the sources' declared ``sizes``.

``to_flax(tensors)`` builds the tree from ``{fqn: array}``; ``to_torch(tree)`` gives back
``{fqn: array}`` with the PyTorch shapes. Every name is covered exactly once both ways: a tensor
the map does not name, or a rule whose source is missing, is ``ValueError`` naming it. The maps
only move elements and AdamW is elementwise, so the same map carries the parameters and both
moments (``trainer.on_jax.state``). Any array type with numpy's ``transpose``, ``concatenate``
and ``split`` semantics works (numpy in, numpy out; JAX arrays are converted).

Tied parameters: ``tied`` maps an alias (a Hugging Face ``lm_head.weight`` with
``tie_word_embeddings``: in ``state_dict()``, without optimizer state) to the name it aliases.
The Flax tree holds the source once; ``to_flax`` takes the alias or not (given, it must equal
its source: else ``ValueError``); ``to_torch(tree, tied=True)`` gives it back as a copy of its
source (the model), ``tied=False`` leaves it out (the optimizer's moments).

Ready maps: ``gpt_map(n_layers)`` for the built-in GPT (``trainer.train.model``; Flax module
``trainer.on_jax.gpt.FlaxGPT``) and ``llama_map(...)`` for Hugging Face ``LlamaForCausalLM``
names (``trainer.on_jax.llama.FlaxLlama``), whose q/k/v are fused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

Tree = dict[str, Any]


@dataclass(frozen=True)
class Rule:
    """One Flax leaf <- PyTorch tensor(s) (module contract)."""

    path: tuple[str, ...]  # keys into the Flax params tree
    sources: tuple[str, ...]  # PyTorch parameter names, fused in this order
    transpose: bool = False  # a Linear weight: (out, in) -> (in, out)
    axis: int = -1  # the fusion axis of the Flax leaf
    sizes: tuple[int, ...] = ()  # each source's extent along `axis` (fused rules only)

    def __post_init__(self) -> None:
        if len(self.sources) > 1 and len(self.sizes) != len(self.sources):
            raise ValueError(f"rule {'/'.join(self.path)}: a fused rule declares one size per "
                             f"source ({len(self.sources)}), got {self.sizes}")


class LayoutMap:
    """A bijection between PyTorch names and a Flax parameter tree (module contract)."""

    def __init__(self, name: str, rules: list[Rule], tied: Mapping[str, str] | None = None
                 ) -> None:
        self.name = name
        self.rules = rules
        names = [s for r in rules for s in r.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"layout map {name}: a PyTorch name is mapped twice")
        self.torch_names = frozenset(names)  # the parameters the Flax tree holds
        self.tied = dict(tied or {})  # alias -> the mapped name it aliases
        for alias, source in self.tied.items():
            if alias in self.torch_names or source not in self.torch_names:
                raise ValueError(f"layout map {name}: tied {alias!r} -> {source!r}: the alias "
                                 "must be unmapped and its source mapped by a rule")

    def to_flax(self, tensors: Mapping[str, Any]) -> Tree:
        """The Flax tree of ``{fqn: array}`` (every fqn covered exactly once; a tied alias
        may be given, equal to its source)."""
        extra = sorted(set(tensors) - self.torch_names - set(self.tied))
        missing = sorted(self.torch_names - set(tensors))
        if extra or missing:
            raise ValueError(f"layout map {self.name} does not fit these tensors: not mapped "
                             f"{extra[:5]}, missing {missing[:5]}; use the map of the run's "
                             "model")
        for alias, source in self.tied.items():
            if alias in tensors and not np.array_equal(np.asarray(tensors[alias]),
                                                       np.asarray(tensors[source])):
                raise ValueError(f"layout map {self.name}: {alias} is declared tied to "
                                 f"{source} but holds other values; declare it untied (a "
                                 "rule of its own)")
        tree: Tree = {}
        for rule in self.rules:
            parts = [np.asarray(tensors[s]) for s in rule.sources]
            if rule.transpose:
                parts = [p.T for p in parts]
            leaf = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=rule.axis)
            _put(tree, rule.path, np.ascontiguousarray(leaf))
        return tree

    def to_torch(self, tree: Mapping[str, Any], tied: bool = True) -> dict[str, np.ndarray]:
        """``{fqn: array}`` in PyTorch layout from a Flax tree (the inverse of ``to_flax``;
        ``tied``: with each alias, a copy of its source)."""
        out: dict[str, np.ndarray] = {}
        for rule in self.rules:
            leaf = np.asarray(_get(tree, rule.path, self.name))
            if len(rule.sources) == 1:
                parts = [leaf]
            else:
                if leaf.shape[rule.axis] != sum(rule.sizes):
                    raise ValueError(f"layout map {self.name}: {'/'.join(rule.path)} has "
                                     f"{leaf.shape[rule.axis]} along axis {rule.axis}, the "
                                     f"map declares {sum(rule.sizes)}")
                parts = np.split(leaf, np.cumsum(rule.sizes)[:-1], axis=rule.axis)
            for name, part in zip(rule.sources, parts, strict=True):
                out[name] = np.ascontiguousarray(part.T if rule.transpose else part)
        if tied:
            out.update({alias: out[source].copy() for alias, source in self.tied.items()})
        return out

    def decayed(self, decayed_names: set[str]) -> Tree:
        """The weight-decay mask as a Flax-shaped tree of bools: a leaf decays when its
        PyTorch sources do (all of them, or none: else ``ValueError``)."""
        mask: Tree = {}
        for rule in self.rules:
            flags = {s in decayed_names for s in rule.sources}
            if len(flags) != 1:
                raise ValueError(f"layout map {self.name}: {'/'.join(rule.path)} fuses tensors "
                                 "with and without weight decay")
            _put(mask, rule.path, flags.pop())
        return mask


def _put(tree: Tree, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: Mapping[str, Any], path: tuple[str, ...], name: str) -> Any:
    node: Any = tree
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            raise ValueError(f"layout map {name}: the Flax tree has no {'/'.join(path)}")
        node = node[key]
    return node


# ---------------------------------------------------------------------------- ready maps


def gpt_map(n_layers: int) -> LayoutMap:
    """The built-in GPT (``trainer.train.model.GPT``) <-> ``trainer.on_jax.gpt.FlaxGPT``."""
    rules = [Rule(("tok_emb", "embedding"), ("tok_emb.weight",)),
             Rule(("pos_emb", "embedding"), ("pos_emb.weight",))]
    for i in range(n_layers):
        t, f = f"blocks.{i}", (f"blocks_{i}",)
        rules += [
            Rule((*f, "ln1", "scale"), (f"{t}.ln1.weight",)),
            Rule((*f, "ln1", "bias"), (f"{t}.ln1.bias",)),
            Rule((*f, "attn", "qkv", "kernel"), (f"{t}.attn.qkv.weight",), transpose=True),
            Rule((*f, "attn", "qv_bias"), (f"{t}.attn.qv_bias",)),
            Rule((*f, "attn", "proj", "kernel"), (f"{t}.attn.proj.weight",), transpose=True),
            Rule((*f, "attn", "proj", "bias"), (f"{t}.attn.proj.bias",)),
            Rule((*f, "ln2", "scale"), (f"{t}.ln2.weight",)),
            Rule((*f, "ln2", "bias"), (f"{t}.ln2.bias",)),
            Rule((*f, "mlp", "fc", "kernel"), (f"{t}.mlp.fc.weight",), transpose=True),
            Rule((*f, "mlp", "fc", "bias"), (f"{t}.mlp.fc.bias",)),
            Rule((*f, "mlp", "proj", "kernel"), (f"{t}.mlp.proj.weight",), transpose=True),
            Rule((*f, "mlp", "proj", "bias"), (f"{t}.mlp.proj.bias",)),
        ]
    rules += [Rule(("ln_f", "scale"), ("ln_f.weight",)), Rule(("ln_f", "bias"), ("ln_f.bias",)),
              Rule(("lm_head", "kernel"), ("lm_head.weight",), transpose=True)]
    return LayoutMap("gpt", rules)


def llama_map(n_layers: int, *, hidden: int, n_heads: int, n_kv_heads: int,
              head_dim: int | None = None, tied: bool = False) -> LayoutMap:
    """Hugging Face ``LlamaForCausalLM`` names <-> ``trainer.on_jax.llama.FlaxLlama``: q, k
    and v fused into one ``qkv`` kernel (sizes ``n_heads * head_dim``, ``n_kv_heads *
    head_dim`` twice), gate and up kept apart; ``tied``: no ``lm_head`` rule (it is the
    embedding: ``lm_head.weight`` is declared tied to ``model.embed_tokens.weight``)."""
    hd = head_dim or hidden // n_heads
    qkv_sizes = (n_heads * hd, n_kv_heads * hd, n_kv_heads * hd)
    rules = [Rule(("embed", "embedding"), ("model.embed_tokens.weight",))]
    for i in range(n_layers):
        t, f = f"model.layers.{i}", (f"layers_{i}",)
        rules += [
            Rule((*f, "input_norm", "scale"), (f"{t}.input_layernorm.weight",)),
            Rule((*f, "attn", "qkv", "kernel"),
                 tuple(f"{t}.self_attn.{p}_proj.weight" for p in "qkv"),
                 transpose=True, axis=1, sizes=qkv_sizes),
            Rule((*f, "attn", "o", "kernel"), (f"{t}.self_attn.o_proj.weight",), transpose=True),
            Rule((*f, "post_norm", "scale"), (f"{t}.post_attention_layernorm.weight",)),
            Rule((*f, "mlp", "gate", "kernel"), (f"{t}.mlp.gate_proj.weight",), transpose=True),
            Rule((*f, "mlp", "up", "kernel"), (f"{t}.mlp.up_proj.weight",), transpose=True),
            Rule((*f, "mlp", "down", "kernel"), (f"{t}.mlp.down_proj.weight",), transpose=True),
        ]
    rules.append(Rule(("norm", "scale"), ("model.norm.weight",)))
    if tied:
        return LayoutMap("llama", rules, tied={"lm_head.weight": "model.embed_tokens.weight"})
    rules.append(Rule(("lm_head", "kernel"), ("lm_head.weight",), transpose=True))
    return LayoutMap("llama", rules)
