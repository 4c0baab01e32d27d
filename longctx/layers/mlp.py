"""Dense SwiGLU MLP with the GLM clamp (gate <= limit, |up| <= limit)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _ClampedSwiGLU(torch.autograd.Function):
    """silu(min(gate, limit)) * clamp(up, -limit, limit) that keeps only gate and up for backward (one
    [2I] row per token where they are views of one projection, as in the experts) and recomputes the
    clamps and the SiLU there. Plain autograd keeps the clamped gate, its SiLU and the clamped up too:
    5 rows of the width against 2 (the down projection keeps the product either way); at h200-ref
    18 KB per token and MoE layer. Forward and backward are plain autograd's ops, in the same dtypes:
    outputs and gradients are bit-identical to it; the backward recomputes two clamps and a SiLU."""

    @staticmethod
    def forward(ctx, gate, up, limit):
        ctx.save_for_backward(gate, up)
        ctx.limit = limit
        return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        lim = ctx.limit
        gc = gate.clamp(max=lim)
        # what autograd runs for mul, silu and the two clamps (a clamp passes the gradient where its
        # input lies within the bounds, inclusive)
        d_gc = torch.ops.aten.silu_backward(dy * up.clamp(-lim, lim), gc)
        d_gate = torch.where(gate <= lim, d_gc, 0)
        d_up = torch.where((up >= -lim) & (up <= lim), dy * F.silu(gc), 0)
        return d_gate, d_up, None


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return _ClampedSwiGLU.apply(gate, up, limit)


def clamped_swiglu_plain(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """The same function through plain autograd (what `_ClampedSwiGLU` is tested against)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, swiglu_limit: float):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))
