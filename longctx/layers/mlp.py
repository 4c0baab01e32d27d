"""Dense SwiGLU MLP with the GLM clamp (gate <= limit, |up| <= limit)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _ClampedSwiGLU(torch.autograd.Function):
    """silu(min(gate, limit)) * clamp(up, -limit, limit) that keeps only gate and up for backward (one
    [2I] row per token where they are views of one projection, as in the experts) and recomputes the
    clamps and the SiLU there. Plain autograd keeps the clamped gate, its SiLU, the clamped up and the
    gate/up rows: 6 rows of the width against 2 (the down projection keeps the product either way);
    at h200-ref 18 KB per token and MoE layer. The forward is the plain form's, op for op."""

    @staticmethod
    def forward(ctx, gate, up, limit):
        ctx.save_for_backward(gate, up)
        ctx.limit = limit
        return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        lim = ctx.limit
        cd = torch.promote_types(gate.dtype, torch.float32)  # fp32 for bf16/fp16, fp64 stays fp64
        g, u, d = gate.to(cd), up.to(cd), dy.to(cd)
        gc = g.clamp(max=lim)
        sig = torch.sigmoid(gc)
        silu = gc * sig
        # clamp passes the gradient where the input lies within its bounds (inclusive), as torch's does
        d_gate = d * u.clamp(-lim, lim) * sig * (1 + gc * (1 - sig)) * (g <= lim)
        d_up = d * silu * ((u >= -lim) & (u <= lim))
        return d_gate.to(gate.dtype), d_up.to(up.dtype), None


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
