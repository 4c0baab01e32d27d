"""Dense SwiGLU MLP with the GLM clamp (gate <= limit, |up| <= limit); the activation is the swiglu op
(`longctx.ops.swiglu`, the setting kernels.swiglu).

The gate and up projections run as one matmul over their weights stacked by rows, into the packed
[gate | up] layout the activation takes (as the routed experts' `gate_up` does): x's gradient is then one
product, where two Linears would give two that autograd adds up (a read of two and a write of one
[T, hidden] a layer). The parameters stay two Linears, the checkpoints' layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
        h = F.linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight]))  # [..., 2I]: gate | up
        impl = swiglu_ops.pick(self.kernels["swiglu"], h)
        self.last_impl = f"swiglu:{impl}"
        return self.down_proj(swiglu_ops.clamped_swiglu_packed(h, self.limit, impl))
