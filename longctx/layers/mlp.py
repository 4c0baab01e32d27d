"""Dense SwiGLU MLP with the GLM clamp (gate <= limit, |up| <= limit)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
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
