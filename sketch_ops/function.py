"""`sketched_linear`: a linear layer whose weight gradient comes from a BASIS sketch.

`sketched_linear(x, weight, bias, *, rank, seed)` returns exactly `F.linear(x, weight, bias)`.
In backward dX = dY W and db = Σ rows of dY are exact; dW is the BASIS estimate
`γdy γx (S dY)ᵀ (S X)` (docs/design.md §4), x and dY flattened to n rows, S the R × n sketch
expanded from `seed` (`seeds.make_plan`, the same S for both), γ = ||·||_F / (||S ·||_F + 1e-8)
the invariant scalars. R is clamped to n; at R = n (a signed permutation) dW is exact.

Saved for backward: the R × N sketch X̂ = γx S X (in x's dtype), a reference to the weight (no
copy) and the seed as a one-element int64 tensor, from which backward regenerates S (and, for
the centred estimator, the N-vector of row means). Not x, not the hash. Bucket sums and norms
accumulate in fp32.

Two paths, chosen by `dispatch.fused_on`: the torch reference (CPU, fp64, the uniform hash)
runs `reference.py`'s functions; the fused path (CUDA, fp32/bf16/fp16, balanced plans,
`fused_kernels.py`) runs a layer's step in 5 device launches and no host read, plus its share
of the plans drawn inside `sketch_seed` (`plan_cache`), and saves S̃X unscaled, a few partial
sums for γx and the plan's order as int32 (4n bytes) instead of drawing it again
(docs/basis.md, "The fused sketch path (CUDA)").

Estimators (`estimator=`): `"basis"`, the estimate above; `"centered"` (the default), the same
sketch of the centred rows plus the exact rank-1 term `n μdy μxᵀ` (the identity and its error:
docs/design.md §4), smaller whenever the rows share a mean; it saves μx (N numbers) more, μdy
comes free from db.

Approximation: dW is a randomised estimate, unbiased for any fixed hash without the scalars,
slightly biased but norm-stable with them (the default, as in BASIS); `invariant_scalars=False`
and `balanced_hash=False` (a uniform i.i.d. hash) exist to test that.
Under autocast the inputs are cast to the autocast dtype first (as `F.linear` would be), and
the sketch runs with autocast off so forward and backward dtypes agree.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from . import dispatch, reference
from .seeds import SketchPlan, effective_rank, make_plan, plan_order

ESTIMATORS = ("basis", "centered")


def check_estimator(estimator: str) -> None:
    """Raise ValueError unless `estimator` is one of ESTIMATORS."""
    if estimator not in ESTIMATORS:
        raise ValueError(
            f"sketch estimator must be one of {', '.join(map(repr, ESTIMATORS))}, got {estimator!r}"
        )


def input_sketch(
    sketch: torch.Tensor,
    sq_norm: torch.Tensor,
    row_sum: torch.Tensor | None,
    plan: SketchPlan,
    n: int,
    *,
    invariant_scalars: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What backward needs of the input X: from `S X`, `||X||²` and, for the centred estimator,
    X's column sums (None for BASIS), the scaled sketch X̂ (accumulation dtype) and X's row
    mean (None for BASIS). Shared by the layer and the fused MLP."""
    mean = None
    if row_sum is not None:
        mean = row_sum / max(n, 1)
        counts = reference.signed_counts(plan)
        sketch, sq_norm = reference.center(sketch, sq_norm, mean, counts, n)
    if invariant_scalars:
        sketch = sketch.mul_(reference.invariant_scale(sq_norm, sketch))
    return sketch, mean


