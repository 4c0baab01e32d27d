"""mHC (manifold-constrained hyper-connections) in plain torch: the coefficients from the streams, the
collapse into a sub-layer's input and the expand of its output back into the streams.

With n streams [..., n, D] and the parameters of `longctx.layers.residual.MHC` (fn [(2+n)n, nD],
base [(2+n)n] fp32, scale [3] fp32):

    mix   = RMSNorm(flatten(streams)) @ fn^T                        fp32 [..., (2+n)n]
    pre   = sigmoid(scale0 mix[:n] + base[:n]) + eps                [..., n]
    post  = 2 sigmoid(scale1 mix[n:2n] + base[n:2n])                [..., n]
    comb  = Sinkhorn(softmax_rows(scale2 mix[2n:] + base[2n:]) + eps)   [..., n, n], comb[j, i]: stream j -> i
    x     = sum_j pre[j] streams[j]                                 (the sub-layer's input)
    out_i = post[i] y + sum_j comb[j, i] streams[j]                 (y: the sub-layer's output)

The projection's fp32 copy of the streams is what autograd would save; `recompute_cast` checkpoints
the small projection so that backward recasts it from the bf16 streams instead (8 GiB at 512k tokens
for h200-ref).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["mhc_coefficients", "mhc_post_res", "mhc_pre", "mhc_project"]


def mhc_project(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """mix = RMSNorm(streams flattened over the last two dims) @ fn^T, in fp32: [..., (2+n)n]."""
    flat = streams.flatten(-2).float()
    return F.linear(flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps), fn.float())


def mhc_coefficients(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                     iters: int, hc_eps: float, norm_eps: float, recompute_cast: bool = True):
    """(pre [..., n], post [..., n], comb [..., n, n]) fp32 for streams [..., n, D] (comb[j, i]: stream j -> i)."""
    n = streams.shape[-2]
    if recompute_cast and torch.is_grad_enabled() and streams.requires_grad:
        mixed = checkpoint(mhc_project, streams, fn, norm_eps, use_reentrant=False)
    else:
        mixed = mhc_project(streams, fn, norm_eps)
    pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    s_pre, s_post, s_comb = scale.unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * s_comb + comb_b.view(n, n), dim=-1) + hc_eps
    # Sinkhorn: columns first, then (iters - 1) rounds of rows and columns -> doubly stochastic.
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def mhc_pre(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_j pre[j] * streams[j] in the streams' dtype: [..., D]."""
    return (pre.unsqueeze(-1) * streams).sum(-2).to(streams.dtype)


def mhc_post_res(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out[i] = post[i] * y + sum_j comb[j, i] * streams[j], in the streams' dtype: [..., n, D]."""
    dt = streams.dtype
    return post.to(dt).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), streams)
