"""Normalisations used across the model (fp32 statistics, as the reference does)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # cast after the weight too: an fp32 master weight must not promote a bf16 activation to fp32
        # under autocast (the MoE would then take its fp32 loop path and every norm output double in size)
        return (self.weight * xf.to(x.dtype)).to(x.dtype)


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