def weight_grad_estimate(
    dy_sketch: torch.Tensor,
    dy_sq_norm: torch.Tensor,
    dy_sum: torch.Tensor | None,
    x_hat: torch.Tensor,
    x_mean: torch.Tensor | None,
    plan: SketchPlan,
    n: int,
    *,
    invariant_scalars: bool = True,
) -> torch.Tensor:
    """The estimate of dYᵀX (accumulation dtype) from `S dY`, `||dY||²`, dY's column sums (only
    read when centred) and what `input_sketch` returned: BASIS when `x_mean` is None, else the
    centred estimator."""
    dy_mean = None
    if x_mean is not None:
        assert dy_sum is not None, "the centred estimator needs dY's column sums"
        dy_mean = dy_sum / max(n, 1)
        counts = reference.signed_counts(plan)
        dy_sketch, dy_sq_norm = reference.center(dy_sketch, dy_sq_norm, dy_mean, counts, n)
    scale = (
        reference.invariant_scale(dy_sq_norm, dy_sketch)
        if invariant_scalars
        else torch.ones((), dtype=dy_sq_norm.dtype, device=dy_sketch.device)
    )
    grad = dispatch.weight_grad(dy_sketch, x_hat, scale, dy_sketch.dtype)
    if dy_mean is not None and x_mean is not None:
        grad = grad.add_(reference.mean_outer(dy_mean, x_mean, n))
    return grad


def fused_input_sketch(
    kernels: ModuleType, x2d: torch.Tensor, rank: int, seed: int, centred: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The fused path's forward sketch of X (`fused_kernels`: one launch, and the plan's two
    unless `seeds.plan_order` holds it): what backward needs, `(S̃X unscaled in X's dtype, μx
    or None, the partial sums of the invariant scalar, the plan's order as int32)`."""
    n = x2d.shape[0]
    order = plan_order(kernels, n, seed, x2d.device)
    order32 = torch.empty(n, dtype=torch.int32, device=x2d.device)
    sketch = kernels.BlockSketch(n, rank, seed, x2d.shape[1], order, center=centred,
                                 dtype=x2d.dtype, order_out=order32)
    sketch.add(0, n, x2d)
    done = sketch.finish()
    return done.values, done.mean, done.stats, order32


def fused_weight_grad(
    kernels: ModuleType,
    dy: torch.Tensor,
    saved: tuple[torch.Tensor | None, ...],
    rank: int,
    seed: int,
    *,
    scalars: bool,
    dtype: torch.dtype,
    need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(dW in dtype, db or None)` from dY and what `fused_input_sketch` saved: one launch
    sketches dY (and sums its columns: db, and μdy when centred), one runs the GEMM."""
    x_hat, x_mean, stats, order = saved
    assert x_hat is not None and stats is not None and order is not None
    n, width = dy.shape
    db = torch.empty(width, dtype=dy.dtype, device=dy.device) if need_db else None
    sketch = kernels.BlockSketch(n, rank, seed, width, order, center=x_mean is not None,
                                 dtype=dy.dtype, sum_out=db)
    sketch.add(0, n, dy)
    dw = kernels.weight_grad(sketch.finish(), kernels.Sketch(x_hat, x_mean, stats), n,
                             scale=scalars, dtype=dtype)
    return dw, db


