"""The clamped SwiGLU of GLM, silu(min(gate, limit)) * clamp(up, -limit, limit), in plain torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ClampedSwiGLU(torch.autograd.Function):
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
        return clamped_swiglu_plain(gate, up, limit)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return *_swiglu_grads(gate, up, dy, ctx.limit), None


def _swiglu_grads(gate, up, dy, lim, out_gate=None, out_up=None):
    """What autograd runs for mul, silu and the two clamps (a clamp passes the gradient where its input
    lies within the bounds, inclusive); `out_*`: tensors (views) to write the gradients into."""
    gc = gate.clamp(max=lim)
    d_gc = torch.ops.aten.silu_backward(dy * up.clamp(-lim, lim), gc)
    zero = dy.new_zeros(())
    d_gate = torch.where(gate <= lim, d_gc, zero, out=out_gate)
    d_up = torch.where((up >= -lim) & (up <= lim), dy * F.silu(gc), zero, out=out_up)
    return d_gate, d_up


class ClampedSwiGLUPacked(torch.autograd.Function):
    """`ClampedSwiGLU` on one [..., 2I] projection (gate | up, the experts' layout) whose gradient comes
    back as one tensor, the two halves written in place. With two views as inputs autograd zero-fills a
    [..., 2I] buffer per view and adds them (SliceBackward: 23 ms of copies in a 128k step). Same ops and
    dtypes: bit-identical to plain autograd."""

    @staticmethod
    def forward(ctx, h, limit):
        ctx.save_for_backward(h)
        ctx.limit = limit
        I = h.shape[-1] // 2
        return clamped_swiglu_plain(h[..., :I], h[..., I:], limit)

    @staticmethod
    def backward(ctx, dy):
        h, = ctx.saved_tensors
        I = h.shape[-1] // 2
        dh = torch.empty_like(h)
        _swiglu_grads(h[..., :I], h[..., I:], dy, ctx.limit, out_gate=dh[..., :I], out_up=dh[..., I:])
        return dh, None


def clamped_swiglu_plain(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """The same function through plain autograd (what `ClampedSwiGLU` is tested against)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
