"""The Triton kernels match the torch reference, run by Triton's CPU interpreter.

`TRITON_INTERPRET` is read when `@triton.jit` decorates a kernel, i.e. when
`sketch_ops.kernels` is first imported, so the checks run in a fresh subprocess with the
variable set (and `BATON_SKETCH_BACKEND=triton`, so the layer itself goes through the kernels).
Shapes are small: the interpreter executes every program instance in Python.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

CHECKS = textwrap.dedent(
    """
    import torch
    from sketch_ops import dispatch, kernels, reference, sketched_linear
    from sketch_ops.seeds import make_plan

    assert dispatch.backend() == "triton"
    from sketch_ops import plan_hash
    for n, seed in ((0, 1), (1, 0), (1000, 5), (1025, 2**62 + 12345), (3000, 2**63 - 1)):
        keys, signs = kernels.row_keys(n, seed, torch.device("cpu"))
        want_keys, want_signs = plan_hash.hash_rows(n, seed, torch.device("cpu"))
        assert torch.equal(keys, want_keys) and torch.equal(signs, want_signs), (n, seed)
    torch.manual_seed(0)
    # (rows, columns, rank, balanced hash, low-precision dtypes too)
    cases = [(37, 24, 5, True, True), (40, 70, 40, True, False), (64, 130, 1, True, False),
             (300, 16, 16, True, False), (90, 40, 7, False, True), (0, 8, 3, True, False)]
    for n, n_in, rank, balanced, low_precision in cases:
        plan = make_plan(n, rank, seed=n + rank, balanced=balanced)
        dtypes = [torch.float32] + ([torch.bfloat16, torch.float16] if low_precision else [])
        for dtype in dtypes:
            x = torch.randn(n, n_in).to(dtype)
            got, got_sq = kernels.bucket_sum(x, plan)
            want, want_sq = reference.bucket_sum(x, plan)
            assert got.dtype == torch.float32 and got.shape == want.shape, (got.shape, want.shape)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_sq, want_sq, rtol=1e-5, atol=1e-5)
        # A row stride that is not the row length (a column slice of a wider tensor).
        wide = torch.randn(n, n_in + 9)[:, 3 : 3 + n_in]
        torch.testing.assert_close(kernels.bucket_sum(wide, plan)[0],
                                   reference.bucket_sum(wide, plan)[0], rtol=1e-5, atol=1e-5)

    for rank, n_out, n_in in ((5, 24, 37), (33, 70, 20), (1, 16, 16)):
        dy_s, x_s = torch.randn(rank, n_out), torch.randn(rank, n_in)
        scale = torch.tensor(0.37)
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
            got = kernels.weight_grad(dy_s, x_s.to(dtype), scale, dtype)
            want = reference.weight_grad(dy_s, x_s.to(dtype), scale, dtype)
            assert got.dtype == dtype
            # bf16 output: fp32 sums in another order may round to the neighbouring bf16 value.
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)

    # The whole layer and the fused MLP through the kernels equal the reference path.
    import os
    from sketch_ops import SketchedLinear, blocked, gelu_mlp, sketch_seed

    blocked.BLOCK_ROWS = 16  # several row blocks
    fc, proj = SketchedLinear(24, 40, rank=6, name="fc"), SketchedLinear(40, 24, rank=5, name="p")
    x = torch.randn(3, 20, 24, requires_grad=True)
    g = torch.randn(3, 20, 24)

    def grads():
        for t in (x, *fc.parameters(), *proj.parameters()):
            t.grad = None
        with sketch_seed(1, 2):
            sketched_linear(x, fc.weight, fc.bias, rank=6, seed=99).square().sum().backward()
            gelu_mlp(fc, proj, x).backward(g)
        return [t.grad.clone() for t in (x, *fc.parameters(), *proj.parameters())]

    kernel_grads = grads()
    os.environ["BATON_SKETCH_BACKEND"] = "torch"
    for got, want in zip(kernel_grads, grads()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    print("KERNELS OK")
    """
)


def test_kernels_match_reference_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "BATON_SKETCH_BACKEND": "triton"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "KERNELS OK" in proc.stdout


def test_backend_override_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    from sketch_ops import dispatch

    monkeypatch.setenv(dispatch.BACKEND_ENV, "cuda-please")
    with pytest.raises(ValueError, match="BATON_SKETCH_BACKEND"):
        dispatch.backend()


@pytest.mark.gpu
def test_cuda_layer_matches_cpu_and_kernels_match_reference() -> None:
    import torch

    from sketch_ops import SketchedLinear, kernels, reference, sketch_seed
    from sketch_ops.seeds import make_plan

    plan = make_plan(4096, 64, seed=5, device=torch.device("cuda"))
    x = torch.randn(4096, 300, device="cuda")
    got, got_sq = kernels.bucket_sum(x, plan)
    want, want_sq = reference.bucket_sum(x, plan)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(got_sq, want_sq, rtol=1e-5, atol=0)
    # Same seed, same sketch on CPU and CUDA: the layer's gradients agree across devices.
    layer = SketchedLinear(300, 200, rank=64, name="l")
    xs = torch.randn(8, 512, 300)
    grads = []
    for device in ("cpu", "cuda"):
        layer.to(device).zero_grad(set_to_none=True)
        with sketch_seed(1, 2):
            layer(xs.to(device)).square().sum().backward()
        # A copy: .cpu() of a CPU tensor is itself, and the next .to() moves it to the GPU.
        grads.append(layer.weight.grad.detach().to("cpu", copy=True))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-3, atol=1e-3)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert layer(xs.cuda()).dtype == torch.bfloat16
