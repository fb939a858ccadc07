"""Optimizer and learning-rate schedule for the worker loop.

Contract:
- `build_optimizer(model, cfg)` is AdamW with decoupled weight decay on matrices only (2-D+
  parameters); biases, norms and nothing else are exempt, as in nanoGPT.
- `lr_at(cfg, total_steps, step)` is the learning rate of `step` (0-based: the update that
  completes step `step + 1`): linear warmup over `warmup_steps`, then cosine decay to
  `min_lr_ratio * lr` at `total_steps`. It is a pure function of the recipe (`optim.lr`,
  `optim.warmup_steps`, `optim.min_lr_ratio` and the run's `steps`), never of when a session
  started or stopped: stopping early and continuing lands on exactly the same learning rates.
- `WarmupCosine` applies it to an optimizer. Its whole snapshot state is the step counter:
  the schedule's shape always comes from the recipe being run, so a snapshot can never
  silently override a changed `steps` or `lr` (`trainer.session_log` refuses such a change when
  a run continues, unless asked for; `describe_schedule` says what it does from there).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trainer.config import OptimConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
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


def lr_at(cfg: OptimConfig, total_steps: int, step: int) -> float:
    """The learning rate of (0-based) `step` of a run of `total_steps` steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def describe_schedule(cfg: OptimConfig, total_steps: int, from_step: int) -> str:
    """One line: what the schedule does from completed step `from_step` to `total_steps`."""
    parts = [f"lr {lr_at(cfg, total_steps, from_step):.3g} at step {from_step + 1}"]
    if from_step < cfg.warmup_steps:
        parts.append(f"warming up to {cfg.lr:.3g} until step {cfg.warmup_steps}")
    else:
        parts.append(f"warmup ended at step {cfg.warmup_steps}")
    if from_step < total_steps:
        parts.append(f"cosine decay to {lr_at(cfg, total_steps, total_steps - 1):.3g} at step "
                     f"{total_steps} (floor {cfg.lr * cfg.min_lr_ratio:.3g})")
    else:
        parts.append(f"the run is complete at step {total_steps}")
    return ", ".join(parts)


class WarmupCosine:
    """Sets each parameter group's lr for the current step; `step()` moves to the next one."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
        self.optimizer = optimizer
        self.cfg = cfg
        self.total_steps = total_steps
        self.current_step = 0
        self._apply()

    def lr_at(self, step: int) -> float:
        return lr_at(self.cfg, self.total_steps, step)

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
        # Only the position: lr, warmup and total_steps stay those of the recipe being run.
        self.current_step = int(state["step"])
        self._apply()
