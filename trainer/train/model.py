"""The built-in GPT: a small, readable decoder-only transformer (nanoGPT-style).

Contract: `GPT(ModelConfig(...), seq_len=S)` (the config is `trainer.config.ModelConfig`, the
recipe's `[model]` section; S, the longest sequence it takes, is `data.seq_len` in a fit) maps
token ids `(batch, seq)` (int64, `< vocab_size`, `seq <= S`) to logits
`(batch, seq, vocab_size)`; `GPT.loss(tokens)` is the next-token cross-entropy of a batch of
sequences (predict `tokens[:, 1:]` from `tokens[:, :-1]`). Pre-norm blocks, causal SDPA
attention, GELU MLP, untied LM head. Every linear layer is a plain `nn.Linear`, so
`sketch_ops.sketch_model` can swap them for BASIS layers by name
(`blocks.{i}.attn.qkv`, `blocks.{i}.attn.proj`, `blocks.{i}.mlp.fc`, `blocks.{i}.mlp.proj`,
`lm_head`); `SKETCH_LAYERS` is the default selection. Memory, never values or gradients:
- each LayerNorm is fused into the linear layer it feeds (`sketch_ops.norm_linear`, and the
  MLP's `norm=`), so an exact qkv, fc or LM head keeps no copy of its input (`fuse_norms`);
- when `mlp.proj` is sketched (or `mlp_recompute="always"`), the MLP runs as one fused,
  row-blocked op that keeps only the block's residual input instead of the 4·d_model-wide
  hidden activations and recomputes them in backward (`sketch_ops.gelu_mlp`);
- `checkpoint_blocks=True` recomputes each whole block in backward (full activation
  checkpointing).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from sketch_ops import gelu_mlp, norm_linear
from trainer.config import ModelConfig

# Which linear layers BASIS sketches by default (`sketch_ops.sketch_model` globs): only the MLP's
# down-projection, the one layer whose sketch saves memory here. Its input (GELU's n × 4d output)
# is the block's largest activation, and once proj is sketched the fused MLP keeps only the
# block's residual input (`sketch_ops.gelu_mlp`). Every other linear layer's input is kept for
# free: qkv's, fc's and the LM head's are the input of the LayerNorm fused into them
# (`sketch_ops.norm_linear`), attention proj's is SDPA's own output. Sketching those would only
# add gradient noise (and save their weight-gradient matmuls: the speed trade, see
# `mlp_recompute="never"` and docs/basis.md). Measured in benchmarks/sketch_quality/run.py
# (benchmarks/reports/2026-12-03-sketch-quality.md).
SKETCH_LAYERS = ("blocks.*.mlp.proj",)
BYTE_VOCAB_SIZE = 256  # the byte tokenizer's; a ModelConfig.vocab_size of 0 with no dataset


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        # Biases for queries and values only. A key bias adds q·b to every score of a query,
        # which softmax ignores: its gradient is exactly zero, so AdamW would only amplify
        # float noise in it into full-size random updates (and break bitwise-close resumes).
        self.qv_bias = nn.Parameter(torch.zeros(2 * cfg.d_model))
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, norm: nn.LayerNorm, fuse_norm: bool) -> torch.Tensor:
        """Attention over `norm(x)`, the norm fused into qkv when `fuse_norm`."""
        batch, seq, d_model = x.shape
        q_bias, v_bias = self.qv_bias.split(d_model)
        # One add over the whole n × 3d output (k gets zeros), so q, k, v stay views of a
        # single tensor: attention keeps one n × 3d buffer for backward, not four.
        bias = torch.cat([q_bias, torch.zeros_like(q_bias), v_bias])
        qkv = norm_linear(norm, self.qkv, x) if fuse_norm else self.qkv(norm(x))
        q, k, v = (qkv + bias).split(d_model, dim=-1)
        # (batch, heads, seq, head_dim) for SDPA.
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # SDPA returns y as a (batch, heads)-strided view of a (batch, seq, d) buffer that it
        # keeps for its own backward, so this reshape is free and proj's input costs nothing:
        # sketching proj would save no memory.
        return self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.recompute = {"auto": None, "always": True, "never": False}[cfg.mlp_recompute]

    def forward(self, x: torch.Tensor, norm: nn.LayerNorm, fuse_norm: bool) -> torch.Tensor:
        """proj(gelu(fc(norm(x)))). When proj is sketched (or `recompute`), `gelu_mlp` keeps
        only x, the norm's input, instead of the 4d-wide hidden activations."""
        if not fuse_norm:
            return gelu_mlp(self.fc, self.proj, norm(x), recompute=self.recompute)
        return gelu_mlp(self.fc, self.proj, x, norm=norm, recompute=self.recompute)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.fuse_norms = cfg.fuse_norms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x, self.ln1, self.fuse_norms)
        return x + self.mlp(x, self.ln2, self.fuse_norms)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, *, seq_len: int) -> None:
        super().__init__()
        if seq_len < 1:
            raise ValueError(f"GPT: seq_len must be >= 1, got {seq_len}")
        self.cfg = cfg
        self.seq_len = seq_len  # longest sequence the position table covers
        # vocab_size 0 means "the dataset's" (resolved by the driver); with no dataset known
        # (a model built from a recipe alone) that is the byte vocabulary.
        self.vocab_size = cfg.vocab_size or BYTE_VOCAB_SIZE
        self.tok_emb = nn.Embedding(self.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, self.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2's scaled init for the residual projections keeps the residual stream stable.
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.seq_len:
            raise ValueError(f"sequence length {seq} exceeds the model's seq_len={self.seq_len}")
        positions = torch.arange(seq, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            if self.cfg.checkpoint_blocks and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.cfg.fuse_norms:
            return norm_linear(self.ln_f, self.lm_head, x)
        return self.lm_head(self.ln_f(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over a batch of sequences `(batch, seq)`."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
