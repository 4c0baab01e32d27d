"""The fused RMSNorm kernels (longctx/ops/rms_norm/triton.py) on the GPU against their torch twin
`RMSNormFn` (longctx/ops/rms_norm/naive.py): forward and backward in bf16 on fresh random inputs, rows
that are not a power of two wide, what each keeps for backward, and a model step with
`kernels.rms_norm = triton`. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("shape", [(2, 3001, 1536), (1, 517, 512), (4, 33, 768), (7, 100)])
def test_fused_rms_norm_matches_the_torch_twin(shape):
    """Same arithmetic, sums in another order: outputs and input gradients equal but for elements whose
    fp32 rstd differs in its last bit (one bf16 step), the weight gradient to fp32 summation order.
    The issue's bounds (5e-3 outputs, 2e-2 gradients) are far above what this should show: 1e-3 here."""
    from longctx.ops.rms_norm.naive import RMSNormFn
    from longctx.ops.rms_norm.triton import rms_norm_triton

    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed {seed}")
    g = torch.Generator(device="cuda").manual_seed(seed)
    x0 = (torch.randn(*shape, device="cuda", generator=g) * 3).bfloat16()
    w0 = 1 + 0.5 * torch.randn(shape[-1], device="cuda", generator=g)
    dy = torch.randn(*shape, device="cuda", generator=g).bfloat16()
    res = {}
    for tag, fn in (("torch", RMSNormFn.apply), ("triton", rms_norm_triton)):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        y = fn(x, w, 1e-6)
        y.backward(dy)
        res[tag] = (y.detach(), x.grad, w.grad)
    for what, a, b in zip(("y", "dx", "dw"), res["triton"], res["torch"]):
        assert a.dtype == b.dtype and a.shape == b.shape
        rel = _rel(a, b)
        print(f"{shape} {what}: rel-RMS {rel:.2e}")
        assert rel <= 1e-3, (shape, what, rel, seed)


def test_fused_rms_norm_keeps_what_the_torch_twin_keeps():
    """x in its own dtype and one fp32 rstd per row (memory.py's estimate counts that)."""
    from longctx.layers.norms import RMSNorm
    from longctx.measure.meter import SavedTensorMeter

    x = torch.randn(3, 1000, 1536, device="cuda").bfloat16().requires_grad_(True)
    kept = {}
    for impl in ("torch", "triton"):
        norm = RMSNorm(1536).cuda()
        norm.kernels["rms_norm"] = impl
        meter = SavedTensorMeter()
        with meter.measure():
            norm(x)
        kept[impl] = meter.total() - norm.weight.numel() * 4  # the weight is a parameter, not an activation
        assert norm.last_impl == f"norm:{impl}"
    assert kept["triton"] == kept["torch"] == x.numel() * 2 + 3000 * 4, kept


def test_model_step_with_the_fused_norm():
    """A bf16 step with norm_impl triton is as close to an fp32 step as with torch's norm (gradients of
    the whole model; tests/gpu_step_drift.py says why not triton against torch), and the step log says
    which ran."""
    from gpu_step_drift import assert_as_close_to_fp32, set_kernel, step_drift

    assert_as_close_to_fp32(step_drift(lambda m, impl: set_kernel(m, "rms_norm", impl)), "norm")
