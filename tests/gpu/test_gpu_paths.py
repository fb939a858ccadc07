"""The CUDA paths (issue 16, point 7): what `pytest -m gpu` checks on a machine with a GPU.

Every test here is marked `gpu` (tests/conftest.py skips them where CUDA is absent);
`benchmarks/gpu_check.sh` runs them, the `triton` ones as a step of their own:
- the Triton kernels on CUDA tensors, compiled (no `TRITON_INTERPRET`), against the torch
  reference, and a Llama sketched with `include="auto"` (fused SwiGLU MLPs and RMSNorms,
  sketched linears) whose gradients through the kernels equal the reference backend's;
- bf16 autocast on CUDA (`trainer.train.precision.autocast`): bf16 compute, fp32 master weights
  and gradients;
- AdamW on CUDA is torch's fused kernel (`trainer.train.optim.build_optimizer`) and updates like
  the per-parameter loop on the same gradients;
- a Llama (`recipes/llama-tiny.toml`) trained on the GPU by the worker loop in bf16 and in
  fp16 (its loss scaler on CUDA, the scaler's state in the snapshot), stopped at step 3 and
  continued: it ends where the uninterrupted run ends, its snapshots fp32;
- the same under FSDP2 on one GPU (an NCCL group of one rank): `fully_shard` with bf16's
  `MixedPrecisionPolicy` on CUDA, stopped and continued, ends where the whole run ends.

The kernel checks are written for any device (`_kernel_checks(device)`): on a CPU under
Triton's interpreter they are the same code tests/sketch/test_sketch_triton.py runs there.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from snapshot_compare import final_state, relative_difference
from torch import nn

from trainer.config import OptimConfig, load_recipe

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny.toml"
LLAMA = ROOT / "recipes" / "llama-tiny.toml"
CUDA = torch.device("cuda")
# A bf16 run stopped and continued against the uninterrupted one, relative over the whole
# model (as test_trainer_precision's BF16_P1: 10x below what bf16 itself changes).
BF16_RESUME = 1e-4


def _kernel_checks(device: torch.device) -> None:
    """`kernels.row_keys`, `kernels.bucket_sum` and `kernels.weight_grad` against the torch
    versions on `device`; plans drawn on `device` (`make_plan`, `kernels.plan_orders`) equal
    those drawn on the CPU."""
    from sketch_ops import kernels, plan_hash, reference
    from sketch_ops.seeds import make_plan

    cpu = torch.device("cpu")
    for n, seed in ((0, 1), (1, 0), (1000, 5), (1025, 2**62 + 12345), (70_000, 2**63 - 1)):
        got_keys, got_signs = kernels.row_keys(n, seed, device)
        want_keys, want_signs = plan_hash.hash_rows(n, seed, cpu)
        assert torch.equal(got_keys.cpu(), want_keys) and torch.equal(got_signs.cpu(), want_signs)
    for n, rank in ((100, 7), (16384, 256)):
        on_device, on_cpu = make_plan(n, rank, seed=9, device=device), make_plan(n, rank, seed=9)
        for got, want in zip(on_device.tensors(), on_cpu.tensors(), strict=True):
            assert got.device.type == device.type and torch.equal(got.cpu(), want)
    # The fused path's plans, a microbatch's drawn together (32 seeds per keys launch, then
    # the rest padded), each bitwise the order of its seed's keys on the CPU.
    seeds = [2**63 - 1 - 7919 * j for j in range(35)]
    for n, batch in ((0, seeds[:2]), (1000, seeds), (70_000, seeds[:3])):
        orders = kernels.plan_orders(n, batch, device)
        assert orders.shape == (len(batch), n) and orders.device.type == device.type
        for seed, order in zip(batch, orders.cpu(), strict=True):
            assert torch.equal(order, torch.argsort(plan_hash.hash_rows(n, seed, cpu)[0]))
    torch.manual_seed(0)
    # (rows, columns, rank, balanced hash); the last is a real microbatch (8 x 1024 tokens).
    cases = [(37, 24, 5, True), (40, 70, 40, True), (64, 130, 1, True), (300, 16, 16, True),
             (90, 40, 7, False), (0, 8, 3, True), (8192, 256, 512, True)]
    for n, n_in, rank, balanced in cases:
        plan = make_plan(n, rank, seed=n + rank, balanced=balanced, device=device)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(n, n_in, device=device).to(dtype)
            got, got_sq = kernels.bucket_sum(x, plan)
            want, want_sq = reference.bucket_sum(x, plan)
            assert got.dtype == torch.float32 and got.shape == want.shape, (n, n_in, dtype)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got_sq, want_sq, rtol=2e-4, atol=1e-5)  # 2M-term sums
        wide = torch.randn(n, n_in + 9, device=device)[:, 3 : 3 + n_in]  # a strided view
        torch.testing.assert_close(kernels.bucket_sum(wide, plan)[0],
                                   reference.bucket_sum(wide, plan)[0], rtol=1e-4, atol=1e-4)
    for rank, n_out, n_in in ((5, 24, 37), (33, 70, 20), (1, 16, 16), (512, 704, 256)):
        dy_s, x_s = torch.randn(rank, n_out, device=device), torch.randn(rank, n_in,
                                                                         device=device)
        scale = torch.tensor(0.37)
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
            got = kernels.weight_grad(dy_s, x_s.to(dtype), scale, dtype)
            want = reference.weight_grad(dy_s, x_s.to(dtype), scale, dtype)
            assert got.dtype == dtype
            # fp32 sums in another order may round to the neighbouring bf16 value.
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def _sketched_llama_grads(device: torch.device, backend: str,
                          monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The gradients of recipes/llama-tiny.toml's model, sketched with include="auto" (its
    SwiGLU MLPs and RMSNorms fused), for one microbatch, through `backend`."""
    from sketch_ops import dispatch, sketch_seed
    from trainer.train.model_build import build_model, loss_function

    monkeypatch.setenv(dispatch.BACKEND_ENV, backend)
    cfg = load_recipe(LLAMA, ["snapshots.run_uri=unused", "sketch.rank=16"])
    model = build_model(cfg, device)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, cfg.data.seq_len),
                           generator=torch.Generator().manual_seed(1)).to(device)
    with sketch_seed(3, 0):
        loss_function(cfg)(model, tokens).backward()
    return [p.grad.detach().cpu() for p in model.parameters() if p.grad is not None]


