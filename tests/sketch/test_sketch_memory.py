"""What BASIS keeps for backward: an R × N sketch and a seed, independent of the number of rows
n (nn.Linear keeps the n × N input), and what that does to the whole built-in GPT."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sketch_ops import SketchedLinear, sketch_model, sketch_seed
from sketch_ops.memory import saved_bytes
from trainer.config import ModelConfig
from trainer.train.model import GPT, SKETCH_LAYERS

SEED_BYTES = 8  # the seed travels as one int64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sketched_layer_saves_rank_times_in_features(dtype: torch.dtype) -> None:
    n_in, n_out, rank = 48, 20, 8
    sketched = SketchedLinear(n_in, n_out, rank=rank).to(dtype)
    plain = nn.Linear(n_in, n_out).to(dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    for n in (64, 256):  # n grows 4x
        x = torch.randn(n, n_in).to(dtype).requires_grad_()
        got = saved_bytes(lambda x=x: sketched(x), sketched)
        # The R × N sketch, the seed and (centred estimator) the fp32 row mean of the input.
        assert got == rank * n_in * itemsize + n_in * 4 + SEED_BYTES
        assert saved_bytes(lambda x=x: plain(x), plain) == n * n_in * itemsize


def test_sketched_gpt_saves_well_under_half_of_exact() -> None:
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2)
    tokens = torch.randint(0, 64, (4, 65))
    torch.manual_seed(0)
    exact = GPT(cfg, seq_len=64)
    sketched = GPT(cfg, seq_len=64)
    sketch_model(sketched, rank=8, include=SKETCH_LAYERS)
    with sketch_seed(0, 0):
        exact_bytes = saved_bytes(lambda: exact.loss(tokens), exact)
        sketched_bytes = saved_bytes(lambda: sketched.loss(tokens), sketched)
    # Per block and token, in d-wide rows: exact keeps 14 (the two norm inputs, qkv, attention's
    # output, and GELU's 4d input and output), sketched 6 (the MLP keeps only the residual
    # input), see docs/basis.md.
    assert sketched_bytes < 0.5 * exact_bytes


def test_gelu_mlp_keeps_only_its_input_and_the_proj_sketch() -> None:
    from sketch_ops import gelu_mlp

    n, d, rank = 128, 16, 4
    fc, proj = SketchedLinear(d, 4 * d, rank=rank), SketchedLinear(4 * d, d, rank=rank)
    both = nn.ModuleList([fc, proj])
    x = torch.randn(n, d, requires_grad=True)
    fused = saved_bytes(lambda: gelu_mlp(fc, proj, x), both)
    # x, proj's sketch and its input's row mean, 2 seeds (fc's mean is recomputed from x).
    assert fused == n * d * 4 + rank * 4 * d * 4 + 4 * d * 4 + 2 * SEED_BYTES
    unfused = saved_bytes(lambda: proj(torch.nn.functional.gelu(fc(x))), both)
    # GELU keeps its n x 4d input; each layer its sketch and seed.
    assert unfused == n * 4 * d * 4 + (rank + 1) * (d + 4 * d) * 4 + 2 * SEED_BYTES


def test_memory_benchmark_imports_and_lists_its_configurations() -> None:
    from benchmarks.sketch_memory.run import configurations

    names = [c["name"] for c in configurations([16, 64], [64])]
    assert names == [
        "exact",
        "exact-unfused",
        "checkpoint",
        "exact-recompute",
        "basis-R16",
        "basis-R64",
        "basis-all-R64",
        "speed-R64",
        "basis-R64+ckpt",
    ]


def test_the_benchmark_profile_counts_a_sketched_steps_extra_work() -> None:
    """`--profile`'s record of one step: ranked ops, op calls, and the host-side plan work a
    sketched step adds (the sketch plan is drawn per step: its row selection is a nonzero)."""
    from benchmarks.sketch_memory import worker as module

    base = {"checkpoint": False, "seq_len": 32, "batch": 1, "device": "cpu"}
    exact = module.profile_step(module.Trainee({"name": "exact", "rank": 0, **base}), top=4)
    sketched = module.profile_step(module.Trainee(
        {"name": "basis", "rank": 8, "include": ["blocks.*.mlp.proj"], **base}), top=4)
    for prof in (exact, sketched):
        assert prof["clock"] == "cpu" and len(prof["top_self_us"]) == 4
        # Ops and the profiler's own ranges (autograd nodes, Optimizer.step) alike.
        assert all(isinstance(row[0], str) and row[2] >= 1 for row in prof["top_self_us"])
        times = [row[1] for row in prof["top_self_us"]]
        assert times == sorted(times, reverse=True) and times[0] > 0
    assert "aten::nonzero" not in exact["sync_and_copy_calls"]
    assert sketched["sync_and_copy_calls"]["aten::nonzero"] >= 1
    assert sketched["op_calls"] > exact["op_calls"]
