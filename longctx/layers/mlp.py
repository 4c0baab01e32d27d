"""Dense SwiGLU MLP with the GLM clamp (gate <= limit, |up| <= limit); the activation is the swiglu op
(`longctx.ops.swiglu`, the setting kernels.swiglu)."""

from __future__ import annotations

import torch
from torch import nn

from ..ops import swiglu as swiglu_ops


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, swiglu_limit: float):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.limit = swiglu_limit
        self.kernels = {"swiglu": "auto"}  # set by longctx.kernels.apply_kernels
        self.last_impl: str | None = None  # which ran (the step log's implementation report)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        impl = swiglu_ops.pick(self.kernels["swiglu"], gate, up)
        self.last_impl = f"swiglu:{impl}"
        return self.down_proj(swiglu_ops.clamped_swiglu(gate, up, self.limit, impl))
