"""Normalisations used across the model (fp32 statistics, as the reference does). The maths are ops:
RMSNorm is `longctx.ops.rms_norm` (the setting kernels.rms_norm), KDA's gated output norm
`longctx.ops.kda.gated_rms_norm` (its fla twin runs from the KDA layer, kernels.kda_norm)."""

from __future__ import annotations

import torch
from torch import nn

from ..ops import rms_norm as rms_norm_ops
from ..ops.kda import gated_rms_norm


class RMSNorm(nn.Module):
    """weight * RMSNorm(x) in x's dtype, keeping x and one fp32 rstd per row for backward whichever backend
    runs. `last_impl` records which ran (the step log's implementation report)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = {"rms_norm": "auto"}  # set by longctx.kernels.apply_kernels
        self.last_impl: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        impl = rms_norm_ops.pick(self.kernels["rms_norm"], x, self.weight)
        self.last_impl = f"norm:{impl}"
        return rms_norm_ops.rms_norm(x, self.weight, self.eps, impl)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the KDA output, gated by sigmoid(gate); in fp32, or fp64 for fp64 inputs."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)
