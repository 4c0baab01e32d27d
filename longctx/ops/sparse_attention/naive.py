"""Plain-torch twin of the DSA sparse attention kernel (absorbed NoPE MLA, one shared latent).

For query t and head h, with the latent c (width D, used as key *and* value) and the selected
indices I_t (top-k + tail, -1 for unused slots):

    o[t, h] = sum_{j in I_t} softmax_j(scale * q[t, h] . c[j]) c[j]

A query whose slots are all -1 (padding) gets a zero output and lse = -inf.
This is the reference the Triton kernel is tested against, and the CPU path. It gathers the
selected latents for a block of queries at a time, so its memory is O(chunk * k * D), never
O(S^2); under autograd each block is checkpointed (its gathered latents are rebuilt in backward), so
what it saves for backward is its inputs, not S * k * D gathered values (an fp32 reference step at 12k
tokens would otherwise keep 52 GB per layer).
"""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint


def sparse_attention_torch(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float, chunk: int = 256, return_lse: bool = False
):
    """q [B, S, H, D], kv [B, S_kv, D], idx [B, S, K] (int, -1 = unused) -> o [B, S, H, D] (and lse [B, S, H])."""
    B, S, H, D = q.shape
    outs, lses = [], []
    grad = torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad)
    for s0 in range(0, S, chunk):
        args = (q[:, s0 : s0 + chunk], kv, idx[:, s0 : s0 + chunk], scale)
        if grad:
            o, lse = torch.utils.checkpoint.checkpoint(_block, *args, use_reentrant=False)
        else:
            o, lse = _block(*args)
        outs.append(o)
        lses.append(lse)
    o, lse = torch.cat(outs, 1), torch.cat(lses, 1)
    return (o, lse) if return_lse else o


def _selected_rows(kv, idx):
    """kv [B, S_kv, D] rows at in-range indices idx [B, s, K] -> [B, s, K, D]."""
    B, s, K = idx.shape
    return torch.gather(kv, 1, idx.reshape(B, -1, 1).expand(-1, -1, kv.shape[-1])).view(B, s, K, -1)


def _block(q, kv, idx, scale):
    with torch.autocast(q.device.type, enabled=False):  # softmax statistics in fp32 even under autocast
        return _block_fp32(q, kv, idx, scale)


def _block_fp32(q, kv, idx, scale):
    B, s, H, D = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    valid = idx >= 0  # [B, s, K]
    safe = idx.clamp(min=0).long()
    sel = _selected_rows(kv, safe)  # [B, s, K, D]
    logits = torch.einsum("bshd,bskd->bshk", q.to(acc), sel.to(acc)) * scale
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [B, s, H]
    p = torch.exp(logits - lse.clamp(min=torch.finfo(acc).min)[..., None])
    p = torch.nan_to_num(p, nan=0.0)
    o = torch.einsum("bshk,bskd->bshd", p, sel.to(acc)).to(q.dtype)
    return o, lse


def dense_masked_attention(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float):
    """The slow independent reference: full [S, S_kv] scores under the mask the indices describe.

    This is also what a plain implementation does (the `baseline` memory setting); it is O(S^2).
    """
    with torch.autocast(q.device.type, enabled=False):
        return _dense_fp32(q, kv, idx, scale)


def _dense_fp32(q, kv, idx, scale):
    B, S, H, D = q.shape
    Skv = kv.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    mask = torch.zeros(B, S, Skv + 1, dtype=torch.bool, device=q.device)
    mask.scatter_(-1, torch.where(idx >= 0, idx.long(), Skv), True)
    mask = mask[..., :Skv]
    logits = torch.einsum("bshd,bkd->bshk", q.to(acc), kv.to(acc)) * scale
    logits = logits.masked_fill(~mask[:, :, None, :], float("-inf"))
    p = torch.nan_to_num(torch.softmax(logits, -1), nan=0.0)
    return torch.einsum("bshk,bkd->bshd", p, kv.to(acc)).to(q.dtype)