def check_rank(rank: int) -> None:
    """Raise ValueError unless `rank` is an int >= 1."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"sketch rank must be an int >= 1, got {rank!r}")


def validate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rank: int) -> None:
    """Raise ValueError for inputs `sketched_linear` cannot handle, naming the fix."""
    check_rank(rank)
    for name, tensor in (("input", x), ("weight", weight), ("bias", bias)):
        if tensor is not None and not tensor.is_floating_point():
            raise ValueError(
                f"sketched_linear: {name} must be a floating-point tensor, got {tensor.dtype}; "
                "cast it with .float() (or .to(torch.bfloat16))"
            )
    if weight.dim() != 2:
        raise ValueError(
            f"sketched_linear: weight must be 2-D (out, in), got {tuple(weight.shape)}"
        )
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"sketched_linear: input's last dimension must equal in_features={weight.shape[1]}, "
            f"got input shape {tuple(x.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"sketched_linear: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}"
        )


class _SketchedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x2d: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rank: int,
        seed: int,
        estimator: str,
        invariant_scalars: bool,
        balanced_hash: bool,
    ) -> torch.Tensor:
        out = F.linear(x2d, weight, bias)
        n = x2d.shape[0]
        x_hat = x_mean = stats = order = None
        fused = dispatch.fused_on(x2d.device, x2d.dtype) if balanced_hash and n else None
        if ctx.needs_input_grad[1] and fused is not None:
            x_hat, x_mean, stats, order = fused_input_sketch(
                fused, x2d, rank, seed, estimator == "centered")
        elif ctx.needs_input_grad[1]:
            plan = make_plan(n, rank, seed, balanced=balanced_hash, device=x2d.device)
            sketch, sq_norm = dispatch.bucket_sum(x2d, plan)
            row_sum = x2d.sum(0, dtype=sketch.dtype) if estimator == "centered" else None
            sketch, x_mean = input_sketch(
                sketch, sq_norm, row_sum, plan, n, invariant_scalars=invariant_scalars
            )
            x_hat = sketch.to(x2d.dtype)
        # The seed travels as a saved tensor, not a ctx attribute: under activation
        # checkpointing the saved tensors come from the recompute, so seed and X̂ stay paired.
        seed_t = torch.tensor(seed, dtype=torch.int64)
        ctx.save_for_backward(x_hat, x_mean, stats, order, weight, seed_t)
        ctx.sketch_args = (n, rank, invariant_scalars, balanced_hash)
        return out

    @staticmethod
    def backward(
        ctx: Any, dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x_hat, x_mean, stats, order, weight, seed_t = ctx.saved_tensors
        n, rank, invariant_scalars, balanced_hash = ctx.sketch_args
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = dy @ weight.to(dy.dtype)
        fused = dispatch.fused_module() if order is not None else None  # forward's choice
        if ctx.needs_input_grad[1] and fused is not None:  # db from the sketch's own pass
            dw, db = fused_weight_grad(
                fused, dy, (x_hat, x_mean, stats, order), rank, int(seed_t),
                scalars=invariant_scalars, dtype=weight.dtype, need_db=ctx.needs_input_grad[2])
            return dx, dw, db, None, None, None, None, None
        dy_sum = None  # column sums of dY: db, and μdy when centred; one pass for both
        if ctx.needs_input_grad[2] or x_mean is not None:
            dy_sum = dy.sum(0, dtype=reference.acc_dtype(dy.dtype))
        if ctx.needs_input_grad[1]:
            plan = make_plan(n, rank, int(seed_t), balanced=balanced_hash, device=dy.device)
            dy_sketch, sq_norm = dispatch.bucket_sum(dy, plan)
            dw = weight_grad_estimate(
                dy_sketch, sq_norm, dy_sum, x_hat, x_mean, plan, n,
                invariant_scalars=invariant_scalars,
            ).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            assert dy_sum is not None  # computed above whenever db is needed
            db = dy_sum.to(dy.dtype)
        return dx, dw, db, None, None, None, None, None


def autocast_inputs(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Cast to the autocast dtype when autocast is on, as F.linear would (autocast casts
    floating tensors other than float64); check dtypes agree."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t

        x, weight = cast(x), cast(weight)
        bias = None if bias is None else cast(bias)
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(
            f"sketched_linear: input ({x.dtype}), weight ({weight.dtype}) and bias dtypes must "
            "match; cast the input or the layer (or use torch.autocast)"
        )
    return x, weight, bias


def needs_sketch(*tensors: torch.Tensor | None) -> bool:
    """Whether a call on `tensors` (inputs and parameters; None allowed) records a backward at
    all (no sketch work, no seed draw otherwise)."""
    if not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in tensors)


def sketched_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    rank: int,
    seed: int,
    estimator: str = "centered",
    invariant_scalars: bool = True,
    balanced_hash: bool = True,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` whose weight gradient is a rank-`rank` BASIS estimate.

    `seed` (any int; 63 bits used) fixes the sketch. `x` may have any number of leading
    dimensions; they are flattened to n rows for the sketch. `estimator` is `"basis"` or
    `"centered"` (module docstring). `invariant_scalars` and `balanced_hash` are analysis
    options; training uses the defaults.
    """
    validate(x, weight, bias, rank)
    check_estimator(estimator)
    if not needs_sketch(x, weight, bias):
        return F.linear(x, weight, bias)
    x, weight, bias = autocast_inputs(x, weight, bias)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    rank = effective_rank(rank, x2d.shape[0])
    with torch.autocast(x.device.type, enabled=False):
        out = _SketchedLinearFn.apply(
            x2d, weight, bias, rank, seed, estimator, invariant_scalars, balanced_hash
        )
    return out.reshape(*lead, weight.shape[0])
