"""Normalisations used across the model (fp32 statistics, as the reference does)."""

from __future__ import annotations

import torch
from torch import nn

from ..ops import FUSED_IMPLS


class _RMSNormFn(torch.autograd.Function):
    """weight * RMSNorm(x) in x's dtype that keeps x (in its own dtype) and one fp32 rstd per row for
    backward, which recomputes the normalised rows. Plain autograd of the same arithmetic keeps x's fp32
    copy and the normalised rows besides: 6 bytes per element of a bf16 x against 2 (+ 4 per row), the
    difference 12 KB per token and block at h200-ref's width (seed 000's "no fp32 copies"). The forward
    is the plain form's, op for op, so outputs are bit-identical to it."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        # cast after the weight too: an fp32 master weight must not promote a bf16 activation to fp32
        # under autocast (the MoE would then take its fp32 loop path and every norm output double in size)
        return (weight * (xf * rstd).to(x.dtype)).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        dyf = dy.float()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            g = dyf * weight.float()  # the gradient of the normalised rows (through their rounding unchanged)
            dx = (rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = (dyf * xhat.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        return dx, dw, None


def rms_norm_plain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same function through plain autograd (what `_RMSNormFn` is tested against)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype)).to(x.dtype)


RMS_NORM_IMPLS = FUSED_IMPLS  # the training setting norm_impl


class RMSNorm(nn.Module):
    """`impl` (the training setting norm_impl): "torch" runs `_RMSNormFn`; "triton" the fused kernels of
    longctx/ops/rms_norm/triton.py (same arithmetic and saved tensors; a ConfigError where they cannot
    run); "auto" the kernels on CUDA where they take the shape, else torch, with a warning on CUDA.
    `last_impl` records which ran (the step log's implementation list)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.impl = "auto"
        self.last_impl: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._use_triton(x):
            from ..ops.rms_norm.triton import rms_norm_triton

            self.last_impl = "norm:triton"
            return rms_norm_triton(x, self.weight, self.eps)
        self.last_impl = "norm:torch"
        return _RMSNormFn.apply(x, self.weight, self.eps)

    def _use_triton(self, x: torch.Tensor) -> bool:
        from ..ops import fused_kernel_runs

        return fused_kernel_runs("norm_impl", self.impl, "rms_norm.triton", x, self.weight)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the KDA output, gated by sigmoid(gate); in fp32, or fp64 for fp64 inputs (the
    KDA twin's exact checks: an fp32 rounding here made them differ by 1e-7 relative)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        cd = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(cd)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(cd) * xf * torch.sigmoid(gate.to(cd))).to(x.dtype)
