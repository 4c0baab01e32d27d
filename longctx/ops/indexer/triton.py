"""The k-pool indexer's Triton path, in two phases: a score kernel writes a block of queries' fp32 scores
against every pool into a buffer, then a selection picks each row's pools (those above its k-th score,
then the ones equal to it in pool order).

Same function as `naive.kpool_topk_torch` (ascending int32 pool ids, -1 padded, ties to the lower pool
id): on inputs whose fp32 scores are exact the ids equal the twin's id for id.

Why two phases. A single kernel that never stores a score (a radix select over the fp32 bits of the
scores, recomputing every tile on each of its ~4 passes) keeps only its output, but its per-score
epilogue (ReLU, weighting, head sum, histogram) runs on every pass and dominates it, about three times
the two phases' time at 128k tokens on the H200 (docs/design/indexer.md). Here the tiles are scored
once (MMA, ReLU, weighted head sum; a strip of pool tiles per program so q stays on chip) into
O(chunk x pools) memory. The MMA runs pools x (head, query) pairs so that every head of a score lands in one
thread's registers and the head sum needs no shuffles (docs/design/indexer.md, "The score kernel's MMA").

The selection, by row width, the same result every way. Rows of up to ROW_AUTO scores go to one kernel
a row that holds the row in registers, finds its k-th score by a four-way search over order-preserving
uint32 keys and emits with prefix sums: one read of the row. Longer rows go to "compact": the score kernel
also writes each 16 pools' largest score; the k-th largest of those bounds the row's k-th score from
below, so one kernel keeps the scores at or above it (at most k x 16 by construction, in pool order),
reading only the at most k groups that can hold one, and a second runs the row kernel's selection over
them. On the H200 (bench/indexer.py --select-widths, 1,024
rows, k = 512) "compact" takes 0.24 ms at 32,768 scores a row against 1.06 for the row kernel and 0.80 for
torch.topk + emit, and 1.09 against 20.7 ms (topk + emit) at 1,048,576; the whole path at 128k tokens 39.8
against 81.7 ms (topk + emit on every row). torch.topk + emit stays as the baseline and for rows whose
buffer would not fit (past 4M tokens). docs/design/indexer.md has the floor and what would approach it.

Runs on CUDA tensors, and on CPU tensors under `TRITON_INTERPRET=1` (the CPU tests do that).
Shapes it cannot take raise a ValueError naming the shape.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import triton_interpreting as _interpreting
from . import GROUP, ROW_CAP, auto_method, compact_group
from .naive import select_from_scores

_MAX_HEADS = 128
_MAX_D = 256
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _load_query_block(Q, W, b, t0, stride_qb, stride_qs, stride_qh, stride_wb, stride_ws, stride_wh, S, H,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr,
                      DOT_F32: tl.constexpr):
    """The MMA operand of queries t0 .. t0+BLOCK_M-1, transposed: its columns are (head h, query m) pairs,
    column = h * BLOCK_M + m, [BLOCK_D, BLOCK_H * BLOCK_M]; their head weights as [1, BLOCK_H, BLOCK_M] fp32;
    and the masks. With the heads in the column's high bits, the MMA's accumulator holds every head of a
    (pool, query) pair in one thread's registers, so the head sum needs no shuffles."""
    cols = tl.arange(0, BLOCK_H * BLOCK_M)
    ch = cols // BLOCK_M
    cm = cols % BLOCK_M
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_ok = ((t0 + cm) < S) & (ch < H)
    qt = tl.load(Q + b * stride_qb + (t0 + cm)[None, :].to(tl.int64) * stride_qs
                 + ch[None, :].to(tl.int64) * stride_qh + offs_d[:, None],
                 mask=q_ok[None, :] & d_ok[:, None], other=0.0)
    if DOT_F32:
        qt = qt.to(tl.float32)
    offs_m = tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, BLOCK_H)
    t = t0 + offs_m
    m_ok = t < S
    w = tl.load(W + b * stride_wb + t[None, :].to(tl.int64) * stride_ws + offs_h[:, None].to(tl.int64) * stride_wh,
                mask=m_ok[None, :] & (offs_h[:, None] < H), other=0.0).to(tl.float32)
    return qt, tl.reshape(w, [1, BLOCK_H, BLOCK_M]), offs_d, d_ok, offs_m, t, m_ok


