"""Two-phase k-pool indexer: a Triton kernel scores a block of queries into an fp32 buffer, then
`select_from_scores` (torch.topk for the k-th score, the twin's tie rule) picks the pools.

Why a second design beside the fused kernel (`triton_kernel.py`): the fused kernel never stores a
score, but it recomputes every tile 1 + passes times (~5 sweeps) and each sweep runs at ~10% of the
MMA rate (bench/NOTES.md, "indexer"): 52x the single-sweep floor at 128k. Here the tiles are scored
once (MMA, ReLU, weighted head sum, no histogram) and written to HBM, O(chunk x pools) memory, and
the selection is torch's. Whether that is faster depends on torch.topk over the causal rows, which
`bench/indexer.py --probe` measures; until then the layers keep the fused kernel and this path is
reached only through `kpool_topk_two_phase` (the benchmark and the tests).

Same function as `naive.kpool_topk_torch` (ascending int32 pool ids, -1 padded, ties to the lower pool
id); the scores are the fused kernel's tile scores (`_tile_scores`, one code path), so on inputs whose
fp32 scores are exact the ids equal the twin's and the fused kernel's id for id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .naive import select_from_scores
from .triton_kernel import _cfg, _check, _fix_interpreter_loop_bounds, _interpreting, _last_contig, _tile_scores


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

    rows = tl.arange(0, BLOCK_M * BLOCK_H)  # (query m, head h) pairs: row = m * BLOCK_H + h
    rm = rows // BLOCK_H
    rh = rows % BLOCK_H
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_ok = ((t0 + rm) < S) & (rh < H)
    q = tl.load(Q + b * stride_qb + (t0 + rm)[:, None].to(tl.int64) * stride_qs + rh[:, None] * stride_qh
                + offs_d[None, :], mask=q_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    offs_m = tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, BLOCK_H)
    t = t0 + offs_m
    m_ok = t < S
    w = tl.load(W + b * stride_wb + t[:, None].to(tl.int64) * stride_ws + offs_h[None, :] * stride_wh,
                mask=m_ok[:, None] & (offs_h[None, :] < H), other=0.0).to(tl.float32)
    w3 = tl.reshape(w, [BLOCK_M, BLOCK_H, 1])
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
                         chunk: int = 1024, q_offset: int = 0, cfg: dict | None = None) -> torch.Tensor:
    """int32 [B, S, k_pools], the same function as `naive.kpool_topk_torch`: `chunk` queries are scored
    into an fp32 [B, chunk, pools they can see] buffer by the Triton kernel, then selected in torch.
    Extra memory: that buffer and select_from_scores' temporaries (O(chunk x pools))."""
    _check(q, w, pk, pool, k_pools, q_offset)
    if chunk < 1:
        raise ValueError(f"kpool_topk_two_phase: chunk={chunk}; use a positive number of queries")
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
        out[:, s0:s1] = select_from_scores(score, score != float("-inf"), k_pools)
    return out
