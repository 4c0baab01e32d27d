"""Normalisations used across the model (fp32 statistics, as the reference does)."""

from __future__ import annotations

import torch
from torch import nn


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the KDA output, gated by sigmoid(gate); all in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf * torch.sigmoid(gate.float())).to(x.dtype)