@pytest.mark.gpu
def test_triton_kernels_match_the_reference_on_cuda() -> None:
    pytest.importorskip("triton")
    _kernel_checks(CUDA)


@pytest.mark.gpu
def test_triton_sketched_llama_matches_the_reference_backend_on_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("triton")
    pytest.importorskip("transformers")
    through_kernels = _sketched_llama_grads(CUDA, "auto", monkeypatch)  # auto: kernels on CUDA
    reference = _sketched_llama_grads(CUDA, "torch", monkeypatch)
    assert len(through_kernels) == len(reference) > 0
    for got, want in zip(through_kernels, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_bf16_autocast_on_cuda_computes_in_bf16_with_fp32_weights_and_gradients() -> None:
    from trainer.train.model_build import build_model, loss_function
    from trainer.train.precision import autocast

    losses = {}
    for dtype in ("fp32", "bf16"):
        cfg = load_recipe(TINY, ["snapshots.run_uri=unused", f'precision.dtype="{dtype}"',
                                 "model.vocab_size=256"])
        model = build_model(cfg, CUDA)
        tokens = torch.randint(0, 256, (4, cfg.data.seq_len),
                               generator=torch.Generator().manual_seed(0)).to(CUDA)
        saved: list[torch.dtype] = []

        def pack(t: torch.Tensor, saved: list[torch.dtype] = saved) -> torch.Tensor:
            saved.append(t.dtype)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                autocast(model, dtype, CUDA):
            loss = loss_function(cfg)(model, tokens)
        loss.backward()
        assert loss.dtype == torch.float32
        assert (torch.bfloat16 in saved) == (dtype == "bf16"), (dtype, set(saved))
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32 and p.grad is not None, name
            assert p.grad.dtype == torch.float32, name
        losses[dtype] = loss.item()
    assert losses["bf16"] != losses["fp32"]
    assert abs(losses["bf16"] - losses["fp32"]) < 0.02 * losses["fp32"], losses


@pytest.mark.gpu
def test_adamw_is_fused_on_cuda_and_updates_like_the_per_parameter_loop() -> None:
    from trainer.train.optim import build_optimizer

    torch.manual_seed(0)
    on_cpu = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    on_cuda = copy.deepcopy(on_cpu).to(CUDA)
    cfg = OptimConfig(lr=1e-2)
    fused, loop = build_optimizer(on_cuda, cfg), build_optimizer(on_cpu, cfg)
    assert all(group["fused"] for group in fused.param_groups)
    assert not any(group["fused"] for group in loop.param_groups)
    for _ in range(3):  # the same gradients into both: only the update kernels differ
        on_cpu(torch.randn(16, 32)).square().mean().backward()
        for mine, theirs in zip(on_cuda.parameters(), on_cpu.parameters(), strict=True):
            mine.grad = theirs.grad.to(CUDA)
        fused.step()
        loop.step()
        fused.zero_grad(set_to_none=True)
        loop.zero_grad(set_to_none=True)
    for mine, theirs in zip(on_cuda.parameters(), on_cpu.parameters(), strict=True):
        torch.testing.assert_close(mine.detach().cpu(), theirs.detach(), rtol=1e-5, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fused.state[mine][key].cpu(), loop.state[theirs][key],
                                       rtol=1e-5, atol=1e-7)


STEPS = 8


def _train_llama(rank: int, world_size: int, run: str, dataset: str, dtype: str,
                 parallelism: str, stop_after: int | None) -> None:
    """One worker of the Llama recipe on GPU `rank` (a spawned rank of `run_group`, or the
    test's own process for a single worker without a group)."""
    from trainer.train.loop import WorkerEnv, run_worker

    cfg = load_recipe(LLAMA, [f'snapshots.run_uri="{run}"', f'data.uri="{dataset}"',
                              f"steps={STEPS}", "eval.every=0", f'precision.dtype="{dtype}"',
                              f'parallelism="{parallelism}"'])
    run_worker(cfg, WorkerEnv(rank=rank, world_size=world_size, device=torch.device("cuda", rank),
                              stop_after=stop_after))


def _check_resumed(tmp_path: Path, whole: Path, resumed: Path, dtype: str) -> None:
    """The stopped-and-continued run ends where the whole run ends; fp32 snapshots; fp16's
    loss scaler in them."""
    from elastic.store.snapshot_store import SnapshotStore

    a, b = final_state(whole, tmp_path, STEPS), final_state(resumed, tmp_path, STEPS)
    assert a.keys() == b.keys()
    for component in ("model.", "optim."):
        assert relative_difference(a, b, component) <= BF16_RESUME, component
    manifest = SnapshotStore(str(resumed)).load_manifest(STEPS)
    floats = {r.dtype for r in manifest.tensors.values() if r.dtype in ("F32", "BF16", "F16")}
    assert floats == {"F32"}, "snapshots keep fp32 master weights and optimizer state"
    assert ("scaler" in manifest.state) == (dtype == "fp16"), sorted(manifest.state)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_llama_trained_on_cuda_resumes_where_the_whole_run_ends(
    tmp_path: Path, tiny_dataset: str, dtype: str,
) -> None:
    pytest.importorskip("transformers")
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    for run, stop_after in ((whole, None), (resumed, 3), (resumed, None)):
        _train_llama(0, 1, str(run), tiny_dataset, dtype, "ddp", stop_after)
    _check_resumed(tmp_path, whole, resumed, dtype)


@pytest.mark.gpu
def test_fsdp2_on_one_gpu_in_bf16_resumes_where_the_whole_run_ends(
    tmp_path: Path, tiny_dataset: str,
) -> None:
    """FSDP2 on CUDA (an NCCL group of one rank: `fully_shard` with bf16's mixed-precision
    policy on the GPU), stopped at step 3 and continued."""
    pytest.importorskip("transformers")
    from elastic.testing import run_group

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    for run, stop_after in ((whole, None), (resumed, 3), (resumed, None)):
        run_group(_train_llama, 1, str(run), tiny_dataset, "bf16", "fsdp", stop_after,
                  tmp_dir=str(tmp_path), backend="nccl")
    _check_resumed(tmp_path, whole, resumed, "bf16")
