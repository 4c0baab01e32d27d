"""Helpers the context-parallel checks share (imported in the serving processes too)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int) -> None:
    """Non-degenerate weights, the same on every rank: norms near 1, pooling gates and positional
    biases that matter, everything else ~ 1/sqrt(fan-in)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        r = torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype)
        if name.endswith("norm.weight"):
            v = 1 + 0.2 * r
        elif name.endswith("norm.bias"):
            v = 0.1 * r
        elif name.endswith(("pool_ape", "pool_gate")):
            v = 0.5 * r
        elif name.endswith(("A_log", "dt_bias")):
            v = 0.5 * r
        else:
            v = r / math.sqrt(p.shape[-1])
        p.copy_(v)


def rel(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """max |a - b| / max |b| (0 when both are missing; inf when only one is)."""
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        return math.inf
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) if b.numel() else 0.0


def summed_grads(module: torch.nn.Module, group=None) -> dict:
    """Each parameter's gradient summed over the group (what the data/cp gradient reduction does)."""
    out = {}
    for name, p in module.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        dist.all_reduce(g, group=group)
        out[name] = g
    return out


def grads(module: torch.nn.Module) -> dict:
    return {n: (torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()) for n, p in module.named_parameters()}


def worst(errs: dict) -> tuple[str, float]:
    k = max(errs, key=errs.get)
    return k, errs[k]
