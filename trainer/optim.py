"""Optimizer and learning-rate schedule for the worker loop.

Contract:
- `build_optimizer(model, cfg)` is AdamW with decoupled weight decay on matrices only (2-D+
  parameters); biases, norms and nothing else are exempt, as in nanoGPT.
- `WarmupCosine` is a pure function of the step: linear warmup over `warmup_steps`, then
  cosine decay to `min_lr_ratio * lr` at `total_steps`. Its whole state is the step counter,
  so it snapshots as JSON and a resumed run lands on exactly the same learning rate.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trainer.config import OptimConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False
    )


class WarmupCosine:
    """Sets each parameter group's lr for the current step; `step()` moves to the next one."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
        self.optimizer = optimizer
        self.cfg = cfg
        self.total_steps = total_steps
        self.current_step = 0
        self._apply()

    def lr_at(self, step: int) -> float:
        cfg = self.cfg
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        span = max(1, self.total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        floor = cfg.lr * cfg.min_lr_ratio
        return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def _apply(self) -> None:
        lr = self.lr_at(self.current_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @property
    def lr(self) -> float:
        return self.lr_at(self.current_step)

    def step(self) -> None:
        self.current_step += 1
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.current_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current_step = int(state["step"])
        self._apply()
