"""RMSNorm in plain torch, weight * x * rsqrt(mean(x^2) + eps) with fp32 statistics, as the reference does."""

from __future__ import annotations

import torch


class RMSNormFn(torch.autograd.Function):
    """weight * RMSNorm(x) in x's dtype that keeps x (in its own dtype) and one fp32 rstd per row for
    backward, which recomputes the normalised rows. Plain autograd of the same arithmetic keeps x's fp32
    copy and the normalised rows besides: 6 bytes per element of a bf16 x against 2 (+ 4 per row), the
    difference 12 KB per token and block at h200-ref's width. The forward is the plain form's, op for op,
    so outputs are bit-identical to it."""

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


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x) in x's dtype, keeping only x and an fp32 rstd per row for backward (`RMSNormFn`)."""
    return RMSNormFn.apply(x, weight, eps)


def rms_norm_plain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same function through plain autograd (what `RMSNormFn` is tested against)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype)).to(x.dtype)
