"""Which layers are sketched, and at what rank: the selection rule and ranks from a budget.

Contract: `selector(include)` is the one definition of "selected layer" (`sketch_model`'s
`include`): None selects every candidate; a sequence of `fnmatch` glob patterns matches the
qualified name; a callable `(name, module) -> bool` decides itself; a bare string is refused
(it would be read as a sequence of one-character patterns). `AUTO` ("auto") is the one string
`sketch_model` takes: it needs a probe step, which `sketch_model` runs and turns into a
callable (`model.auto_plan`); here it is refused with that hint.

`ranks_for_budget(model, *, memory_budget, rows, include=None, bytes_per_value=4)`
returns `{qualified name: R}` for the `nn.Linear` layers `include` selects (the selection rules
of `sketch_model`). Layer ℓ with N_ℓ input features keeps an R_ℓ × N_ℓ sketch per microbatch of
`rows` rows, so the ranks satisfy `Σ R_ℓ N_ℓ · bytes_per_value ≤ memory_budget`, each R_ℓ in
[1, rows]. `sketch_model(model, memory_budget=..., rows=...)` calls it.

Why R_ℓ ∝ 1/√N_ℓ: at a fixed hash the error of a layer's estimate falls as 1/R_ℓ (docs/design.md
§4: p ≈ 1/R for n ≫ R), while its memory grows as R_ℓ N_ℓ. Minimising Σ c_ℓ / R_ℓ under
Σ R_ℓ N_ℓ = B gives R_ℓ ∝ √(c_ℓ / N_ℓ); without a measurement of the c_ℓ we take them equal,
so wide layers (an MLP's 4d-wide down-projection) get fewer rows than narrow ones for the same
bytes. The budget is for the sketches alone; the rest of the step's memory (attention,
LayerNorms, residual stream) does not depend on it.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Sequence

from torch import nn

AUTO = "auto"
Include = Sequence[str] | Callable[[str, nn.Linear], bool] | None  # or AUTO, a str


def selector(include: Include) -> Callable[[str, nn.Linear], bool]:
    if include is None:
        return lambda name, module: True
    if callable(include):
        return include
    if include == AUTO:
        raise ValueError(
            "include='auto' needs a probe step: call sketch_model(model, rank=R, "
            "include='auto', probe_batch=BATCH), which resolves it"
        )
    if isinstance(include, str):
        raise ValueError(
            f"sketch_model: include must be a list of glob patterns or 'auto', not the string "
            f"{include!r}; write include=[{include!r}]"
        )
    patterns = list(include)
    return lambda name, module: any(fnmatch.fnmatchcase(name, p) for p in patterns)


def ranks_for_budget(
    model: nn.Module,
    *,
    memory_budget: int,
    rows: int,
    include: Include = None,
    bytes_per_value: int = 4,
) -> dict[str, int]:
    if rows < 1:
        raise ValueError(f"ranks_for_budget: rows (tokens per microbatch) must be >= 1, got {rows}")
    if bytes_per_value < 1:
        raise ValueError(f"ranks_for_budget: bytes_per_value must be >= 1, got {bytes_per_value}")
    select = selector(include)
    widths = {
        name: module.in_features
        for name, module in model.named_modules()
        if type(module) is nn.Linear and name and select(name, module)
    }
    if not widths:
        raise ValueError("ranks_for_budget: no nn.Linear layer selected; check include")
    minimum = sum(widths.values()) * bytes_per_value  # R = 1 everywhere
    if memory_budget < minimum:
        raise ValueError(
            f"ranks_for_budget: memory_budget={memory_budget} bytes is below the {minimum} bytes "
            "that rank 1 in every selected layer needs; raise it or sketch fewer layers"
        )
    values = memory_budget // bytes_per_value
    # R_ℓ = c / √N_ℓ with c chosen so that Σ R_ℓ N_ℓ = Σ c √N_ℓ fills the budget; then
    # clamp to [1, rows] and hand what clamping freed to the unclamped layers.
    ranks: dict[str, int] = {}
    free = dict(widths)
    while free:
        left = values - sum(ranks[n] * widths[n] for n in ranks)
        scale = left / sum(math.sqrt(w) for w in free.values())
        clamped = {n: w for n, w in free.items() if not 1 <= scale / math.sqrt(w) <= rows}
        if not clamped:
            ranks.update({n: max(1, int(scale / math.sqrt(w))) for n, w in free.items()})
            break
        for name, width in clamped.items():
            ranks[name] = rows if scale / math.sqrt(width) > rows else 1
            del free[name]
    return {name: ranks[name] for name in widths}  # named_modules order
