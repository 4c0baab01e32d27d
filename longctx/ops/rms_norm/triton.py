"""Fused RMSNorm forward and backward in Triton, with `naive.RMSNormFn`'s arithmetic and saved tensors.

Why. The torch form runs ~8 kernels a forward (an fp32 copy of x, square, mean, rsqrt, scale, a cast,
the weight product, a cast) and more in backward, each a pass over [tokens, hidden]; at h200-ref's
width the norms' casts alone are ~0.15 s of a 128k step (`bench/memory.py --profile-stacks`: the norms'
backward 64 ms, the forward's and the recompute's ~90 ms). One row per program here reads x
once and writes y once, and the backward reads x and dy once and writes dx once (dw from per-program
partial sums). Saved for backward: x (its own dtype) and one fp32 rstd per row, as `RMSNormFn`.

Arithmetic (as `RMSNormFn`): rstd = 1/sqrt(mean(x^2) + eps) in fp32; y = weight * (x * rstd rounded to
x's dtype), rounded to x's dtype; dx = rstd (g - xhat mean(g xhat)) with g = dy weight, xhat = x rstd;
dw = sum over rows of dy (x rstd rounded to x's dtype). Sums run in another order than torch's, so
results agree to fp32 rounding (tests/ops/test_rms_norm.py under the interpreter; the GPU test in
tests/ops/test_rms_norm_gpu.py).

Runs on CUDA tensors, and on CPU tensors under `TRITON_INTERPRET=1` (the CPU tests)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import triton_interpreting as interpreting
from ..triton_utils import round_rne as _round

MAX_WIDTH = 16384  # one row per program: the whole row lives in registers
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def rejects(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the kernels cannot take these inputs (the rule in `ops.pick` turns it into auto's warning or
    an explicit setting's ConfigError), or None."""
    D = x.shape[-1]
    if x.device.type != "cuda" and not interpreting():
        return f"the Triton RMSNorm runs on CUDA tensors, and x is on {x.device}"
    if x.dtype not in DTYPES or weight.dtype not in DTYPES:
        return f"the Triton RMSNorm takes bf16, fp16 or fp32, not x {x.dtype} with weight {weight.dtype}"
    if not 1 <= D <= MAX_WIDTH or weight.shape != (D,):
        return (f"the Triton RMSNorm takes rows of 1..{MAX_WIDTH} with a weight of the row's width, not x "
                f"{tuple(x.shape)} with weight {tuple(weight.shape)}")
    return None


@triton.jit
def _rms_norm_fwd(X, W, Y, RSTD, D, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    xhat = _round(x * rstd, Y.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * D + cols, _round(w * xhat, Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd(X, W, DY, RSTD, DX, DW_PART, M, D, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, WANT_DW: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for r in range(0, ROWS):  # a constexpr bound (a power of two): few compiles, and the interpreter takes it
        row = pid.to(tl.int64) * ROWS + r
        live = row < M
        mask = cmask & live
        x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row, mask=live, other=0.0)
        xhat = x * rstd
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / D))
        tl.store(DX + row * D + cols, _round(dx, DX.dtype.element_ty), mask=mask)
        if WANT_DW:
            dw += dy * _round(xhat, X.dtype.element_ty).to(tl.float32)
    if WANT_DW:
        tl.store(DW_PART + pid.to(tl.int64) * D + cols, dw, mask=cmask)


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


def _rows_per_program(M: int, device: torch.device) -> int:
    """Backward rows per program, a power of two giving a few programs per SM (each sums dw over its
    rows into one fp32 partial row): 256 at 131,072 rows on an H200."""
    target = 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return triton.next_power_of_2(max(1, triton.cdiv(M, target)))


class TritonRMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        why = rejects(x, weight)
        if why is not None:
            raise ValueError(f"rms_norm_triton: {why}.")
        D = x.shape[-1]
        x2 = x.reshape(-1, D).contiguous()
        M = x2.shape[0]
        y = torch.empty_like(x2)
        rstd = torch.empty(M, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(D)
        if M:
            _rms_norm_fwd[(M,)](x2, weight, y, rstd, D, eps, BLOCK_D=block, num_warps=_warps(block))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        M, D = x2.shape
        dy2 = dy.reshape(-1, D).contiguous()
        dx = torch.empty_like(x2)
        want_dw = ctx.needs_input_grad[1]
        rows = _rows_per_program(M, x2.device)
        n = max(1, triton.cdiv(M, rows))
        part = torch.empty((n, D) if want_dw else (1, 1), dtype=torch.float32, device=x2.device)
        block = triton.next_power_of_2(D)
        if M:
            _rms_norm_bwd[(n,)](x2, weight, dy2, rstd, dx, part, M, D, ROWS=rows, BLOCK_D=block,
                                WANT_DW=want_dw, num_warps=_warps(block))
        dw = None
        if want_dw:
            dw = (part.sum(0) if M else torch.zeros(D, dtype=torch.float32, device=x2.device)).to(weight.dtype)
        return dx.view(ctx.shape) if ctx.needs_input_grad[0] else None, dw, None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x) in x's dtype through the fused kernels (see the module docstring)."""
    return TritonRMSNormFn.apply(x, weight, eps)
