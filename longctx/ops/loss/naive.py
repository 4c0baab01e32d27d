"""The LM head + cross entropy in plain torch, a chunk of rows at a time so that [N, vocab] logits never
exist at once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _ce(h: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), y, ignore_index=-100, reduction="none")


def token_losses_torch(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                       chunk: int | None = 4096) -> torch.Tensor:
    """Per-row cross entropy [N] fp32 of F.linear(h, weight) against labels (0 where label == -100).

    h [N, D], weight [V, D], labels [N]. `chunk` rows at a time, each under checkpoint when a gradient is
    wanted, so only one chunk's logits exist, in forward and in backward; chunk None: one shot, the logits
    materialised (the memory plan's baseline)."""
    step = chunk or h.shape[0]
    parts = []
    for s0 in range(0, h.shape[0], step):
        hh, yy = h[s0 : s0 + step], labels[s0 : s0 + step]
        if chunk and torch.is_grad_enabled() and hh.requires_grad:
            parts.append(checkpoint(_ce, hh, yy, weight, use_reentrant=False))
        else:
            parts.append(_ce(hh, yy, weight))
    return torch.cat(parts) if parts else h.new_zeros(0, dtype=torch.float32)
