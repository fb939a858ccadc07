"""Sketch seeds and plans: balanced buckets, reproducible from the seed, distinct per layer /
step / microbatch, identical under activation-checkpoint recompute."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from sketch_ops import SketchedLinear, blocked, reference, sketch_seed
from sketch_ops import function as sketch_function
from sketch_ops.seeds import active_seed_state, derive_seed, layer_seed, make_plan


@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize(("n", "rank"), [(10, 3), (64, 64), (100, 7), (5, 1), (3, 50), (0, 4)])
def test_buckets_and_signs(n: int, rank: int, balanced: bool) -> None:
    plan = make_plan(n, rank, seed=42, balanced=balanced)
    assert plan.rank == max(1, min(rank, n))
    counts = torch.bincount(plan.hash, minlength=plan.rank)
    if balanced:
        assert set(counts.tolist()) <= {n // plan.rank, -(-n // plan.rank)}
    assert int(counts.sum()) == n  # every row in exactly one bucket
    assert set(plan.signs.tolist()) <= {-1.0, 1.0}
    # The bucket-major (CSR) form lists the same buckets.
    assert sorted(plan.rows.tolist()) == list(range(n))
    for r in range(plan.rank):
        bucket_rows = plan.rows[plan.offsets[r] : plan.offsets[r + 1]]
        assert torch.equal(plan.hash[bucket_rows], torch.full_like(bucket_rows, r))


@pytest.mark.parametrize(("n", "rank", "size"), [(100, 7, 16), (64, 64, 64), (37, 5, 100),
                                               (4096, 64, 2048), (10, 3, 1)])
def test_row_blocks_sketch_the_plan_a_block_at_a_time(n: int, rank: int, size: int) -> None:
    plan = make_plan(n, rank, seed=n * rank + size)
    mat = torch.randn(n, 6, dtype=torch.float64)
    blocks = plan.row_blocks(size)
    starts = range(0, n, size)
    assert len(blocks) == len(starts)
    total = torch.zeros(plan.rank, 6, dtype=torch.float64)
    for start, block in zip(starts, blocks, strict=True):
        end = min(start + size, n)
        assert torch.equal(block.hash, plan.hash[start:end])
        assert sorted(block.rows.tolist()) == list(range(end - start))
        for r in range(plan.rank):  # CSR: bucket r lists the block's rows in bucket r
            bucket_rows = block.rows[block.offsets[r] : block.offsets[r + 1]]
            assert torch.equal(block.hash[bucket_rows], torch.full_like(bucket_rows, r))
        total += reference.bucket_sum(mat[start:end], block)[0]
    torch.testing.assert_close(total, reference.bucket_sum(mat, plan)[0], rtol=0, atol=1e-12)


def test_fused_functions_block_by_rows_on_cpu_and_by_bytes_on_a_gpu() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")  # only the device type is read
    many = 10**8  # rows: blocks of the largest size allowed, up to rounding
    cap = blocked.BLOCK_ROWS
    assert cap - 1 <= blocked.block_size(many, 1024, torch.float32, cpu) <= cap
    # On a GPU: as many rows as fit GPU_BLOCK_BYTES of the widest temporary, at least BLOCK_ROWS.
    for width, dtype, cap in ((1024, torch.float32, blocked.GPU_BLOCK_BYTES // 4096),
                              (1024, torch.bfloat16, blocked.GPU_BLOCK_BYTES // 2048),
                              (10**7, torch.float32, blocked.BLOCK_ROWS)):
        assert cap * 0.99 <= blocked.block_size(many, width, dtype, gpu) <= cap
    # Fewer rows than a block: one block. More: equal blocks, none ragged (4 112 rows on the
    # CPU: 1 371 + 1 371 + 1 370, not 2 048 + 2 048 + 16).
    assert blocked.block_size(100, 1024, torch.float32, cpu) == 100
    assert blocked.block_size(0, 1024, torch.float32, cpu) == 1
    size = blocked.block_size(4112, 1024, torch.float32, cpu)
    assert [b - a for a, b in blocked.row_blocks(4112, size)] == [1371, 1371, 1370]
    for n in (2049, 4097, 10_000, 123_457):
        sizes = [b - a for a, b in blocked.row_blocks(n, blocked.block_size(n, 64, torch.float32,
                                                                            cpu))]
        assert sum(sizes) == n and max(sizes) <= blocked.BLOCK_ROWS
        assert len(sizes) == -(-n // blocked.BLOCK_ROWS) and max(sizes) - min(sizes) < len(sizes)
    assert blocked.row_blocks(5, 2) == [(0, 2), (2, 4), (4, 5)] and blocked.row_blocks(0, 2) == []


def test_seeds_differing_in_low_bits_give_unrelated_plans() -> None:
    # Neighbouring seeds (the Monte Carlo tests draw seeds k, k + 1, ...) must not give
    # relabelings of one permutation: their buckets agree on about 1/R of the rows.
    n, rank = 4096, 16
    plans = [make_plan(n, rank, seed=s) for s in range(8)]
    for a, b in itertools.combinations(plans, 2):
        agree = float((a.hash == b.hash).double().mean())
        assert abs(agree - 1 / rank) < 0.03, agree
        assert abs(float((a.signs == b.signs).double().mean()) - 0.5) < 0.05


def test_plan_is_a_pure_function_of_the_seed() -> None:
    a, b, c = make_plan(200, 9, seed=5), make_plan(200, 9, seed=5), make_plan(200, 9, seed=6)
    assert torch.equal(a.hash, b.hash) and torch.equal(a.signs, b.signs)
    assert not (torch.equal(a.hash, c.hash) and torch.equal(a.signs, c.signs))


def test_derived_seeds_are_stable_and_distinct() -> None:
    # A fixed value: blake2b is the same on every machine and Python run (hash() is salted).
    assert derive_seed(0, 0, 0, "lm_head") == derive_seed(0, 0, 0, "lm_head")
    assert derive_seed(0, 0, 0, "lm_head") == 8970629504656615474  # pinned: resumes rely on it
    seeds = {
        derive_seed(s, step, mb, name)
        for s in (0, 1)
        for step in (0, 1)
        for mb in (0, 1)
        for name in ("blocks.0.mlp.fc", "blocks.1.mlp.fc")
    }
    assert len(seeds) == 16
    assert all(0 <= s < 2**63 for s in seeds)


def test_layer_seed_inside_and_outside_the_context() -> None:
    assert active_seed_state() is None
    with sketch_seed(3, 4, 5) as state:
        assert active_seed_state() == state
        assert layer_seed("a") == derive_seed(3, 4, 5, "a")
        with sketch_seed(3, 4, 6):
            assert layer_seed("a") == derive_seed(3, 4, 6, "a")
        assert layer_seed("a") == derive_seed(3, 4, 5, "a")
    assert active_seed_state() is None
    assert layer_seed("a") != layer_seed("a")  # fresh randomness per call


def test_sketch_seed_validates() -> None:
    with pytest.raises(ValueError, match="step"):
        with sketch_seed(0, -1):
            pass
    with pytest.raises(ValueError, match="seed"):
        with sketch_seed("0", 1):  # type: ignore[arg-type]
            pass


class _Net(nn.Module):
    def __init__(self, use_checkpoint: bool) -> None:
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.a = SketchedLinear(8, 16, rank=3, name="a")
        self.b = SketchedLinear(16, 4, rank=3, name="b")

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_checkpoint:
            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


def _train_once(use_checkpoint: bool, in_context: bool) -> _Net:
    torch.manual_seed(0)
    net = _Net(use_checkpoint)
    x = torch.randn(40, 8)
    torch.manual_seed(123)  # outside the context, seeds come from the global generator
    if in_context:
        with sketch_seed(9, 2, 1):
            net(x).square().sum().backward()
    else:
        net(x).square().sum().backward()
    return net


@pytest.mark.parametrize("in_context", [True, False])
def test_checkpoint_recompute_reproduces_the_sketch(
    in_context: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    seeds: list[int] = []
    real = sketch_function.make_plan

    def spy(n: int, rank: int, seed: int, **kwargs: object):
        seeds.append(seed)
        return real(n, rank, seed, **kwargs)

    monkeypatch.setattr(sketch_function, "make_plan", spy)
    plain = _train_once(False, in_context)
    seeds.clear()
    recomputed = _train_once(True, in_context)
    # forward a, b; recompute a, b; backward b, a: every plan of a layer from one seed.
    assert len(seeds) == 6
    assert seeds[0] == seeds[2] == seeds[5] and seeds[1] == seeds[3] == seeds[4]
    assert seeds[0] != seeds[1]
    for name in ("a", "b"):
        got = getattr(recomputed, name).weight.grad
        torch.testing.assert_close(got, getattr(plain, name).weight.grad, rtol=0, atol=0)


def test_different_steps_and_microbatches_give_different_gradients() -> None:
    layer = SketchedLinear(8, 4, rank=2, name="l")
    x = torch.randn(30, 8)
    grads = []
    for step, microbatch in [(0, 0), (1, 0), (0, 1), (0, 0)]:
        layer.weight.grad = None
        with sketch_seed(0, step, microbatch):
            layer(x).square().sum().backward()
        grads.append(layer.weight.grad.clone())
    assert torch.equal(grads[0], grads[3])
    assert not torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])