@triton.jit
def _tile_scores(qt, w3, pk_base, stride_pn, n0, NP, offs_d, d_ok, pos, P,
                 BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
                 DOT_F32: tl.constexpr, INTERIOR: tl.constexpr):
    """fp32 scores of BLOCK_M queries x BLOCK_N pools, [BLOCK_M, BLOCK_N], and the pool ids. The MMA runs
    pools x (head, query) pairs, the pools as its M dimension. -0.0 (every head's ReLU zero under negative
    weights) is left as it is: the selections fold it into +0.0 where they make keys. INTERIOR: every pool
    of the tile exists and every query sees it, so nothing is masked."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if INTERIOR:
        k = tl.load(pk_base + offs_n[:, None] * stride_pn + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    else:
        k = tl.load(pk_base + offs_n[:, None] * stride_pn + offs_d[None, :],
                    mask=d_ok[None, :] & (offs_n < NP)[:, None], other=0.0)
    if DOT_F32:  # interpreter only: its dot multiplies bf16 storage bits as integers
        k = k.to(tl.float32)
    s = tl.dot(k, qt, input_precision=PREC)  # [BLOCK_N, BLOCK_H * BLOCK_M], fp32
    s = tl.reshape(tl.maximum(s, 0.0), [BLOCK_N, BLOCK_H, BLOCK_M])
    sc = tl.trans(tl.sum(s * w3, axis=1))  # [BLOCK_M, BLOCK_N]
    if not INTERIOR:
        valid = (offs_n < NP)[None, :] & (offs_n[None, :] * P + (P - 1) <= pos[:, None])
        sc = tl.where(valid, sc, float("-inf"))
    return sc, offs_n


@triton.jit
def _store_group_maxima(sc, gm_rows, n0, m_ok, NC, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        GROUP: tl.constexpr, MASKED: tl.constexpr, EMPTY: tl.constexpr):
    """GM[rows, n0 / GROUP + j] = the largest of a [BLOCK_M, BLOCK_N] score tile's j-th GROUP columns; MASKED
    for the tiles at the causal diagonal or the row block's end (an interior tile has every row and group);
    EMPTY for a tile past every row's causal limit (sc unused: -inf, without reducing a constant tile)."""
    if EMPTY:
        gm = tl.full([BLOCK_M, BLOCK_N // GROUP], float("-inf"), tl.float32)
    else:
        gm = tl.max(tl.reshape(sc, [BLOCK_M, BLOCK_N // GROUP, GROUP]), axis=2)
    offs_g = n0 // GROUP + tl.arange(0, BLOCK_N // GROUP)
    if MASKED:
        tl.store(gm_rows[:, None] + offs_g[None, :], gm, mask=m_ok[:, None] & (offs_g[None, :] * GROUP < NC))
    else:
        tl.store(gm_rows[:, None] + offs_g[None, :], gm)


@triton.jit
def _kpool_score_kernel(
    Q, W, PK, OUT, GM,
    stride_qb, stride_qs, stride_qh,
    stride_wb, stride_ws, stride_wh,
    stride_pb, stride_pn,
    stride_ob, stride_os,
    stride_gb, stride_gs,
    S, H, NP, NC, P, q_offset,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
    PREC: tl.constexpr, DOT_F32: tl.constexpr, GROUP: tl.constexpr,
):
    """OUT[b, t, n] = score of query t and pool n for n < NC (-inf where pool n is not selectable); with
    GROUP > 0 also GM[b, t, j] = the largest of OUT[b, t, j GROUP : (j + 1) GROUP] (`_compact_kernel`'s
    group maxima, from the tile in registers). One program: BLOCK_M queries x a strip of TILES pool tiles
    (q stays on chip across the strip)."""
    blk = tl.program_id(0)
    strip = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    t0 = blk * BLOCK_M

    qt, w3, offs_d, d_ok, _, t, m_ok = _load_query_block(
        Q, W, b, t0, stride_qb, stride_qs, stride_qh, stride_wb, stride_ws, stride_wh, S, H,
        D, BLOCK_D, BLOCK_H, BLOCK_M, DOT_F32)
    pk_base = PK + b * stride_pb
    pos = q_offset + t
    n_hi = tl.minimum((q_offset + tl.minimum(t0 + BLOCK_M, S)) // P, NP)  # pools any row of the block sees
    out_rows = OUT + b * stride_ob + t.to(tl.int64) * stride_os
    gm_rows = GM + b * stride_gb + t.to(tl.int64) * stride_gs
    rows_full = t0 + BLOCK_M <= S
    for i in tl.static_range(TILES):
        n0 = (strip * TILES + i) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = m_ok[:, None] & (offs_n[None, :] < NC)
        # most tiles lie below the causal diagonal: their loads, scores and stores need no masks
        if rows_full & (n0 + BLOCK_N <= NC) & ((n0 + BLOCK_N) * P <= q_offset + t0 + 1):
            sc, offs_n = _tile_scores(qt, w3, pk_base, stride_pn, n0, NP, offs_d, d_ok, pos, P,
                                      BLOCK_M, BLOCK_H, BLOCK_N, PREC, DOT_F32, True)
            tl.store(out_rows[:, None] + offs_n[None, :], sc)
            if GROUP > 0:
                _store_group_maxima(sc, gm_rows, n0, m_ok, NC, BLOCK_M, BLOCK_N, GROUP, False, False)
        elif n0 < n_hi:
            sc, offs_n = _tile_scores(qt, w3, pk_base, stride_pn, n0, NP, offs_d, d_ok, pos, P,
                                      BLOCK_M, BLOCK_H, BLOCK_N, PREC, DOT_F32, False)
            sc = tl.where(ok, sc, float("-inf"))
            tl.store(out_rows[:, None] + offs_n[None, :], sc, mask=ok)
            if GROUP > 0:
                _store_group_maxima(sc, gm_rows, n0, m_ok, NC, BLOCK_M, BLOCK_N, GROUP, True, False)
        elif n0 < NC:
            tl.store(out_rows[:, None] + offs_n[None, :], tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32),
                     mask=ok)
            if GROUP > 0:
                _store_group_maxima(None, gm_rows, n0, m_ok, NC, BLOCK_M, BLOCK_N, GROUP, True, True)


@triton.jit
def _emit_from_scores_kernel(
    SC, KTH, OUT,
    stride_sb, stride_ss, stride_kb, stride_ob, stride_os,
    S, NC, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """OUT[b, t, :K] = the pools of row t above its k-th score KTH[b, t], then the first ones equal to it
    in pool order (ties to the lower id), ascending, -1 padded; -inf scores are never taken. Two reads
    of the row: count those above, then emit."""
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
def _ordered_key(sc):
    """fp32 -> uint32 keys in the floats' order; -0.0 (a score whose heads all fell to ReLU's zero under
    negative weights) and +0.0 get one key, since equal floats must."""
    bits = tl.where(sc == 0.0, 0.0, sc).to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _kth_key(key, valid, K):
    """The K-th largest of the valid uint32 order keys (int64), or 1 where at most K are valid (a valid key
    is >= 0x00800000, -FLT_MAX's, so every valid key is above it). A search for the largest key T with
    count(key >= T) >= K, four-way (three counts per step, packed in one int64 sum so a step costs one
    reduction) and done early where a count is exactly K."""
    n_valid = tl.sum(valid.to(tl.int32), 0)
    lo = tl.min(tl.where(valid, key, 0xFFFFFFFF), 0).to(tl.int64)
    hi = tl.max(key, 0).to(tl.int64)
    if n_valid <= K:  # every valid key is taken
        lo = hi * 0 + 1
        hi = lo
    # invariant: count(key >= lo) >= K > count(key > hi)
    while lo < hi:
        step = tl.maximum((hi - lo + 1) // 4, 1)
        m1 = tl.minimum(lo + step, hi)
        m2 = tl.minimum(lo + 2 * step, hi)
        m3 = tl.minimum(lo + 3 * step, hi)
        packed = ((key >= m1.to(tl.uint32)).to(tl.int64) + ((key >= m2.to(tl.uint32)).to(tl.int64) << 20)
                  + ((key >= m3.to(tl.uint32)).to(tl.int64) << 40))
        cnt = tl.sum(packed, 0)
        c1 = cnt & 0xFFFFF
        c2 = (cnt >> 20) & 0xFFFFF
        c3 = cnt >> 40
        exact = tl.where(c3 == K, m3, tl.where(c2 == K, m2, tl.where(c1 == K, m1, -1)))
        if exact >= 0:  # the K-th key is the least key at or above that threshold
            lo = tl.min(tl.where(key >= exact.to(tl.uint32), key, 0xFFFFFFFF), 0).to(tl.int64)
            hi = lo
        else:
            new_lo = tl.where(c3 >= K, m3, tl.where(c2 >= K, m2, tl.where(c1 >= K, m1, lo)))
            hi = tl.where(c1 < K, m1 - 1, tl.where(c2 < K, m2 - 1, tl.where(c3 < K, m3 - 1, hi)))
            lo = new_lo
    return lo


@triton.jit
def _select_loaded_row(sc, ids, K, out_row, BLOCK_K: tl.constexpr):
    """Write the K best of one row held in registers (fp32 scores, -inf = not selectable; `ids` their pool
    ids, ascending) to out_row[:K]: those above the K-th score, then the first ones equal to it (ties to the
    lower id), ascending, -1 padded."""
    valid = sc != float("-inf")
    key = tl.where(valid, _ordered_key(sc), 0)
    thr = _kth_key(key, valid, K).to(tl.uint32)
    gt = valid & (key > thr)
    eq = valid & (key == thr)
    need = K - tl.sum(gt.to(tl.int32), 0)
    take = gt | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= need))
    slot = tl.cumsum(take.to(tl.int32), 0) - 1
    tl.store(out_row + slot, ids, mask=take & (slot < K))
    n_taken = tl.minimum(tl.sum(take.to(tl.int32), 0), K)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        tl.store(out_row + offs_k, tl.full([BLOCK_K], -1, tl.int32), mask=(offs_k >= n_taken) & (offs_k < K))


@triton.jit
def _select_rows_kernel(
    SC, OUT,
    stride_sb, stride_ss, stride_ob, stride_os,
    NC, K,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """OUT[b, t, :K]: `_emit_from_scores_kernel`'s function with the k-th score found in the kernel. One
    program holds one whole row in registers (one read of it), finds its k-th key (`_kth_key`) and emits
    with prefix sums for the tie ranks and the output slots."""
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    sc = tl.load(SC + b * stride_sb + t * stride_ss + offs, mask=offs < NC, other=float("-inf"))
    _select_loaded_row(sc, offs, K, OUT + b * stride_ob + t * stride_os, BLOCK_K)


@triton.jit
def _compact_kernel(
    SC, GM, GS, CS, CI, CNT,
    stride_sb, stride_ss, stride_gb, stride_gs, stride_xb, stride_xs, stride_cb, stride_cs, stride_nb,
    NC, NG, K, CAP,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, GP: tl.constexpr,
):
    """Each row's candidates for its K best, in pool order, into CS (scores) / CI (pool ids) [b, t, :CAP]
    and their count into CNT[b, t]. GM holds the row's group maxima (the largest score of each group of
    GP consecutive pools, -inf for a group with nothing selectable). T, the K-th largest group maximum, is
    at most the row's K-th score (K groups reach it, one score each), so the K best are among the scores
    >= T. The c < K groups with a maximum above T hold at most c GP scores above it, and at least c of
    them, so at most K - c scores equal to T are needed (the first ones in pool order: the tie rule's).
    Keeping just those, at most c GP + K - c <= K GP = CAP scores are kept: the buffer never overflows,
    whatever the scores. Where at most K groups are valid, every valid score is kept (at most K GP
    again).

    Only groups that can hold a candidate are read: the c groups above T and the first K - c groups whose
    maximum equals T (each holds a score equal to T, so any later one's come after K - c others). Their
    ids go to GS[b, t, :K] (at most K of them), and the pass reads those groups' scores alone: at most
    K GP scores a row instead of the whole row."""
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    gm = tl.load(GM + b * stride_gb + t * stride_gs + offs_g, mask=offs_g < NG, other=float("-inf"))
    gvalid = gm != float("-inf")
    gkey = tl.where(gvalid, _ordered_key(gm), 0)
    thr = _kth_key(gkey, gvalid, K).to(tl.uint32)
    ggt = gvalid & (gkey > thr)
    geq = gvalid & (gkey == thr)
    need_eq = K - tl.sum(ggt.to(tl.int32), 0)
    gsel = ggt | (geq & (tl.cumsum(geq.to(tl.int32), 0) <= need_eq))
    n_sel = tl.sum(gsel.to(tl.int32), 0)
    gs_row = GS + b * stride_xb + t * stride_xs
    tl.store(gs_row + tl.cumsum(gsel.to(tl.int32), 0) - 1, offs_g, mask=gsel)
    tl.debug_barrier()  # the group ids this program's threads wrote are read back by others
    row = SC + b * stride_sb + t * stride_ss
    c_row = b * stride_cb + t * stride_cs
    cnt = tl.zeros([], dtype=tl.int32)
    seen = tl.zeros([], dtype=tl.int32)
    lane = tl.arange(0, BLOCK_S)
    for j0 in range(0, n_sel * GP, BLOCK_S):  # BLOCK_S // GP selected groups a step, in pool order
        jj = (j0 + lane) // GP
        on = jj < n_sel
        offs = tl.load(gs_row + jj, mask=on, other=0) * GP + lane % GP
        sc = tl.load(row + offs, mask=on & (offs < NC), other=float("-inf"))
        valid = sc != float("-inf")
        key = tl.where(valid, _ordered_key(sc), 0)
        gt = valid & (key > thr)
        eq = valid & (key == thr)
        both = tl.sum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), 0)  # one reduction for the two counts
        n_eq = both >> 16
        if seen + n_eq <= need_eq:
            keep = gt | eq
            n_keep = (both & 0xFFFF) + n_eq
        else:
            keep = gt | (eq & (seen + tl.cumsum(eq.to(tl.int32), 0) <= need_eq))
            n_keep = tl.sum(keep.to(tl.int32), 0)
        slot = cnt + tl.cumsum(keep.to(tl.int32), 0) - 1
        ok = keep & (slot < CAP)
        tl.store(CS + c_row + slot, sc, mask=ok)
        tl.store(CI + c_row + slot, offs, mask=ok)
        cnt += n_keep
        seen += n_eq
    tl.store(CNT + b * stride_nb + t, tl.minimum(cnt, CAP))


@triton.jit
def _select_candidates_kernel(
    CS, CI, CNT, OUT,
    stride_cb, stride_cs, stride_nb, stride_ob, stride_os,
    K,
    SMALL: tl.constexpr, MID: tl.constexpr, BIG: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """OUT[b, t, :K] from `_compact_kernel`'s candidates (in pool order): the row kernel's selection over
    them, in the smallest of three blocks that holds the count (SMALL the usual case: a little over K)."""
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    n = tl.load(CNT + b * stride_nb + t)
    c_row = b * stride_cb + t * stride_cs
    out_row = OUT + b * stride_ob + t * stride_os
    if n <= SMALL:
        _select_candidate_block(CS + c_row, CI + c_row, n, K, out_row, SMALL, BLOCK_K)
    elif n <= MID:
        _select_candidate_block(CS + c_row, CI + c_row, n, K, out_row, MID, BLOCK_K)
    else:
        _select_candidate_block(CS + c_row, CI + c_row, n, K, out_row, BIG, BLOCK_K)


@triton.jit
def _select_candidate_block(cs_row, ci_row, n, K, out_row, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """The row kernel's selection over a row's n candidates, loaded into a BLOCK (its own function: the
    compiler takes no branches whose tensors differ in shape)."""
    offs = tl.arange(0, BLOCK)
    sc = tl.load(cs_row + offs, mask=offs < n, other=float("-inf"))
    ids = tl.load(ci_row + offs, mask=offs < n, other=-1)
    _select_loaded_row(sc, ids, K, out_row, BLOCK_K)


def _fix_interpreter_loop_bounds() -> None:
    """Let the Triton interpreter loop to a bound computed in the kernel.

    triton 3.6's interpreter keeps scalars as 1-element numpy arrays and turns a `range` bound into
    an int with int(array), which numpy >= 2.3 refuses for arrays that are not 0-d. The kernel's
    per-program loop bounds (its causal range) hit that, so under TRITON_INTERPRET=1 we read the
    single element instead. Compiled kernels are untouched.
    """
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_scalar_index_fix", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._scalar_index_fix = True
    interpreter._patch_lang_tensor = patched


def _check(q: torch.Tensor, w: torch.Tensor, pk: torch.Tensor, pool: int, k_pools: int, q_offset: int) -> None:
    """Raise a ValueError naming the shape when the kernel cannot take it."""
    from .naive import _check as check_shapes

    check_shapes(q, w, pk, pool, k_pools, "kpool_topk_triton")
    _, S, H, D = q.shape
    if not 1 <= D <= _MAX_D:
        raise ValueError(f"kpool_topk_triton: head dim D={D} unsupported; supported 1..{_MAX_D}")
    if not 1 <= H <= _MAX_HEADS:
        raise ValueError(f"kpool_topk_triton: H={H} heads unsupported; supported 1..{_MAX_HEADS}")
    if q.dtype not in _DTYPES or pk.dtype != q.dtype:
        raise ValueError(
            f"kpool_topk_triton: dtypes q {q.dtype}, pk {pk.dtype} unsupported; "
            f"q and pk must share one of bfloat16, float16, float32"
        )
    if not w.dtype.is_floating_point:
        raise ValueError(f"kpool_topk_triton: w dtype {w.dtype} unsupported; use a float dtype (read as fp32)")
    if q_offset < 0 or q_offset + S >= 2**31 or pk.shape[1] * pool >= 2**31:
        raise ValueError(
            f"kpool_topk_triton: q_offset={q_offset}, S={S}, NP={pk.shape[1]}, pool={pool} unsupported; "
            f"positions must be in [0, 2^31)"
        )
    devs = {q.device, w.device, pk.device}
    if len(devs) != 1:
        raise ValueError(f"kpool_topk_triton: tensors on different devices {sorted(map(str, devs))}")
    dev = q.device
    if dev.type != "cuda" and not (dev.type == "cpu" and _interpreting()):
        raise ValueError(
            f"kpool_topk_triton: device {dev} unsupported; needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1)"
        )


def _cfg(H: int, D: int) -> dict:
    """Tile sizes: 64 pools (the MMA's M, one warpgroup) x 128 (head, query) columns per tile, a strip of 8
    tiles per program. At h200-ref's 16 x 64 this builds to 127 registers (four programs an SM) and beats
    128 pools on 8 warps (140 registers) by 8-17% at 128k (`bench/indexer.py --sweep`)."""
    block_h = triton.next_power_of_2(H)
    block_m = max(1, min(64, 128 // block_h))
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "TILES": 8, "BLOCK_H": block_h,
            "BLOCK_D": max(16, triton.next_power_of_2(D)), "num_warps": 4, "num_stages": 2}


def _last_contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


COMPACT_BLOCK_S = 8192  # scores a step of `_compact_kernel`'s pass over a row
COMPACT_WARPS = 8  # `_compact_kernel`'s warps (more where its group maxima need them)
# scores a warp holds in the row and candidate kernels (up to 32 warps): at 2,048 their sm_90 builds for
# rows of 8,192 spill (candidates 524 bytes, rows 48); at 1,024 they build without spills (224, 222 registers)
SELECT_PER_WARP = 1024
SELECTS = ("auto", "rows", "compact", "topk")
SELECT_ENV = "LONGCTX_INDEXER_SELECT"  # kpool_topk_triton's selection for a whole run (benchmark comparisons)


def _select_warps(block: int) -> int:
    return min(32, max(4, block // SELECT_PER_WARP))


def group_maxima(score: torch.Tensor, group: int) -> torch.Tensor:
    """[..., n] -> [..., ceil(n / group)]: the largest score of each `group` consecutive ones (-inf pads)."""
    n = score.shape[-1]
    pad = (-n) % group
    if pad:
        score = torch.nn.functional.pad(score, (0, pad), value=float("-inf"))
    return score.unflatten(-1, (-1, group)).amax(-1)


def compact_workspace(B: int, rows: int, k: int, group: int, device) -> dict:
    """"compact"'s temporaries for `rows` rows at `group`: the ids of the groups a row reads (k a row), its
    candidates' scores and ids (k x group a row) and their count; a caller running many passes allocates
    them once (`_compact` takes views of the first rows)."""
    return {"gs": torch.empty(B, rows, k, dtype=torch.int32, device=device),
            "cs": torch.empty(B, rows, k * group, dtype=torch.float32, device=device),
            "ci": torch.empty(B, rows, k * group, dtype=torch.int32, device=device),
            "cnt": torch.empty(B, rows, dtype=torch.int32, device=device)}


def _compact(score: torch.Tensor, k: int, gmax: torch.Tensor | None, group: int, work: dict | None = None):
    """`_compact_kernel` on [B, c, n] scores: the candidates' scores, ids, counts and the buffer's width.
    `work`: `compact_workspace`'s buffers for at least c rows and this group (else allocated here)."""
    B, c, n = score.shape
    if gmax is None or gmax.shape[-1] != triton.cdiv(n, group):  # none, or GROUP's: coarsen to the group
        gmax = group_maxima(score, group) if gmax is None else group_maxima(gmax, group // GROUP)
    gmax = _last_contig(gmax)
    ng = gmax.shape[-1]
    cap = k * group
    if work is None or work["cs"].shape[-1] < cap:
        work = compact_workspace(B, c, k, group, score.device)
    gs, cnt = work["gs"][:, :c], work["cnt"][:, :c]
    cs, ci = work["cs"][:, :c, :cap], work["ci"][:, :c, :cap]
    block_g = max(16, triton.next_power_of_2(ng))
    _compact_kernel[(c, B)](
        score, gmax, gs, cs, ci, cnt,
        score.stride(0), score.stride(1), gmax.stride(0), gmax.stride(1), gs.stride(0), gs.stride(1),
        cs.stride(0), cs.stride(1), cnt.stride(0),
        n, ng, k, cap, BLOCK_G=block_g, BLOCK_S=max(COMPACT_BLOCK_S, group), GP=group,
        num_warps=min(16, max(COMPACT_WARPS, block_g // 1024)),
    )
    return cs, ci, cnt, cap


def compact_candidates(score: torch.Tensor, k: int, gmax: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [B, c]: how many candidates "compact" keeps a row (at least min(k, selectable), at most k x
    group): what its second kernel selects from (the benchmark records them)."""
    if _interpreting():
        _fix_interpreter_loop_bounds()
    group = compact_group(score.shape[-1], k)
    if group is None:
        raise ValueError(f"compact_candidates: rows of {score.shape[-1]} with k={k} do not fit method='compact'")
    return _compact(_last_contig(score), k, gmax, group)[2]


def _select_compact(score: torch.Tensor, k: int, out: torch.Tensor, gmax: torch.Tensor | None, group: int,
                    work: dict | None = None) -> None:
    """"compact": each row's scores above the k-th largest of its group maxima (a lower bound of its k-th
    score) into a buffer of k x group, then the row kernel's selection over those candidates."""
    B, c, _ = score.shape
    cs, ci, cnt, cap = _compact(score, k, gmax, group, work)
    big = max(16, triton.next_power_of_2(cap))
    _select_candidates_kernel[(c, B)](
        cs, ci, cnt, out, cs.stride(0), cs.stride(1), cnt.stride(0), out.stride(0), out.stride(1), k,
        SMALL=min(big, max(16, triton.next_power_of_2(2 * k))), MID=min(big, max(16, triton.next_power_of_2(8 * k))),
        BIG=big, BLOCK_K=min(1024, max(16, triton.next_power_of_2(k))),
        num_warps=_select_warps(big),
    )


def select_from_scores_triton(score: torch.Tensor, k: int, block_m: int = 4, block_n: int = 256,
                              method: str = "auto", gmax: torch.Tensor | None = None,
                              out: torch.Tensor | None = None, work: dict | None = None) -> torch.Tensor:
    """fp32 [B, c, n] scores (-inf = not selectable) -> int32 [B, c, k]: `naive.select_from_scores`'
    function (top k, ties to the lower pool id, ascending, -1 padded). `method`:

    - "rows": one kernel a row finds its k-th score and emits from one read of the row held in registers
      (`_select_rows_kernel`; rows of at most ROW_CAP scores);
    - "compact": the scores at or above the k-th largest of the row's group maxima (`gmax`, [B, c,
      ceil(n / GROUP)], as the score kernel writes them; computed here when not given) go to a buffer of
      at most k x group, then the row kernel's selection runs over them (`_compact_kernel`,
      `_select_candidates_kernel`; where k x group fits ROW_CAP, `compact_group`);
    - "topk": torch.topk's k-th score, then an emit kernel that reads the row twice;
    - "auto": `auto_method` ("rows" for rows of at most ROW_AUTO scores, "compact" past them where it
      applies, else "topk"; the split by row width is measured: bench/indexer.py --probe, `select_by_width`).

    All give the same ids. `out`: where to write them (a [B, c, k] view with a unit last stride); `work`:
    "compact"'s temporaries (`compact_workspace`), for a caller that selects many blocks."""
    if method not in SELECTS:
        raise ValueError(f"select_from_scores_triton: method={method!r}; use one of {SELECTS}")
    B, c, n = score.shape
    if out is None:
        out = torch.empty(B, c, k, dtype=torch.int32, device=score.device)
    if k == 0:
        return out
    if n == 0 or c == 0:
        return out.fill_(-1)
    score = _last_contig(score)
    if _interpreting():
        _fix_interpreter_loop_bounds()
    block = max(16, triton.next_power_of_2(n))
    group = compact_group(n, k)
    if method == "rows" and block > ROW_CAP:
        raise ValueError(f"select_from_scores_triton: rows of {n} scores exceed method='rows''s {ROW_CAP}; "
                         f"use method='topk' or 'auto'")
    if method == "compact" and group is None:
        raise ValueError(f"select_from_scores_triton: method='compact' needs k x its group within {ROW_CAP} "
                         f"(rows of {n}, k={k}, group {GROUP} or more); use method='auto'")
    if method == "auto":
        method = auto_method(n, k)
    if method == "rows":
        _select_rows_kernel[(c, B)](
            score, out, score.stride(0), score.stride(1), out.stride(0), out.stride(1), n, k,
            BLOCK_N=block, BLOCK_K=min(1024, max(16, triton.next_power_of_2(k))),
            num_warps=_select_warps(block),
        )
        return out
    if method == "compact":
        _select_compact(score, k, out, gmax, group, work)
        return out
    kth = score.topk(min(k, n), dim=-1, sorted=False).values.amin(-1).contiguous()  # -inf: fewer than k selectable
    _emit_from_scores_kernel[(triton.cdiv(c, block_m), B)](
        score, kth, out, score.stride(0), score.stride(1), kth.stride(0), out.stride(0), out.stride(1),
        c, n, k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, num_warps=4,
    )
    return out


def kpool_scores_triton(q: torch.Tensor, w: torch.Tensor, pk: torch.Tensor, pool: int, n_cols: int,
                        q_offset: int = 0, cfg: dict | None = None, group: int = 0):
    """fp32 [B, S, n_cols]: sum_h w relu(q . pk) of every query and pool n < n_cols, -inf where the pool
    is not selectable (not complete by the query's absolute position q_offset + t, or n >= NP). With
    `group` (a power of two dividing the tile's BLOCK_N) it also returns each `group` pools' largest
    score, [B, S, ceil(n_cols / group)], written from the tiles in registers."""
    _check(q, w, pk, pool, 0, q_offset)
    q, pk = _last_contig(q), _last_contig(pk)
    B, S, H, D = q.shape
    c = {**_cfg(H, D), **(cfg or {})}
    if group and (group & (group - 1) or c["BLOCK_N"] % group):
        raise ValueError(f"kpool_scores_triton: group={group}; use a power of two dividing BLOCK_N={c['BLOCK_N']}")
    out = torch.empty(B, S, n_cols, dtype=torch.float32, device=q.device)
    gm = torch.empty(B, S, triton.cdiv(n_cols, group) if group else 1, dtype=torch.float32, device=q.device)
    if B == 0 or S == 0 or n_cols == 0:
        return (out, gm) if group else out
    if _interpreting():
        _fix_interpreter_loop_bounds()
    _score_into(q, w, pk, pool, q_offset, c, group, out, gm)
    return (out, gm) if group else out


def _score_into(q, w, pk, pool: int, q_offset: int, c: dict, group: int, out: torch.Tensor, gm: torch.Tensor) -> None:
    """`_kpool_score_kernel` into `out` [B, S, n_cols] and `gm` (views with a unit last stride), inputs
    checked: `kpool_topk_triton`'s passes call it directly, so that a pass costs the host its launches
    and little else (the early passes' kernels are short, so the GPU can wait on the host there)."""
    B, S, H, D = q.shape
    n_cols = out.shape[-1]
    grid = (triton.cdiv(S, c["BLOCK_M"]), triton.cdiv(n_cols, c["BLOCK_N"] * c["TILES"]), B)
    _kpool_score_kernel[grid](
        q, w, pk, out, gm,
        q.stride(0), q.stride(1), q.stride(2),
        w.stride(0), w.stride(1), w.stride(2),
        pk.stride(0), pk.stride(1),
        out.stride(0), out.stride(1),
        gm.stride(0), gm.stride(1),
        S, H, pk.shape[1], n_cols, pool, q_offset,
        D=D, BLOCK_D=c["BLOCK_D"], BLOCK_H=c["BLOCK_H"], BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], TILES=c["TILES"],
        PREC="ieee" if q.dtype == torch.float32 or _interpreting() else "tf32",
        DOT_F32=_interpreting() and q.dtype != torch.float32, GROUP=group,
        num_warps=c["num_warps"], num_stages=c["num_stages"], **({"maxnreg": c["maxnreg"]} if c.get("maxnreg") else {}),
    )


def kpool_topk_triton(q: torch.Tensor, w: torch.Tensor, pk: torch.Tensor, pool: int, k_pools: int,
                      chunk: int = 1024, q_offset: int = 0, cfg: dict | None = None,
                      select: str | None = None) -> torch.Tensor:
    """int32 [B, S, k_pools], the same function as `naive.kpool_topk_torch`: `chunk` queries are scored
    into an fp32 [B, chunk, pools they can see] buffer by the score kernel, then selected by `select`:
    "triton" (`select_from_scores_triton`'s "auto": the row kernel on rows of up to ROW_AUTO pools, past
    them "compact" with the group maxima the score kernel writes beside the buffer), one of its methods by
    name ("rows", "compact", "topk": the benchmark's baselines), or "torch" (`naive.select_from_scores`,
    which the tests use to check the score kernel alone). None: $LONGCTX_INDEXER_SELECT, else "triton"
    (what a whole run's comparison against another selection sets).

    q [B,S,H,D] and pk [B,NP,D] share bf16/fp16/fp32 (fp32 runs the MMAs in IEEE fp32); w [B,S,H] is read
    as fp32; q_offset is the absolute position of q[:, 0]. `cfg` overrides the tile config (BLOCK_M,
    BLOCK_N, TILES, num_warps, num_stages). Supported: H <= 128, D <= 256. Extra memory: the buffer and
    the selection's temporaries (O(chunk x pools))."""
    _check(q, w, pk, pool, k_pools, q_offset)
    if chunk < 1:
        raise ValueError(f"kpool_topk_triton: chunk={chunk}; use a positive number of queries")
    if select is None:
        select = os.environ.get(SELECT_ENV, "triton")
    if select not in ("triton", "rows", "compact", "topk", "torch"):
        raise ValueError(f"kpool_topk_triton: select={select!r} (argument or ${SELECT_ENV}); use 'triton', 'rows', "
                         f"'compact', 'topk' or 'torch'")
    B, S = q.shape[:2]
    NP = pk.shape[1]
    out = torch.full((B, S, k_pools), -1, dtype=torch.int32, device=q.device)
    if S == 0 or k_pools == 0:
        return out
    q, pk = _last_contig(q), _last_contig(pk)
    c = {**_cfg(*q.shape[2:]), **(cfg or {})}
    if _interpreting():
        _fix_interpreter_loop_bounds()
    # the passes: queries [s0, s1), the pools the last of them sees, the selection, the group whose maxima the
    # score kernel writes ("compact": its own group where the tile holds it, else GROUP's) and compact's group
    passes = []
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        n = min(NP, (q_offset + s1) // pool)
        if n == 0:
            continue
        method = auto_method(n, k_pools) if select == "triton" else select
        cg = compact_group(n, k_pools) if method == "compact" else None
        group = (cg if cg is not None and c["BLOCK_N"] % cg == 0 else GROUP) if method == "compact" else 0
        passes.append((s0, s1, n, method, group, cg))
    if not passes:
        return out
    # one score buffer, one of group maxima and one "compact" workspace for the call, each pass a view of their
    # first rows and columns: as large as the last pass's (the widest), what the memory estimate counts
    rows = min(chunk, S)
    buf = torch.empty(B, rows, max(p[2] for p in passes), dtype=torch.float32, device=q.device)
    gm_width = max((triton.cdiv(p[2], p[4]) for p in passes if p[4]), default=1)  # never empty: a kernel argument
    gm_buf = torch.empty(B, rows, gm_width, dtype=torch.float32, device=q.device)
    work_group = max((p[5] for p in passes if p[5] is not None), default=None)
    work = compact_workspace(B, rows, k_pools, work_group, q.device) if work_group is not None else None
    for s0, s1, n, method, group, _ in passes:
        score = buf[:, : s1 - s0, :n]
        gm = gm_buf[:, : s1 - s0, : triton.cdiv(n, group) if group else 1]
        _score_into(q[:, s0:s1], w[:, s0:s1], pk, pool, q_offset + s0, c, group, score, gm)
        if method != "torch":
            select_from_scores_triton(score, k_pools, method=method, gmax=gm if group else None,
                                      out=out[:, s0:s1], work=work)
        else:
            out[:, s0:s1] = select_from_scores(score, score != float("-inf"), k_pools)
    return out
