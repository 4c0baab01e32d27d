"""Two-phase k-pool indexer: a Triton kernel scores a block of queries into an fp32 buffer, then the
pools are picked from it: each row's k-th score (torch.topk, or our radix-select kernel) and an emit
kernel (above it, then ties in pool order), or the twin's `select_from_scores` (select="torch").

Why a second design beside the fused kernel (`triton_kernel.py`): the fused kernel never stores a
score, but it recomputes every tile 1 + passes times (~5 sweeps) and each sweep runs at ~10% of the
MMA rate (bench/NOTES.md, "indexer"): 52x the single-sweep floor at 128k. Here the tiles are scored
once (MMA, ReLU, weighted head sum, no histogram) and written to HBM, O(chunk x pools) memory; the
emit kernel reads the buffer twice after the k-th score is known. Measured on the H200 (bench/NOTES.md):
89.3 ms at 128k against the fused kernel's 292.2, the same picks on every row, so the layers run this
path by default (`KPoolIndexer.kernel`). Half of it is torch.topk finding each row's k-th score;
`kth="radix"` finds it with our own radix-select kernel instead (`_kth_score_kernel`: 32 / RBITS reads
of the row, each a histogram of the next digit among the keys that still match): exact on the H200,
but no faster (44.2 ms at 128k against torch.topk's 44.8), so topk stays the default.

Same function as `naive.kpool_topk_torch` (ascending int32 pool ids, -1 padded, ties to the lower pool
id); the scores are the fused kernel's tile scores (`_tile_scores`, one code path), so on inputs whose
fp32 scores are exact the ids equal the twin's and the fused kernel's id for id.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .naive import select_from_scores
from .fused import (
    _cfg,
    _check,
    _fix_interpreter_loop_bounds,
    _interpreting,
    _last_contig,
    _load_query_block,
    _tile_scores,
)

# how the select finds each row's k-th score: torch.topk over the row, _kth_score_kernel, or
# `kth_scores_grouped` (torch.topk over group maxima, then over the chosen groups' scores)
KTH_METHODS = ("topk", "radix", "grouped")


@triton.jit
def _kpool_score_kernel(
    Q, W, PK, OUT,
    stride_qb, stride_qs, stride_qh,
    stride_wb, stride_ws, stride_wh,
    stride_pb, stride_pn,
    stride_ob, stride_os,
    S, H, NP, NC, P, q_offset,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
    PREC: tl.constexpr, DOT_F32: tl.constexpr,
):
    """OUT[b, t, n] = score of query t and pool n for n < NC (-inf where pool n is not selectable).
    One program: BLOCK_M queries x a strip of TILES pool tiles (q stays in registers across the strip)."""
    blk = tl.program_id(0)
    strip = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    t0 = blk * BLOCK_M

    q, w3, offs_d, d_ok, _, t, m_ok = _load_query_block(
        Q, W, b, t0, stride_qb, stride_qs, stride_qh, stride_wb, stride_ws, stride_wh, S, H,
        D, BLOCK_D, BLOCK_H, BLOCK_M, DOT_F32)
    pk_base = PK + b * stride_pb
    pos = q_offset + t
    n_hi = tl.minimum((q_offset + tl.minimum(t0 + BLOCK_M, S)) // P, NP)  # pools any row of the block sees
    out_rows = OUT + b * stride_ob + t.to(tl.int64) * stride_os
    for i in tl.static_range(TILES):
        n0 = (strip * TILES + i) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = m_ok[:, None] & (offs_n[None, :] < NC)
        if n0 < n_hi:
            sc, valid, offs_n = _tile_scores(q, w3, pk_base, stride_pn, n0, NP, offs_d, d_ok, pos, P,
                                             BLOCK_M, BLOCK_H, BLOCK_N, PREC, DOT_F32)
            tl.store(out_rows[:, None] + offs_n[None, :], tl.where(valid, sc, float("-inf")), mask=ok)
        elif n0 < NC:
            tl.store(out_rows[:, None] + offs_n[None, :], tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32),
                     mask=ok)


@triton.jit
def _emit_from_scores_kernel(
    SC, KTH, OUT,
    stride_sb, stride_ss, stride_kb, stride_ob, stride_os,
    S, NC, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """OUT[b, t, :K] = the pools of row t above its k-th score KTH[b, t], then the first ones equal to it
    in pool order (ties to the lower id), ascending, -1 padded; -inf scores are never taken. Two reads
    of the row: count those above, then emit (the fused kernel's emit step over stored scores)."""
    b = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = t < S
    kth = tl.load(KTH + b * stride_kb + t, mask=m_ok, other=float("inf"))
    rows = SC + b * stride_sb + t.to(tl.int64) * stride_ss
    above = tl.zeros([BLOCK_M], dtype=tl.int32)
    for n0 in range(0, NC, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        sc = tl.load(rows[:, None] + offs_n[None, :], mask=m_ok[:, None] & (offs_n[None, :] < NC), other=float("-inf"))
        above += tl.sum(((sc > kth[:, None]) & (sc != float("-inf"))).to(tl.int32), axis=1)
    need = K - above
    cnt = tl.zeros([BLOCK_M], dtype=tl.int32)
    seen = tl.zeros([BLOCK_M], dtype=tl.int32)
    out_rows = OUT + b * stride_ob + t.to(tl.int64) * stride_os
    for n0 in range(0, NC, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        sc = tl.load(rows[:, None] + offs_n[None, :], mask=m_ok[:, None] & (offs_n[None, :] < NC), other=float("-inf"))
        valid = sc != float("-inf")
        gt = valid & (sc > kth[:, None])
        eq = valid & (sc == kth[:, None])
        eq_rank = seen[:, None] + tl.cumsum(eq.to(tl.int32), axis=1)
        take = gt | (eq & (eq_rank <= need[:, None]))
        slot = cnt[:, None] + tl.cumsum(take.to(tl.int32), axis=1) - 1
        ids = tl.broadcast_to(offs_n[None, :], [BLOCK_M, BLOCK_N])
        tl.store(out_rows[:, None] + slot, ids, mask=take & m_ok[:, None] & (slot < K))
        cnt += tl.sum(take.to(tl.int32), axis=1)
        seen += tl.sum(eq.to(tl.int32), axis=1)
    cnt = tl.minimum(cnt, K)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        tl.store(out_rows[:, None] + offs_k[None, :], tl.full([BLOCK_M, BLOCK_K], -1, tl.int32),
                 mask=m_ok[:, None] & (offs_k[None, :] >= cnt[:, None]) & (offs_k[None, :] < K))


@triton.jit
def _kth_score_kernel(
    SC, KTH, stride_sb, stride_ss, stride_kb, NC, K,
    RBITS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """KTH[b, t] = the k-th largest of row t's NC scores (K = min(k, NC); -inf when fewer than K are
    finite): torch.topk(k).values.amin() without sorting. Radix select on the order-preserving uint32
    key of each fp32 score (-0.0 read as +0.0): pass p histograms the p-th RBITS-bit digit of the keys
    whose higher digits equal the prefix found so far, and the digit where the count from the top
    reaches the rank still wanted extends the prefix. 32 / RBITS reads of the row; exact."""
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    row = SC + b * stride_sb + t * stride_ss
    NB: tl.constexpr = 1 << RBITS
    bins = tl.arange(0, NB)
    rank = K  # the rank still wanted among the keys that match the prefix (1 = the largest)
    prefix = tl.zeros([], dtype=tl.uint32)
    for p in tl.static_range(32 // RBITS):
        shift = 32 - (p + 1) * RBITS  # a constexpr: p is one
        hist = tl.zeros([NB], dtype=tl.int32)
        for n0 in range(0, NC, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            ok = offs < NC
            x = tl.load(row + offs, mask=ok, other=0.0)
            bits = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
            key = tl.where((bits >> 31) == 1, bits ^ 0xFFFFFFFF, bits | 0x80000000)
            if p > 0:
                ok = ok & ((key >> (shift + RBITS)) == (prefix >> (shift + RBITS)))
            hist += tl.histogram(((key >> shift) & (NB - 1)).to(tl.int32), NB, mask=ok)
        at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys in this digit's bin or higher ones
        d = tl.max(tl.where(at_or_above >= rank, bins, -1), 0)  # >= 0: the matching keys number >= rank
        rank -= tl.sum(tl.where(bins > d, hist, 0), 0)
        prefix = prefix | (d.to(tl.uint32) << shift)
    bits = tl.where((prefix >> 31) == 1, prefix & 0x7FFFFFFF, prefix ^ 0xFFFFFFFF)
    tl.store(KTH + b * stride_kb + t, bits.to(tl.float32, bitcast=True))


def kth_scores_triton(score: torch.Tensor, k: int, rbits: int = 8, block_n: int = 1024) -> torch.Tensor:
    """fp32 [B, c, n] -> fp32 [B, c]: each row's min(k, n)-th largest score, by `_kth_score_kernel`
    (the value `score.topk(min(k, n)).values.amin(-1)` gives; -inf where fewer are finite)."""
    if rbits not in (4, 8):
        raise ValueError(f"kth_scores_triton: rbits={rbits}; use 4 or 8 (a divisor of 32 the histogram can hold)")
    B, c, n = score.shape
    kth = torch.empty(B, c, dtype=torch.float32, device=score.device)
    if B == 0 or c == 0 or n == 0 or k == 0:
        return kth.fill_(float("-inf"))
    score = _last_contig(score)
    if _interpreting():
        _fix_interpreter_loop_bounds()
    _kth_score_kernel[(c, B)](score, kth, score.stride(0), score.stride(1), kth.stride(0), n, min(k, n),
                              RBITS=rbits, BLOCK_N=block_n, num_warps=4)
    return kth


def kth_group_size(n: int, k: int) -> int:
    """The group width G for `kth_scores_grouped`: the power of two nearest sqrt(n / k), so that the two
    top-k calls see about as many scores each (n / G group maxima, k x G gathered); 1 (plain topk) where
    the row holds fewer than 4 k scores."""
    if k <= 0 or n < 4 * k:
        return 1
    return 1 << max(0, round(math.log2(math.sqrt(n / k))))


def kth_scores_grouped(score: torch.Tensor, k: int, group: int | None = None) -> torch.Tensor:
    """fp32 [B, c, n] -> fp32 [B, c]: each row's min(k, n)-th largest score (as `score.topk(min(k, n))
    .values.amin(-1)`), exactly, from two smaller top-k calls. Split the row into groups of G consecutive
    scores and take the k groups with the largest maxima; T, the k-th largest maximum, is <= v_k, the row's
    k-th largest score (k groups each hold a score >= T). So every score > v_k sits in a group whose maximum
    exceeds T, one of the k chosen (fewer than k groups have a maximum above T); and the chosen groups hold
    k scores >= v_k: when v_k > T those equal to v_k sit in groups above T, when v_k = T each chosen group's
    maximum is one. The k-th largest of the chosen groups' k x G scores is therefore v_k. Work: n / G + k x G
    scores through topk instead of n (16,384 -> 6,144 for a 128k query's pools, 131,072 -> 16,384 at 1M).
    On the H200 (call 49) it is exact (the same pools on every row) and slower: the path 107 vs 95 ms at 128k,
    16.8 vs 9.1 ms at 32k: torch.topk's time follows its calls and rows, not the scores it sees."""
    B, c, n = score.shape
    kk = min(k, n)
    G = group or kth_group_size(n, kk)
    if kk == 0 or c == 0 or B == 0:
        return torch.full((B, c), float("-inf"), dtype=torch.float32, device=score.device)
    ng = -(-n // G)
    if G == 1 or ng <= kk:  # every group would be chosen: the row itself
        return score.topk(kk, dim=-1, sorted=False).values.amin(-1).contiguous()
    full = n // G * G
    gmax = score[..., :full].unflatten(-1, (n // G, G)).amax(-1)
    if full < n:  # the ragged last group
        gmax = torch.cat([gmax, score[..., full:].amax(-1, keepdim=True)], -1)
    groups = gmax.topk(kk, dim=-1, sorted=False).indices  # [B, c, k]
    cols = (groups[..., None] * G + torch.arange(G, device=score.device)).flatten(-2)  # [B, c, k x G]
    vals = score.gather(-1, cols.clamp(max=n - 1))
    vals = vals.masked_fill(cols >= n, float("-inf"))  # past the ragged group's end
    return vals.topk(kk, dim=-1, sorted=False).values.amin(-1).contiguous()


def select_from_scores_triton(score: torch.Tensor, k: int, block_m: int = 4, block_n: int = 256,
                              kth: str = "topk") -> torch.Tensor:
    """fp32 [B, c, n] scores (-inf = not selectable) -> int32 [B, c, k]: `naive.select_from_scores`'
    function (top k, ties to the lower pool id, ascending, -1 padded), with each row's k-th score from
    torch.topk (`kth="topk"`), `_kth_score_kernel` (`kth="radix"`) or `kth_scores_grouped` (`kth="grouped"`)
    and one Triton kernel for the rest
    (instead of ~8 torch passes over the scores)."""
    if kth not in KTH_METHODS:
        raise ValueError(f"select_from_scores_triton: kth={kth!r}; use one of {', '.join(KTH_METHODS)}")
    B, c, n = score.shape
    out = torch.empty(B, c, k, dtype=torch.int32, device=score.device)
    if k == 0:
        return out
    if n == 0 or c == 0:
        return out.fill_(-1)
    score = _last_contig(score)
    if kth == "radix":
        kth = kth_scores_triton(score, k)
    elif kth == "grouped":
        kth = kth_scores_grouped(score, k)
    else:
        kth = score.topk(min(k, n), dim=-1, sorted=False).values.amin(-1).contiguous()  # -inf: fewer than k selectable
    if _interpreting():
        _fix_interpreter_loop_bounds()
    _emit_from_scores_kernel[(triton.cdiv(c, block_m), B)](
        score, kth, out, score.stride(0), score.stride(1), kth.stride(0), out.stride(0), out.stride(1),
        c, n, k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, num_warps=4,
    )
    return out


def kpool_scores_triton(q: torch.Tensor, w: torch.Tensor, pk: torch.Tensor, pool: int, n_cols: int,
                        q_offset: int = 0, cfg: dict | None = None) -> torch.Tensor:
    """fp32 [B, S, n_cols]: sum_h w relu(q . pk) of every query and pool n < n_cols, -inf where the pool
    is not selectable (not complete by the query's absolute position q_offset + t, or n >= NP)."""
    _check(q, w, pk, pool, 0, q_offset)
    q, pk = _last_contig(q), _last_contig(pk)
    B, S, H, D = q.shape
    c = {**_cfg(H, D), "TILES": 8, **(cfg or {})}
    out = torch.empty(B, S, n_cols, dtype=torch.float32, device=q.device)
    if B == 0 or S == 0 or n_cols == 0:
        return out
    if _interpreting():
        _fix_interpreter_loop_bounds()
    grid = (triton.cdiv(S, c["BLOCK_M"]), triton.cdiv(n_cols, c["BLOCK_N"] * c["TILES"]), B)
    _kpool_score_kernel[grid](
        q, w, pk, out,
        q.stride(0), q.stride(1), q.stride(2),
        w.stride(0), w.stride(1), w.stride(2),
        pk.stride(0), pk.stride(1),
        out.stride(0), out.stride(1),
        S, H, pk.shape[1], n_cols, pool, q_offset,
        D=D, BLOCK_D=c["BLOCK_D"], BLOCK_H=c["BLOCK_H"], BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], TILES=c["TILES"],
        PREC="ieee" if q.dtype == torch.float32 or _interpreting() else "tf32",
        DOT_F32=_interpreting() and q.dtype != torch.float32,
        num_warps=c["num_warps"], num_stages=c["num_stages"],
    )
    return out


def kpool_topk_two_phase(q: torch.Tensor, w: torch.Tensor, pk: torch.Tensor, pool: int, k_pools: int,
                         chunk: int = 1024, q_offset: int = 0, cfg: dict | None = None,
                         select: str = "triton", kth: str = "topk") -> torch.Tensor:
    """int32 [B, S, k_pools], the same function as `naive.kpool_topk_torch`: `chunk` queries are scored
    into an fp32 [B, chunk, pools they can see] buffer by the Triton kernel, then selected: `select`
    "triton" (the k-th score by `kth`, "topk" or "radix", + the emit kernel) or "torch"
    (`naive.select_from_scores`).
    Extra memory: that buffer and the selection's temporaries (O(chunk x pools))."""
    _check(q, w, pk, pool, k_pools, q_offset)
    if chunk < 1:
        raise ValueError(f"kpool_topk_two_phase: chunk={chunk}; use a positive number of queries")
    if select not in ("triton", "torch"):
        raise ValueError(f"kpool_topk_two_phase: select={select!r}; use 'triton' or 'torch'")
    B, S = q.shape[:2]
    NP = pk.shape[1]
    out = torch.full((B, S, k_pools), -1, dtype=torch.int32, device=q.device)
    if S == 0 or k_pools == 0:
        return out
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        n = min(NP, (q_offset + s1) // pool)  # pools the chunk's last query can see
        if n == 0:
            continue
        score = kpool_scores_triton(q[:, s0:s1], w[:, s0:s1], pk, pool, n, q_offset=q_offset + s0, cfg=cfg)
        if select == "triton":
            out[:, s0:s1] = select_from_scores_triton(score, k_pools, kth=kth)
        else:
            out[:, s0:s1] = select_from_scores(score, score != float("-inf"), k_pools)
    return out
