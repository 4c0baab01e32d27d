"""The fused clamped-SwiGLU kernels (longctx/ops/swiglu/triton.py) on the GPU against their torch twins
`ClampedSwiGLU` / `ClampedSwiGLUPacked` (longctx/ops/swiglu/naive.py): forward and backward in bf16 on
fresh random inputs (widths that are not a multiple of the block, both layouts), what each keeps for
backward, and a model step with `kernels.swiglu = triton`. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LIMIT = 7.0


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("rows,width,packed", [(70001, 768, True), (4099, 4096, False), (517, 1100, False),
                                               (3, 33, True)])
def test_fused_swiglu_matches_the_torch_twin(rows, width, packed):
    """Every intermediate is rounded where torch rounds it, so outputs and gradients should differ only
    where the fp32 SiLU differs in its last bit (one bf16 step in a few elements): 1e-3 here, far inside
    the issue's bounds (5e-3 outputs, 2e-2 gradients)."""
    from longctx.ops.swiglu.naive import ClampedSwiGLU, ClampedSwiGLUPacked
    from longctx.ops.swiglu.triton import clamped_swiglu_packed_triton, clamped_swiglu_triton

    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed {seed}")
    g = torch.Generator(device="cuda").manual_seed(seed)
    gate = (torch.randn(rows, width, device="cuda", generator=g) * 5).bfloat16()
    up = (torch.randn(rows, width, device="cuda", generator=g) * 5).bfloat16()
    dy = torch.randn(rows, width, device="cuda", generator=g).bfloat16()
    res = {}
    if packed:
        h0 = torch.cat([gate, up], -1)
        for tag, fn in (("torch", lambda h: ClampedSwiGLUPacked.apply(h, LIMIT)),
                        ("triton", lambda h: clamped_swiglu_packed_triton(h, LIMIT))):
            h = h0.clone().requires_grad_(True)
            y = fn(h)
            y.backward(dy)
            res[tag] = {"y": y.detach(), "dh": h.grad}
    else:
        for tag, fn in (("torch", lambda a, b: ClampedSwiGLU.apply(a, b, LIMIT)),
                        ("triton", lambda a, b: clamped_swiglu_triton(a, b, LIMIT))):
            a, b = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
            y = fn(a, b)
            y.backward(dy)
            res[tag] = {"y": y.detach(), "dgate": a.grad, "dup": b.grad}
    for what, b in res["torch"].items():
        a = res["triton"][what]
        assert a.dtype == b.dtype and a.shape == b.shape
        rel = _rel(a, b)
        print(f"{rows}x{width} packed={packed} {what}: rel-RMS {rel:.2e}, {int((a != b).sum())} elements differ")
        assert rel <= 1e-3, (rows, width, what, rel, seed)


def test_fused_swiglu_keeps_what_the_torch_twin_keeps():
    """The packed input only (memory.model_bytes counts one [rows, 2I] row)."""
    from longctx.ops.swiglu import clamped_swiglu_packed
    from longctx.measure.meter import SavedTensorMeter

    h = torch.randn(4096, 2 * 768, device="cuda").bfloat16().requires_grad_(True)
    kept = {}
    for impl in ("torch", "triton"):
        meter = SavedTensorMeter()
        with meter.measure():
            clamped_swiglu_packed(h, LIMIT, impl)
        kept[impl] = meter.total()
    assert kept["triton"] == kept["torch"] == h.numel() * 2, kept


def test_model_step_with_the_fused_swiglu():
    """A bf16 step with swiglu_impl triton is as close to an fp32 step as with the torch SwiGLU
    (tests/gpu_step_drift.py), and the step log says which ran."""
    from gpu_step_drift import assert_as_close_to_fp32, set_kernel, step_drift

    assert_as_close_to_fp32(step_drift(lambda m, impl: set_kernel(m, "swiglu", impl)), "swiglu")
