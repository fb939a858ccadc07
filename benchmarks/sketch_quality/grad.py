"""The gradient-error table of `benchmarks/sketch_quality/run.py`: how far each estimator's weight
gradient is from the exact one, per layer of the GPT, after exact training on real text.

Besides the library's estimators ("basis", "centered") it measures two candidates from the
literature that keep the O(R·N) bound, implemented here only (kept out of the library unless
they help): "top-rows" keeps the R/2 rows of largest ‖x_i‖ exactly and sketches the rest into
R/2 buckets (as column-row-sampling methods keep their heaviest pairs), and "seq-centered"
centres each sequence on its own mean (b means instead of one). The driver runs `grad_error()`
in its own process, under the CPU lock.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import torch

from benchmarks.common_training import train_step
from benchmarks.sketch_quality.variants import DATA, MICROBATCH, N_ROWS, SEQ, variant
from benchmarks.sketch_quality.worker import build, selected
from sketch_ops import reference
from sketch_ops.seeds import make_plan

GRAD_STEPS, GRAD_DRAWS = 100, 8
KINDS = ("basis", "centered", "seq-centered", "top-rows")


def layer_pairs() -> dict[str, list[torch.Tensor]]:
    """Per linear layer, (input x, output gradient dy) as n × width float64 matrices, on one
    real microbatch after GRAD_STEPS exact training steps."""
    from data_state import ResumableLoader, TokenDataset

    torch.set_num_threads(1)
    # Unfused norms: the forward hooks below must see every linear layer's input.
    model, optimizer, schedule = build(dataclasses.replace(variant("exact"), fuse_norms=False), 0)
    loader = ResumableLoader(
        TokenDataset(str(DATA), "train"),
        global_batch=MICROBATCH,
        microbatch_size=MICROBATCH,
        seed=0,
    )
    for step in range(GRAD_STEPS):
        (mb,) = loader.next_step()
        train_step(model, optimizer, schedule, mb.tokens, 0, step)
        loader.advance()
    (mb,) = loader.next_step()
    loader.close()
    pairs: dict[str, list[torch.Tensor]] = {}

    def capture(name: str) -> Any:
        def hook(module: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
            pairs[name] = [inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()]
            output.register_hook(lambda g: pairs[name].append(g.reshape(-1, g.shape[-1]).double()))

        return hook

    for name, module in model.named_modules():
        if selected(name, module, None):
            module.register_forward_hook(capture(name))
    model.loss(mb.tokens).backward()
    return pairs


def _scaled(sketch: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
    return sketch * reference.invariant_scale(sq, sketch)


def estimate(kind: str, x: torch.Tensor, dy: torch.Tensor, rank: int, seed: int) -> Any:
    """The estimator `kind`'s dW = dyᵀx at `rank` with the sketch of `seed`."""
    n = x.shape[0]
    if kind == "top-rows":
        keep = x.norm(dim=1).topk(rank // 2).indices
        rest = torch.ones(n, dtype=torch.bool)
        rest[keep] = False
        exact_part = dy[keep].T @ x[keep]
        plan = make_plan(int(rest.sum()), rank - rank // 2, seed)
        sx, sdy = reference.bucket_sum(x[rest], plan), reference.bucket_sum(dy[rest], plan)
        return exact_part + _scaled(*sdy).T @ _scaled(*sx)
    plan = make_plan(n, rank, seed)
    if kind == "seq-centered":
        groups = torch.arange(n) // SEQ
        x_means = torch.zeros(n // SEQ, x.shape[1], dtype=x.dtype).index_add_(0, groups, x)
        dy_means = torch.zeros(n // SEQ, dy.shape[1], dtype=x.dtype).index_add_(0, groups, dy)
        x_means, dy_means = x_means / SEQ, dy_means / SEQ
        xc, dyc = x - x_means[groups], dy - dy_means[groups]
        sx, sdy = reference.bucket_sum(xc, plan), reference.bucket_sum(dyc, plan)
        return _scaled(*sdy).T @ _scaled(*sx) + SEQ * dy_means.T @ x_means
    sx, sdy = reference.bucket_sum(x, plan), reference.bucket_sum(dy, plan)
    if kind == "basis":
        return _scaled(*sdy).T @ _scaled(*sx)
    counts = reference.signed_counts(plan).double()
    x_mean, dy_mean = x.mean(0), dy.mean(0)
    sx = reference.center(*sx, x_mean, counts, n)
    sdy = reference.center(*sdy, dy_mean, counts, n)
    return _scaled(*sdy).T @ _scaled(*sx) + reference.mean_outer(dy_mean, x_mean, n)


def grad_error() -> dict[str, dict[str, float]]:
    """Relative squared error ‖dW_est − dW‖² / ‖dW‖² of each estimator, per layer and their
    mean, averaged over GRAD_DRAWS sketches, at R = n/16 and n/64."""
    pairs = layer_pairs()
    table: dict[str, dict[str, float]] = {}
    for kind in KINDS:
        for rank in (N_ROWS // 16, N_ROWS // 64):
            row = {}
            for name, (x, dy) in pairs.items():
                exact = dy.T @ x
                errors = [
                    float((estimate(kind, x, dy, rank, seed) - exact).square().sum())
                    for seed in range(GRAD_DRAWS)
                ]
                row[name] = statistics.fmean(errors) / float(exact.square().sum())
            row["mean"] = statistics.fmean(row.values())
            table[f"{kind} R={rank}"] = row
            print(f"grad error {kind} R={rank}: mean {row['mean']:.3f}", flush=True)
    return table
