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


def _block(q, kv, idx, scale):
    with torch.autocast(q.device.type, enabled=False):  # softmax statistics in fp32 even under autocast
        return _block_fp32(q, kv, idx, scale)


def _block_fp32(q, kv, idx, scale):
    B, s, H, D = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    valid = idx >= 0  # [B, s, K]
    safe = idx.clamp(min=0).long()
    sel = torch.gather(kv, 1, safe.reshape(B, -1, 1).expand(-1, -1, D)).view(B, s, -1, D)  # [B, s, K, D]
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
