"""Optimizers and learning-rate schedules for the worker loop.

- `build_optimizer(model, cfg, factory=None)` builds `cfg.name`'s optimizer over the trainable
  parameters, weight decay on matrices only (2-D+; biases and norms exempt, as in nanoGPT):
  * `adamw`: decoupled weight decay, `betas`, `eps`; on CUDA the fused kernel (elementwise, so a
    sharded parameter gets a whole one's update), on CPU the per-parameter loop (torch's own
    default there: foreach only adds temporaries, without a speed-up);
  * `sgd`: `momentum` (0: plain SGD, no optimizer state but its param groups), `nesterov`
    (needs momentum); weight decay is SGD's own (L2, added to the gradient);
  * `adafactor`: `torch.optim.Adafactor` (factored second moments, O(n + m) per n x m matrix),
    `beta2_decay`, decoupled weight decay; its `lr` caps the relative step size
    (`min(lr, 1/sqrt(t))` times the parameter's RMS), not an absolute step.
  `factory` (`FitConfig.optimizer_factory`) replaces all that: called with the (wrapped) model,
  it must return a `torch.optim.Optimizer`, else `ConfigError` naming `optimizer_factory`. Any
  optimizer's whole state is snapshotted by parameter name and reshards (`elastic.state.registry`).
- `lr_at(cfg, total_steps, step)` is the learning rate of `step` (0-based: the update that
  completes step `step + 1`): linear warmup over `warmup_steps` to `lr`, then, with
  `floor = min_lr_ratio * lr` and `progress` 0 -> 1 from warmup's end to `total_steps`:
  `cosine` `floor + (lr - floor) * (1 + cos(pi * progress)) / 2`; `linear`
  `floor + (lr - floor) * (1 - progress)`; `constant` `lr`; `wsd` `lr` until the last
  `decay_fraction` of the run (`decay_start`), then linear to `floor` at `total_steps`. A pure
  function of the recipe (`trainer.train.continuation.SCHEDULE_FIELDS`), never of when a session
  started or stopped: stopping early and continuing lands on the same learning rates.
- `LrSchedule` applies it to every param group (a factory's too). Its snapshot state is the step
  counter alone: the schedule's shape comes from the recipe being run, so a snapshot never
  silently overrides a changed `steps` or `lr` (`continuation` refuses such a change unless
  asked; `describe_schedule` says what happens from there). `WarmupCosine` is its old name.
- `optimizer_change(saved_config, cfg)`: a (field, saved, new) triple when a run's saved
  optimizer state cannot fit what `cfg` builds (another `optim.name`, a custom factory on one
  side only); None otherwise, and when the saved config cannot tell (doubt never refuses).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from trainer.config import ConfigError, FitConfig, OptimConfig


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def _on_cuda(groups: list[dict[str, Any]]) -> bool:
    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(p.device.type == "cuda" for p in params)


def build_optimizer(
    model: torch.nn.Module,
    cfg: OptimConfig,
    factory: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
) -> torch.optim.Optimizer:
    """The run's optimizer (module contract)."""
    if factory is not None:
        optimizer = factory(model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer_factory: must return a torch.optim.Optimizer, got "
                              f"{type(optimizer).__name__}")
        return optimizer
    groups = _param_groups(model, cfg.weight_decay)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum,
                               nesterov=cfg.nesterov)
    if cfg.name == "adafactor":
        return torch.optim.Adafactor(groups, lr=cfg.lr, beta2_decay=cfg.beta2_decay)
    fused = _on_cuda(groups)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=fused or None, foreach=False if not fused else None)


# ---------------------------------------------------------------------- schedules

def decay_start(cfg: OptimConfig, total_steps: int) -> int:
    """The first step of `wsd`'s decay: the last `decay_fraction` of the run, after warmup."""
    return max(cfg.warmup_steps, total_steps - round(cfg.decay_fraction * total_steps))


def lr_at(cfg: OptimConfig, total_steps: int, step: int) -> float:
    """The learning rate of (0-based) `step` of a run of `total_steps` steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    start = decay_start(cfg, total_steps) if cfg.schedule == "wsd" else cfg.warmup_steps
    if step < start:
        return cfg.lr  # wsd's stable phase
    span = max(1, total_steps - start)
    progress = min(1.0, (step - start) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (cfg.lr - floor) * (1.0 - progress)  # linear, and wsd's decay


def describe_schedule(cfg: OptimConfig, total_steps: int, from_step: int) -> str:
    """One line: what the schedule does from completed step `from_step` to `total_steps`."""
    parts = [f"lr {lr_at(cfg, total_steps, from_step):.3g} at step {from_step + 1}"]
    if from_step < cfg.warmup_steps:
        parts.append(f"warming up to {cfg.lr:.3g} until step {cfg.warmup_steps}")
    else:
        parts.append(f"warmup ended at step {cfg.warmup_steps}")
    if from_step >= total_steps:
        parts.append(f"the run is complete at step {total_steps}")
    elif cfg.schedule == "constant":
        parts.append(f"constant until step {total_steps}")
    else:
        end = (f"to {lr_at(cfg, total_steps, total_steps - 1):.3g} at step {total_steps} "
               f"(floor {cfg.lr * cfg.min_lr_ratio:.3g})")
        if cfg.schedule == "wsd":
            start = decay_start(cfg, total_steps)
            stable = (f"stable until step {start}, then " if from_step < start
                      else f"decaying since step {start}, ")
            parts.append(f"{stable}linear decay {end}")
        else:
            parts.append(f"{cfg.schedule} decay {end}")
    return ", ".join(parts)


class LrSchedule:
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


WarmupCosine = LrSchedule


# ---------------------------------------------------------------------- continuation

def _saved(config: Mapping[str, Any], section: str, name: str, default: Any) -> Any:
    table = config.get(section)
    return table.get(name, default) if isinstance(table, Mapping) else default


def _optimizer_words(factory: Any, name: Any) -> str:
    if isinstance(factory, str):
        return f"a custom optimizer_factory ({factory})"
    return f"the built-in optimizer (optim.name = {name!r})"


def optimizer_change(saved_config: Any, cfg: FitConfig) -> tuple[str, Any, Any] | None:
    """(field, saved value, new value) when a run made with `saved_config` (a `run.json`
    config) holds optimizer state that `cfg`'s optimizer cannot take; None otherwise."""
    if not isinstance(saved_config, Mapping):
        return None
    saved_factory = saved_config.get("optimizer_factory")
    new_factory = cfg.optimizer_factory
    if isinstance(saved_factory, str) != (new_factory is not None):
        new_name = (None if new_factory is None
                    else f"{new_factory.__module__}.{new_factory.__qualname__}")
        return ("optimizer_factory",
                _optimizer_words(saved_factory, _saved(saved_config, "optim", "name", "adamw")),
                _optimizer_words(new_name, cfg.optim.name))
    if new_factory is not None:
        return None  # two factories: the state is checked against the snapshot at restore
    # Runs made before optim.name existed trained AdamW.
    saved_name = _saved(saved_config, "optim", "name", "adamw")
    if not isinstance(saved_name, str):
        return None
    if saved_name != cfg.optim.name:
        return ("optim.name", saved_name, cfg.optim.name)
    return None
