"""Plain-torch twin of the k-pool indexer's Triton path: score every (query, pool) pair, keep the top-k pools.

    score(t, p) = sum_h w[t, h] * relu(q[t, h] . pk[p])        (q already carries 1/sqrt(D_I))

Pool p is selectable by the query at absolute position t iff it is complete and ends at or before
t: (p + 1) * P - 1 <= t. Each query keeps the k_pools best selectable pools; equal scores go to
the lower pool id, so the result is a function of the scores alone (torch.topk's own tie order is
unspecified). Output: int32 [B, S, k_pools], ascending pool ids, -1 after the last one.

The selection is written as "everything above the k-th largest score, then the first few equal to
it in pool order", the rule the Triton emit kernel implements, so the two can be compared id for id.
-0.0 is folded into +0.0 first, as the kernel folds it (equal floats must pick alike).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check(q: torch.Tensor, w: torch.Tensor, pk: torch.Tensor, pool: int, k_pools: int, who: str) -> None:
    """ValueError naming the shape when the inputs do not describe one indexer problem."""
    if q.dim() != 4 or w.dim() != 3 or pk.dim() != 3:
        raise ValueError(
            f"{who}: expected q [B,S,H,D], w [B,S,H], pk [B,NP,D]; got q {tuple(q.shape)}, "
            f"w {tuple(w.shape)}, pk {tuple(pk.shape)}"
        )
    B, S, H, D = q.shape
    if tuple(w.shape) != (B, S, H) or pk.shape[0] != B or pk.shape[2] != D:
        raise ValueError(
            f"{who}: shapes disagree: q {tuple(q.shape)}, w {tuple(w.shape)}, pk {tuple(pk.shape)} "
            f"(need w [B,S,H] and pk [B,NP,D] for q [B,S,H,D])"
        )
    if pool < 1 or k_pools < 0:
        raise ValueError(f"{who}: pool={pool}, k_pools={k_pools}; need pool >= 1 and k_pools >= 0")


def select_from_scores(score: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """[..., NP] fp32 scores + selectable mask -> int32 [..., k] ascending pool ids, -1 padded.

    Top k by score, ties to the lower pool id; rows with at most k selectable pools take them all.
    """
    n = score.shape[-1]
    lead = score.shape[:-1]
    out = torch.full((*lead, k + 1), -1, dtype=torch.int32, device=score.device)
    if n == 0 or k == 0:
        return out[..., :k]
    score = torch.where(score == 0, torch.zeros_like(score), score)  # -0.0 -> +0.0
    neg = score.masked_fill(~valid, float("-inf"))
    kth = neg.topk(min(k, n), dim=-1, sorted=False).values.amin(-1, keepdim=True)  # value only: tie-free
    gt = valid & (score > kth)
    eq = valid & (score == kth)
    room = k - gt.sum(-1, keepdim=True)
    take = gt | (eq & (eq.cumsum(-1) <= room))
    take = torch.where(valid.sum(-1, keepdim=True) <= k, valid, take)
    slot = torch.where(take, take.cumsum(-1) - 1, k)  # untaken pools land in a spare column
    ids = torch.arange(n, device=score.device, dtype=torch.int32).expand_as(score)
    out.scatter_(-1, slot, torch.where(take, ids, -1))
    return out[..., :k]


def kpool_scores_torch(q: torch.Tensor, w: torch.Tensor, pk: torch.Tensor) -> torch.Tensor:
    """fp32 [B, c, NP] scores sum_h w relu(q . pk), the same arithmetic as KPoolIndexer.pool_scores."""
    s = F.relu(torch.matmul(q.float(), pk.float().transpose(-1, -2).unsqueeze(1)))  # [B, c, H, NP]
    return torch.matmul(w.float().unsqueeze(-2), s).squeeze(-2)


def kpool_topk_torch(q: torch.Tensor, w: torch.Tensor, pk: torch.Tensor, pool: int, k_pools: int,
                     chunk: int | None = 256, q_offset: int = 0) -> torch.Tensor:
    """int32 [B, S, k_pools] pool ids (ascending, -1 = none) of the k_pools best selectable pools.

    q [B,S,H,D] (pre-scaled), w [B,S,H], pk [B,NP,D]. `chunk` queries are scored per pass (None:
    all at once, an fp32 [B,S,H,NP] workspace); `q_offset` is the absolute position of q[:, 0]
    (decoding with a cache), so query i sees pools ending at or before q_offset + i.
    """
    _check(q, w, pk, pool, k_pools, "kpool_topk_torch")
    if chunk is not None and chunk < 1:
        raise ValueError(f"kpool_topk_torch: chunk={chunk}; use a positive number of queries or None (all)")
    if q_offset < 0:
        raise ValueError(f"kpool_topk_torch: q_offset={q_offset}; must be >= 0 (absolute position of q[:, 0])")
    B, S = q.shape[:2]
    n = pk.shape[1]
    out = torch.full((B, S, k_pools), -1, dtype=torch.int32, device=q.device)
    if n == 0 or k_pools == 0 or S == 0:
        return out
    ends = torch.arange(n, device=q.device) * pool + (pool - 1)
    step = S if chunk is None else chunk
    for s0 in range(0, S, step):
        s1 = min(S, s0 + step)
        score = kpool_scores_torch(q[:, s0:s1], w[:, s0:s1], pk)
        pos = torch.arange(q_offset + s0, q_offset + s1, device=q.device)
        valid = (ends[None, :] <= pos[:, None]).expand(B, s1 - s0, n)
        out[:, s0:s1] = select_from_scores(score, valid, k_pools)
    return out