def sparse_attention_bwd_torch(q, kv, idx, o, lse, do, scale: float, chunk: int = 256):
    """The backward of sparse attention from the forward's output and log-sum-exp, in torch: the twin of
    the Triton kernel's backward (`triton.sparse_attention_bwd`). Returns (dq like q, dkv like kv).

    With p = exp(scale q.c_j - lse) over the selected rows and Dt = sum_d dO o:
    dq = scale sum_j p_j (dO.c_j - Dt) c_j, dc_j += p_j dO + scale p_j (dO.c_j - Dt) q (summed over heads
    and over every query that selected j). In fp32 (fp64 for fp64 inputs), O(chunk x k x D) at a time."""
    B, S, H, D = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    with torch.autocast(q.device.type, enabled=False):
        dq = torch.empty(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        dt = (do.to(acc) * o.to(acc)).sum(-1)  # [B, S, H]
        for s0 in range(0, S, chunk):
            sl = slice(s0, s0 + chunk)
            qi, doi, ii = q[:, sl].to(acc), do[:, sl].to(acc), idx[:, sl]
            valid = ii >= 0
            safe = ii.clamp(min=0).long()
            sel = _selected_rows(kv, safe).to(acc)
            logits = torch.einsum("bshd,bskd->bshk", qi, sel) * scale
            p = torch.exp(logits - lse[:, sl, :, None].to(acc)).masked_fill(~valid[:, :, None, :], 0.0)
            p = torch.nan_to_num(p, nan=0.0)  # rows with no valid slot (lse = -inf)
            ds = p * (torch.einsum("bshd,bskd->bshk", doi, sel) - dt[:, sl, :, None])
            dq[:, sl] = torch.einsum("bshk,bskd->bshd", ds, sel) * scale
            dsel = torch.einsum("bshk,bshd->bskd", p, doi) + torch.einsum("bshk,bshd->bskd", ds, qi) * scale
            dsel = dsel.masked_fill(~valid[..., None], 0.0)
            for b in range(B):
                dkv[b].index_add_(0, safe[b].reshape(-1), dsel[b].reshape(-1, D))
    return dq.to(q.dtype), dkv.to(kv.dtype)


class KeptSparseAttention(torch.autograd.Function):
    """Sparse attention whose forward was run before (a block recompute's first pass, `reuse_attention`):
    returns the kept output o; its backward is `backward(q, kv, idx, o, lse, do) -> (dq, dkv)` from the kept
    o and lse (this module's `sparse_attention_bwd_torch`, or the Triton kernel's backward)."""

    @staticmethod
    def forward(ctx, q, kv, idx, o, lse, backward):
        ctx.save_for_backward(q, kv, idx, o, lse)
        ctx.bwd = backward
        return o.view_as(o)

    @staticmethod
    def backward(ctx, do):
        dq, dkv = ctx.bwd(*ctx.saved_tensors, do)
        return dq, dkv, None, None, None, None


def kept_sparse_attention_torch(q, kv, idx, o, lse, scale: float, chunk: int = 256) -> torch.Tensor:
    """o (kept from an earlier forward over the same q, kv, idx), differentiable in q and kv."""
    bwd = functools.partial(sparse_attention_bwd_torch, scale=float(scale), chunk=chunk)
    return KeptSparseAttention.apply(q, kv, idx, o, lse, bwd)


def causal_pool_indices(S: int, K: int, pool: int = 4, device="cuda", generator=None) -> torch.Tensor:
    """Synthetic DSA selections, the workload of the sparse kernel's GPU tests and benchmark (one
    definition, so the benchmark's figures are for what the tests check): DSA-like indices: for query t, whole pools of `pool` earlier tokens (the most recent ones plus
    random older ones, distinct), then the visible tail of the current incomplete pool, -1 elsewhere."""
    n_sel = (K - (pool - 1)) // pool
    t = torch.arange(S, device=device)
    n_pool = (t + 1) // pool  # complete pools visible to query t
    r = torch.arange(n_sel, device=device)
    n_recent = min(64, n_sel)
    # older pools: one random pick in each of (n_sel - n_recent) equal strata of [0, n_pool - n_recent)
    n_old = n_sel - n_recent
    span = (n_pool - n_recent).clamp(min=0).to(torch.float32)
    u = torch.rand(S, max(n_old, 1), device=device, generator=generator)[:, :n_old]
    i = torch.arange(n_old + 1, device=device, dtype=torch.float64)
    edges = torch.floor(i[None, :] * span[:, None].double() / max(n_old, 1)).long()  # integer strata
    lo, hi = edges[:, :-1], edges[:, 1:]
    old = lo + (u * (hi - lo)).long()
    recent = n_pool[:, None] - 1 - torch.arange(n_recent, device=device)
    pools = torch.cat([recent, old], 1)
    few = n_pool <= n_sel  # short prefixes: every complete pool
    pools = torch.where(few[:, None], r[None, :], pools)
    pools = torch.where(pools < n_pool[:, None], pools, -1)
    tok = pools[:, :, None] * pool + torch.arange(pool, device=device)
    tok = torch.where(pools[:, :, None] >= 0, tok, -1).flatten(1)
    tail = n_pool[:, None] * pool + torch.arange(pool - 1, device=device)
    tail = torch.where(tail <= t[:, None], tail, -1)
    idx = torch.cat([tok, tail], 1)
    # shuffle slot order: the kernel must not rely on any order
    perm = torch.argsort(torch.rand(S, idx.shape[1], device=device, generator=generator), dim=1)
    return torch.gather(idx, 1, perm)[:, :K].to(torch.int32)


def persistent_pool_indices(S: int, K: int, redraw: float, pool: int = 4, device="cuda", generator=None) -> torch.Tensor:
    """`causal_pool_indices` whose older pools persist from one query to the next, the way a trained
    indexer's neighbouring queries keep most of each other's pools (bench/union_size.py measures it): each
    older pick is redrawn (in its stratum, at that query) with probability `redraw` per query and is the
    previous query's otherwise. redraw = 1 gives independent neighbours, as `causal_pool_indices`. Rows are
    ascending, -1 padded; a pool that two slots hold after a redraw counts once. The workload of the union
    kernels' GPU tests and benchmark."""
    n_sel = (K - (pool - 1)) // pool
    t = torch.arange(S, device=device)
    n_pool = (t + 1) // pool
    n_recent = min(64, n_sel)
    n_old = n_sel - n_recent
    span = (n_pool - n_recent).clamp(min=0).double()
    u = torch.rand(S, max(n_old, 1), device=device, generator=generator)[:, :n_old]
    i = torch.arange(n_old + 1, device=device, dtype=torch.float64)
    edges = torch.floor(i[None, :] * span[:, None] / max(n_old, 1)).long()
    fresh = edges[:, :-1] + (u * (edges[:, 1:] - edges[:, :-1])).long()  # a new pick in each stratum, per query
    redrawn = torch.rand(S, max(n_old, 1), device=device, generator=generator)[:, :n_old] < redraw
    redrawn |= (n_pool <= n_sel + 1)[:, None]  # the prefix that takes every pool, and the first query after it
    last = torch.where(redrawn, t[:, None], 0).cummax(dim=0).values  # the latest redraw at or before t
    old = fresh.gather(0, last)
    recent = n_pool[:, None] - 1 - torch.arange(n_recent, device=device)
    pools = torch.cat([recent, old], 1)
    few = n_pool <= n_sel
    pools = torch.where(few[:, None], torch.arange(n_sel, device=device)[None, :], pools)
    pools = torch.where(pools < n_pool[:, None], pools, -1)
    pools = pools.sort(dim=1).values
    repeat = torch.zeros_like(pools, dtype=torch.bool)
    repeat[:, 1:] = pools[:, 1:] == pools[:, :-1]
    pools = torch.where(repeat, -1, pools)
    tok = pools[:, :, None] * pool + torch.arange(pool, device=device)
    tok = torch.where(pools[:, :, None] >= 0, tok, -1).flatten(1)
    tail = n_pool[:, None] * pool + torch.arange(pool - 1, device=device)
    tail = torch.where(tail <= t[:, None], tail, -1)
    return torch.cat([tok, tail], 1)[:, :K].to(torch.int32)
