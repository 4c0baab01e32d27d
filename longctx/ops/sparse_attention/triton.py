"""Triton DSA sparse attention (absorbed NoPE MLA: one latent row per token is key and value).

Computes, for every query t and head h with the selected indices I_t (-1 = unused slot),

    o[t, h] = sum_{j in I_t} softmax_j(scale * q[t, h] . kv[j]) kv[j]

the same function as `naive.sparse_attention_torch`, with gradients for q and kv.

Why this shape of kernel: the heads of one query all read the same selected rows, so one program
per query (and group of up to 64 heads) makes the heads the MMA M dimension and gathers each
latent row once per tile for all of them. The row is both key and value, so one gathered tile
feeds both the score product and the value product. The backward recomputes P from the saved
log-sum-exp, keeps dQ in registers for the whole index list, and scatters dKV with fp32 atomics
(many queries select the same rows; a repeated index within one query also just adds up).
What bounds each kernel and the designs that cost more are in docs/design/sparse_attention.md; the
measured rates come from `python bench/sparse_attention.py` (bench/results/sparse_attention.json).

Runs on CUDA tensors, and on CPU tensors under `TRITON_INTERPRET=1` (the CPU tests do that).
Shapes it cannot take raise a ValueError; there is no fallback path.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .. import triton_interpreting as _interpreting
from . import union as _union

_LOG2E = 1.4426950408889634
_MAX_HEADS = 128
_MAX_D = 512
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _softmax_pv_step(s, valid, k, m_i, l_i, acc, qk_scale, PREC: tl.constexpr):
    """One online-softmax update with a [BLOCK_H, BLOCK_N] score tile; k is also the value."""
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing valid yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(k.dtype), k, acc, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _sparse_attn_fwd(
    Q, KV, IDX, O, LSE,
    qk_scale,  # scale * log2(e): scores live in the log2 domain
    stride_qb, stride_qs, stride_qh,
    stride_kvb, stride_kvs,
    stride_ib, stride_is,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_ls,
    S_kv, H,
    K: tl.constexpr,  # slots per query; constexpr so the interpreter (numpy>=2.3) can loop over it
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,  # "ieee" for fp32 inputs (exact reference checks), else unused by bf16 MMAs
    LOOKAHEAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * BLOCK_H
    b = tl.program_id(2).to(tl.int64)

    # int64: a head-major q (torch's einsum output, [B, S, H, D] with head stride S * D) puts (H - 1) x that past
    # 2^31 elements from 279,621 tokens at D = 512 (tests/ops/test_int32_gpu.py runs 524,288)
    offs_h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < H
    d_ok = offs_d < D

    q_ptrs = Q + b * stride_qb + t * stride_qs + offs_h[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=h_ok[:, None] & d_ok[None, :], other=0.0)

    kv_base = KV + b * stride_kvb
    idx_base = IDX + b * stride_ib + t * stride_is

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    if LOOKAHEAD:
        # Scores run one tile ahead of the softmax: iteration i computes S for tile i+1, then
        # finishes tile i. With S feeding only a loop-carried value (not the P@V product
        # directly), triton 3.6 splits the score MMA over both warpgroups (8 warps, M = 64 heads)
        # instead of having each warpgroup compute the same tile: 176 -> 199 TFLOP/s at H=64.
        j = tl.load(idx_base + offs_n, mask=offs_n < K, other=-1).to(tl.int64)
        valid = (j >= 0) & (j < S_kv)
        k = tl.load(kv_base + j[:, None] * stride_kvs + offs_d[None, :],
                    mask=valid[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        for n0 in range(BLOCK_N, K + BLOCK_N, BLOCK_N):  # the last prefetch is fully masked
            slot = n0 + offs_n
            j_nx = tl.load(idx_base + slot, mask=slot < K, other=-1).to(tl.int64)
            valid_nx = (j_nx >= 0) & (j_nx < S_kv)
            k_nx = tl.load(kv_base + j_nx[:, None] * stride_kvs + offs_d[None, :],
                           mask=valid_nx[:, None] & d_ok[None, :], other=0.0)
            s_nx = tl.dot(q, tl.trans(k_nx), input_precision=PREC)
            m_i, l_i, acc = _softmax_pv_step(s, valid, k, m_i, l_i, acc, qk_scale, PREC)
            k, s, valid = k_nx, s_nx, valid_nx
    else:
        # with 4 warps (small head blocks) nothing is duplicated and the plain loop is faster
        for n0 in range(0, K, BLOCK_N):
            slot = n0 + offs_n
            j = tl.load(idx_base + slot, mask=slot < K, other=-1).to(tl.int64)
            valid = (j >= 0) & (j < S_kv)
            k = tl.load(kv_base + j[:, None] * stride_kvs + offs_d[None, :],
                        mask=valid[:, None] & d_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
            m_i, l_i, acc = _softmax_pv_step(s, valid, k, m_i, l_i, acc, qk_scale, PREC)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    o_ptrs = O + b * stride_ob + t * stride_os + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])
    # natural-log LSE, -inf where the query selected nothing (as the torch twin returns)
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) / 1.4426950408889634)
    tl.store(LSE + b * stride_lb + t * stride_ls + offs_h, lse, mask=h_ok)


@triton.jit
def _sparse_attn_bwd(
    Q, KV, IDX, O, DO, LSE, DQ, DKV,
    scale, qk_scale,
    stride_qb, stride_qs, stride_qh,
    stride_kvb, stride_kvs,
    stride_ib, stride_is,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    stride_lb, stride_ls,
    stride_dqb, stride_dqs, stride_dqh,
    stride_dkb, stride_dks,
    S_kv, H,
    K: tl.constexpr,  # slots per query; constexpr so the interpreter (numpy>=2.3) can loop over it
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,  # "ieee" for fp32 inputs (exact reference checks), else unused by bf16 MMAs
):
    t = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * BLOCK_H
    b = tl.program_id(2).to(tl.int64)

    # int64: a head-major q (torch's einsum output, [B, S, H, D] with head stride S * D) puts (H - 1) x that past
    # 2^31 elements from 279,621 tokens at D = 512 (tests/ops/test_int32_gpu.py runs 524,288)
    offs_h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < H
    d_ok = offs_d < D
    hd_ok = h_ok[:, None] & d_ok[None, :]

    q = tl.load(Q + b * stride_qb + t * stride_qs + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=hd_ok, other=0.0)
    do = tl.load(DO + b * stride_dob + t * stride_dos + offs_h[:, None] * stride_doh + offs_d[None, :],
                 mask=hd_ok, other=0.0)
    o = tl.load(O + b * stride_ob + t * stride_os + offs_h[:, None] * stride_oh + offs_d[None, :],
                mask=hd_ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # rowsum(dO * O)
    lse = tl.load(LSE + b * stride_lb + t * stride_ls + offs_h, mask=h_ok, other=0.0)
    # padded heads and queries with nothing selected: any finite value, their p is masked to 0
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)

    kv_base = KV + b * stride_kvb
    dkv_base = DKV + b * stride_dkb
    idx_base = IDX + b * stride_ib + t * stride_is
    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    for n0 in range(0, K, BLOCK_N):
        slot = n0 + offs_n
        j = tl.load(idx_base + slot, mask=slot < K, other=-1).to(tl.int64)
        valid = (j >= 0) & (j < S_kv)
        nd_ok = valid[:, None] & d_ok[None, :]
        k = tl.load(kv_base + j[:, None] * stride_kvs + offs_d[None, :], mask=nd_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        dp = tl.dot(do, tl.trans(k), input_precision=PREC)  # dP = dO V^T, V = K
        keep = valid[None, :] & h_ok[:, None]
        p = tl.where(keep, tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
        # dkv^T [D, BLOCK_N] = dO^T P + Q^T (scale dS): D is the MMA M dimension (wgmma wants
        # M >= 64 and BLOCK_N is small), and q, dO are read through transposed views of the
        # shared-memory copies the score products already use
        dkv_t = tl.dot(tl.trans(do), p.to(k.dtype), input_precision=PREC)
        dkv_t = tl.dot(tl.trans(q), (ds * scale).to(k.dtype), dkv_t, input_precision=PREC)
        tl.atomic_add(dkv_base + j[None, :] * stride_dks + offs_d[:, None], dkv_t,
                      mask=valid[None, :] & d_ok[:, None], sem="relaxed")

    dq = dq * scale
    tl.store(DQ + b * stride_dqb + t * stride_dqs + offs_h[:, None] * stride_dqh + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=hd_ok)


# ---------------------------------------------------------------------------------------------- union mode
# G neighbouring queries over the union of their selections (`union.py` builds it and says when it pays):
# the program's M rows are (query g, head h) pairs, r = g * H + h, and a union slot is
# (row << 8) | membership bits, -1 for padding.


@triton.jit
def _union_slots(U_row, slot, U_pad, g):
    """Row indices (int64, 0 where unused), slot validity [BLOCK_N] and membership [BLOCK_M, BLOCK_N]."""
    v = tl.load(U_row + slot, mask=slot < U_pad, other=-1)
    ok = v >= 0
    j = tl.where(ok, v >> 8, 0).to(tl.int64)
    member = (((v & 255)[None, :] >> g[:, None]) & 1) != 0
    return j, ok, member & ok[None, :]


@triton.jit
def _union_softmax_step(s, member, k, m_i, l_i, acc, qk_scale, PREC: tl.constexpr):
    """`_softmax_pv_step` with a per-(row, slot) mask: a query's rows see only the slots it selected."""
    s = tl.where(member, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(k.dtype), k, acc, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _union_fwd_loop(q, kv_base, stride_kvs, u_row, U_pad, g, n_end, qk_scale,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PREC: tl.constexpr, LOOKAHEAD: tl.constexpr):
    """The online softmax over the group's n_end union slots: (m, l, acc) of every (query, head) row."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < D
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    if LOOKAHEAD:  # as in _sparse_attn_fwd: the score tile of step i+1 before the softmax of step i
        j, ok, member = _union_slots(u_row, offs_n, U_pad, g)
        k = tl.load(kv_base + j[:, None] * stride_kvs + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        for n0 in range(BLOCK_N, n_end + BLOCK_N, BLOCK_N):
            j_nx, ok_nx, member_nx = _union_slots(u_row, n0 + offs_n, U_pad, g)
            k_nx = tl.load(kv_base + j_nx[:, None] * stride_kvs + offs_d[None, :],
                           mask=ok_nx[:, None] & d_ok[None, :], other=0.0)
            s_nx = tl.dot(q, tl.trans(k_nx), input_precision=PREC)
            m_i, l_i, acc = _union_softmax_step(s, member, k, m_i, l_i, acc, qk_scale, PREC)
            k, s, member = k_nx, s_nx, member_nx
    else:
        for n0 in range(0, n_end, BLOCK_N):
            j, ok, member = _union_slots(u_row, n0 + offs_n, U_pad, g)
            k = tl.load(kv_base + j[:, None] * stride_kvs + offs_d[None, :], mask=ok[:, None] & d_ok[None, :],
                        other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
            m_i, l_i, acc = _union_softmax_step(s, member, k, m_i, l_i, acc, qk_scale, PREC)

    return m_i, l_i, acc


@triton.jit
def _union_attn_fwd(
    Q, KV, UN, ULEN, O, LSE,
    qk_scale,
    stride_qb, stride_qs, stride_qh,
    stride_kvb, stride_kvs,
    stride_ub, stride_un,
    stride_lenb,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_ls,
    S, H, U_pad,
    G: tl.constexpr,
    U_LOOP: tl.constexpr,  # >= 0: loop over that many slots (the interpreter wants a constant bound); -1: ULEN's
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr, LOOKAHEAD: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    r0 = tl.program_id(1) * BLOCK_M
    b = tl.program_id(2).to(tl.int64)

    offs_r = r0 + tl.arange(0, BLOCK_M)
    g = offs_r // H
    h = (offs_r - g * H).to(tl.int64)
    t = n * G + g.to(tl.int64)
    r_ok = (offs_r < G * H) & (t < S)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < D
    rd_ok = r_ok[:, None] & d_ok[None, :]

    q = tl.load(Q + b * stride_qb + t[:, None] * stride_qs + h[:, None] * stride_qh + offs_d[None, :],
                mask=rd_ok, other=0.0)
    kv_base = KV + b * stride_kvb
    u_row = UN + b * stride_ub + n * stride_un
    # the loop bound as a call argument: the interpreter turns a value assigned under `if` into a tensor,
    # which range() cannot take
    if U_LOOP >= 0:
        m_i, l_i, acc = _union_fwd_loop(q, kv_base, stride_kvs, u_row, U_pad, g, U_LOOP, qk_scale,
                                        D, BLOCK_D, BLOCK_M, BLOCK_N, PREC, LOOKAHEAD)
    else:
        m_i, l_i, acc = _union_fwd_loop(q, kv_base, stride_kvs, u_row, U_pad, g, tl.load(ULEN + b * stride_lenb + n),
                                        qk_scale, D, BLOCK_D, BLOCK_M, BLOCK_N, PREC, LOOKAHEAD)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    tl.store(O + b * stride_ob + t[:, None] * stride_os + h[:, None] * stride_oh + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=rd_ok)
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) / 1.4426950408889634)
    tl.store(LSE + b * stride_lb + t * stride_ls + h, lse, mask=r_ok)


@triton.jit
def _union_bwd_loop(q, do, delta, lse2, r_ok, kv_base, dkv_base, stride_kvs, stride_dks, u_row, U_pad, g, n_end,
                    scale, qk_scale, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    """dQ of the program's rows (unscaled) over the group's n_end union slots; dKV goes out by atomics."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < D
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    for n0 in range(0, n_end, BLOCK_N):
        j, ok, member = _union_slots(u_row, n0 + offs_n, U_pad, g)
        k = tl.load(kv_base + j[:, None] * stride_kvs + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        dp = tl.dot(do, tl.trans(k), input_precision=PREC)
        p = tl.where(member & r_ok[:, None], tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
        # one atomic per (group, row): the G x H rows' contributions are summed by the MMA's reduction
        dkv_t = tl.dot(tl.trans(do), p.to(k.dtype), input_precision=PREC)
        dkv_t = tl.dot(tl.trans(q), (ds * scale).to(k.dtype), dkv_t, input_precision=PREC)
        tl.atomic_add(dkv_base + j[None, :] * stride_dks + offs_d[:, None], dkv_t,
                      mask=ok[None, :] & d_ok[:, None], sem="relaxed")

    return dq


@triton.jit
def _union_attn_bwd(
    Q, KV, UN, ULEN, O, DO, LSE, DQ, DKV,
    scale, qk_scale,
    stride_qb, stride_qs, stride_qh,
    stride_kvb, stride_kvs,
    stride_ub, stride_un,
    stride_lenb,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    stride_lb, stride_ls,
    stride_dqb, stride_dqs, stride_dqh,
    stride_dkb, stride_dks,
    S, H, U_pad,
    G: tl.constexpr, U_LOOP: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    r0 = tl.program_id(1) * BLOCK_M
    b = tl.program_id(2).to(tl.int64)

    offs_r = r0 + tl.arange(0, BLOCK_M)
    g = offs_r // H
    h = (offs_r - g * H).to(tl.int64)
    t = n * G + g.to(tl.int64)
    r_ok = (offs_r < G * H) & (t < S)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < D
    rd_ok = r_ok[:, None] & d_ok[None, :]

    q = tl.load(Q + b * stride_qb + t[:, None] * stride_qs + h[:, None] * stride_qh + offs_d[None, :],
                mask=rd_ok, other=0.0)
    do = tl.load(DO + b * stride_dob + t[:, None] * stride_dos + h[:, None] * stride_doh + offs_d[None, :],
                 mask=rd_ok, other=0.0)
    o = tl.load(O + b * stride_ob + t[:, None] * stride_os + h[:, None] * stride_oh + offs_d[None, :],
                mask=rd_ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(LSE + b * stride_lb + t * stride_ls + h, mask=r_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)

    kv_base = KV + b * stride_kvb
    dkv_base = DKV + b * stride_dkb
    u_row = UN + b * stride_ub + n * stride_un
    if U_LOOP >= 0:  # the bound as an argument, as in the forward
        dq = _union_bwd_loop(q, do, delta, lse2, r_ok, kv_base, dkv_base, stride_kvs, stride_dks, u_row, U_pad, g,
                             U_LOOP, scale, qk_scale, D, BLOCK_D, BLOCK_M, BLOCK_N, PREC)
    else:
        dq = _union_bwd_loop(q, do, delta, lse2, r_ok, kv_base, dkv_base, stride_kvs, stride_dks, u_row, U_pad, g,
                             tl.load(ULEN + b * stride_lenb + n), scale, qk_scale, D, BLOCK_D, BLOCK_M, BLOCK_N, PREC)

    dq = dq * scale
    tl.store(DQ + b * stride_dqb + t[:, None] * stride_dqs + h[:, None] * stride_dqh + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=rd_ok)


def _check(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor) -> None:
    """Raise a ValueError naming the shape when the kernel cannot take it."""
    if q.dim() != 4 or kv.dim() != 3 or idx.dim() != 3:
        raise ValueError(
            f"sparse_attention_triton: expected q [B,S,H,D], kv [B,S_kv,D], idx [B,S,K]; "
            f"got q {tuple(q.shape)}, kv {tuple(kv.shape)}, idx {tuple(idx.shape)}"
        )
    B, S, H, D = q.shape
    if kv.shape[0] != B or kv.shape[2] != D or idx.shape[0] != B or idx.shape[1] != S:
        raise ValueError(
            f"sparse_attention_triton: shapes disagree: q {tuple(q.shape)}, kv {tuple(kv.shape)}, "
            f"idx {tuple(idx.shape)} (need kv [B,S_kv,D] and idx [B,S,K])"
        )
    if D % 16 != 0 or not 16 <= D <= _MAX_D:
        raise ValueError(f"sparse_attention_triton: latent width D={D} unsupported; D must be a multiple of 16 in [16, {_MAX_D}]")
    if not 1 <= H <= _MAX_HEADS:
        raise ValueError(f"sparse_attention_triton: H={H} heads unsupported; supported 1..{_MAX_HEADS}")
    if q.dtype not in _DTYPES or kv.dtype != q.dtype:
        raise ValueError(
            f"sparse_attention_triton: dtypes q {q.dtype}, kv {kv.dtype} unsupported; "
            f"q and kv must share one of bfloat16, float16, float32"
        )
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse_attention_triton: idx dtype {idx.dtype} unsupported; use int32 (or int64)")
    devs = {q.device, kv.device, idx.device}
    if len(devs) != 1:
        raise ValueError(f"sparse_attention_triton: tensors on different devices {sorted(map(str, devs))}")
    dev = q.device
    if dev.type != "cuda" and not (dev.type == "cpu" and _interpreting()):
        raise ValueError(
            f"sparse_attention_triton: device {dev} unsupported; needs CUDA tensors "
            f"(or CPU tensors with TRITON_INTERPRET=1)"
        )


def _cfg(H: int, D: int, backward: bool) -> dict:
    """Tile sizes (no autotuning: compiles cost minutes). Up to 64 heads per program: an fp32
    [64, 512] accumulator is half the register file. Chosen from register/shared-memory counts
    of sm_90 builds (`python dev/compile_sm90.py`) and the sweep in `bench/sparse_attention.py --sweep`."""
    block_h = 64 if H > 32 else max(16, triton.next_power_of_2(H))
    block_d = triton.next_power_of_2(D)
    big = block_h * block_d >= 64 * 256
    if backward:  # dq [H, D] and a dkv^T [D, BLOCK_N] tile both live in registers
        # num_stages=1 miscompiles here (triton 3.6: invalid shared-memory reads), so always 2
        n, warps = (32, 8) if big else (16, 4)
        return {"BLOCK_H": block_h, "BLOCK_D": block_d, "BLOCK_N": n, "num_warps": warps, "num_stages": 2}
    n, warps = (32, 8) if big else (64, 4)
    return {"BLOCK_H": block_h, "BLOCK_D": block_d, "BLOCK_N": n, "num_warps": warps, "num_stages": 2, "LOOKAHEAD": big}


LAST_LAUNCH: dict = {}  # "fwd"/"bwd" -> config and compiled-kernel facts (registers, spills), for the benchmark


def _note_launch(which: str, kern, cfg: dict) -> None:
    LAST_LAUNCH[which] = dict(cfg, n_regs=getattr(kern, "n_regs", None), n_spills=getattr(kern, "n_spills", None),
                              shared=getattr(kern, "metadata", None) and getattr(kern.metadata, "shared", None))


def _last_contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def sparse_attention_fwd(q, kv, idx, scale, cfg=None, group=None):
    """Forward only: returns (o [B,S,H,D] in q's dtype, lse [B,S,H] fp32, natural log).

    group: queries per program over the union of their selections (`union.py`): 1 is the per-query
    kernel, None the cost model's choice (or $LONGCTX_SPARSE_GROUP), or "auto"."""
    _check(q, kv, idx)
    G = _resolve_group(q, kv, idx, group)
    if G > 1:
        return union_attention_fwd(q, kv, _union.build_union(idx, G, kv.shape[1]), scale, cfg)
    q, kv, idx = _last_contig(q), _last_contig(kv), _last_contig(idx)
    B, S, H, D = q.shape
    K = idx.shape[2]
    c = dict(_cfg(H, D, False), **(cfg or {}))
    o = torch.empty_like(q)
    lse = torch.empty(B, S, H, device=q.device, dtype=torch.float32)
    if S == 0 or B == 0:
        return o, lse
    grid = (S, triton.cdiv(H, c["BLOCK_H"]), B)
    kern = _sparse_attn_fwd[grid](
        q, kv, idx, o, lse, scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        idx.stride(0), idx.stride(1),
        o.stride(0), o.stride(1), o.stride(2),
        lse.stride(0), lse.stride(1),
        kv.shape[1], H, K=K,
        D=D, BLOCK_D=c["BLOCK_D"], BLOCK_H=c["BLOCK_H"], BLOCK_N=c["BLOCK_N"],
        PREC="ieee" if q.dtype == torch.float32 else "tf32", LOOKAHEAD=c.get("LOOKAHEAD", c["num_warps"] == 8),
        num_warps=c["num_warps"], num_stages=c["num_stages"],
    )
    _note_launch("fwd", kern, c)
    return o, lse


def _check_bwd(q: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor) -> None:
    """Raise a ValueError naming the shapes when o, lse or dO do not belong to q (the kernel indexes all four
    with q's query and head counts, so a mismatch would read outside them); q's own shape is `_check`'s."""
    if q.dim() != 4:
        return
    B, S, H, _ = q.shape
    if o.shape != q.shape or do.shape != q.shape or tuple(lse.shape) != (B, S, H):
        raise ValueError(
            f"sparse_attention_bwd: o {tuple(o.shape)}, dO {tuple(do.shape)} and lse {tuple(lse.shape)} must be "
            f"q's shape {tuple(q.shape)} and [B, S, H] = {(B, S, H)} (o and lse from the forward over the same q)"
        )
    if lse.dtype != torch.float32 or lse.stride(-1) != 1:
        raise ValueError(f"sparse_attention_bwd: lse must be float32 with unit stride over heads (got {lse.dtype}, "
                         f"strides {lse.stride()}), as sparse_attention_fwd returns it")


def sparse_attention_bwd(q, kv, idx, o, lse, do, scale, cfg=None, group=None):
    """Backward: returns (dq like q, dkv like kv). dkv is summed in an fp32 buffer by atomics. group: as
    in `sparse_attention_fwd` (the backward may use another G than the forward did: the same function)."""
    _check_bwd(q, o, lse, do)
    _check(q, kv, idx)
    G = _resolve_group(q, kv, idx, group)
    if G > 1:
        return union_attention_bwd(q, kv, _union.build_union(idx, G, kv.shape[1]), o, lse, do, scale, cfg)
    q, kv, idx, o, do = (_last_contig(x) for x in (q, kv, idx, o, do))
    B, S, H, D = q.shape
    K = idx.shape[2]
    c = dict(_cfg(H, D, True), **(cfg or {}))
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, device=kv.device, dtype=torch.float32)
    if S == 0 or B == 0:
        return dq, dkv.to(kv.dtype)
    grid = (S, triton.cdiv(H, c["BLOCK_H"]), B)
    kern = _sparse_attn_bwd[grid](
        q, kv, idx, o, do, lse, dq, dkv,
        scale, scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        idx.stride(0), idx.stride(1),
        o.stride(0), o.stride(1), o.stride(2),
        do.stride(0), do.stride(1), do.stride(2),
        lse.stride(0), lse.stride(1),
        dq.stride(0), dq.stride(1), dq.stride(2),
        dkv.stride(0), dkv.stride(1),
        kv.shape[1], H, K=K,
        D=D, BLOCK_D=c["BLOCK_D"], BLOCK_H=c["BLOCK_H"], BLOCK_N=c["BLOCK_N"],
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=c["num_warps"], num_stages=c["num_stages"],
    )
    _note_launch("bwd", kern, c)
    return dq, dkv.to(kv.dtype)


def _resolve_group(q, kv, idx, group) -> int:
    return _union.resolve_group(idx, q.shape[2], kv.shape[1], group)


def _check_union(q, kv, u: "_union.Union") -> None:
    """`_check` on q and kv, and the union built for q's queries (int32 [B, ceil(S / G), U_pad], contiguous)."""
    B, S = (q.shape[0], q.shape[1]) if q.dim() == 4 else (0, 0)
    p = u.packed
    if (u.S != S or p.dim() != 3 or tuple(p.shape[:2]) != (B, -(-S // u.G)) or p.dtype != torch.int32
            or not p.is_contiguous() or p.device != q.device or tuple(u.length.shape) != (B, p.shape[1])):
        raise ValueError(f"union_attention: the union (G={u.G}, {u.S} queries, packed {tuple(p.shape)} {p.dtype}) was "
                         f"not built for q {tuple(q.shape)}; build it with union.build_union(idx, G, S_kv)")
    _check(q, kv, torch.empty(B, S, 1, dtype=torch.int32, device=q.device))


def _union_launch_args(u: "_union.Union") -> tuple[torch.Tensor, torch.Tensor, int]:
    """(packed, length, U_LOOP): the interpreter loops to the padded width (it cannot take a loop bound read
    from memory); compiled kernels loop to each group's own length."""
    return u.packed, u.length, (u.packed.shape[2] if _interpreting() else -1)


def union_attention_fwd(q, kv, u: "_union.Union", scale, cfg=None):
    """The forward over a built union (`union.build_union(idx, G, S_kv)`): (o, lse) as `sparse_attention_fwd`."""
    _check_union(q, kv, u)
    q, kv = _last_contig(q), _last_contig(kv)
    B, S, H, D = q.shape
    M = u.G * H
    c = dict(_cfg(M, D, False), **(cfg or {}))
    o = torch.empty_like(q)
    lse = torch.empty(B, S, H, device=q.device, dtype=torch.float32)
    if S == 0 or B == 0:
        return o, lse
    packed, length, u_loop = _union_launch_args(u)
    grid = (u.groups, triton.cdiv(M, c["BLOCK_H"]), B)
    kern = _union_attn_fwd[grid](
        q, kv, packed, length, o, lse, scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        packed.stride(0), packed.stride(1),
        length.stride(0),
        o.stride(0), o.stride(1), o.stride(2),
        lse.stride(0), lse.stride(1),
        S, H, packed.shape[2], G=u.G, U_LOOP=u_loop,
        D=D, BLOCK_D=c["BLOCK_D"], BLOCK_M=c["BLOCK_H"], BLOCK_N=c["BLOCK_N"],
        PREC="ieee" if q.dtype == torch.float32 else "tf32", LOOKAHEAD=c.get("LOOKAHEAD", c["num_warps"] == 8),
        num_warps=c["num_warps"], num_stages=c["num_stages"],
    )
    _note_launch("fwd", kern, dict(c, G=u.G))
    return o, lse


def union_attention_bwd(q, kv, u: "_union.Union", o, lse, do, scale, cfg=None):
    """The backward over a built union: (dq like q, dkv like kv), one fp32 atomic per (group, union row)."""
    _check_bwd(q, o, lse, do)
    _check_union(q, kv, u)
    q, kv, o, do = (_last_contig(x) for x in (q, kv, o, do))
    B, S, H, D = q.shape
    M = u.G * H
    c = dict(_cfg(M, D, True), **(cfg or {}))
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, device=kv.device, dtype=torch.float32)
    if S == 0 or B == 0:
        return dq, dkv.to(kv.dtype)
    packed, length, u_loop = _union_launch_args(u)
    grid = (u.groups, triton.cdiv(M, c["BLOCK_H"]), B)
    kern = _union_attn_bwd[grid](
        q, kv, packed, length, o, do, lse, dq, dkv,
        scale, scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        packed.stride(0), packed.stride(1),
        length.stride(0),
        o.stride(0), o.stride(1), o.stride(2),
        do.stride(0), do.stride(1), do.stride(2),
        lse.stride(0), lse.stride(1),
        dq.stride(0), dq.stride(1), dq.stride(2),
        dkv.stride(0), dkv.stride(1),
        S, H, packed.shape[2], G=u.G, U_LOOP=u_loop,
        D=D, BLOCK_D=c["BLOCK_D"], BLOCK_M=c["BLOCK_H"], BLOCK_N=c["BLOCK_N"],
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=c["num_warps"], num_stages=c["num_stages"],
    )
    _note_launch("bwd", kern, dict(c, G=u.G))
    return dq, dkv.to(kv.dtype)


class _SparseAttention(torch.autograd.Function):
    """One G for both passes, the union built once and kept for the backward."""

    @staticmethod
    def forward(ctx, q, kv, idx, scale, group):
        G = _resolve_group(q, kv, idx, group)
        u = _union.build_union(idx, G, kv.shape[1]) if G > 1 else None
        o, lse = sparse_attention_fwd(q, kv, idx, scale, group=1) if u is None else union_attention_fwd(q, kv, u, scale)
        ctx.save_for_backward(q, kv, idx, o, lse, *(() if u is None else (u.packed, u.length)))
        ctx.scale, ctx.G, ctx.S = scale, G, q.shape[1]
        return o

    @staticmethod
    def backward(ctx, do):
        q, kv, idx, o, lse, *un = ctx.saved_tensors
        if un:
            u = _union.Union(G=ctx.G, S=ctx.S, packed=un[0], length=un[1])
            dq, dkv = union_attention_bwd(q, kv, u, o, lse, do, ctx.scale)
        else:
            dq, dkv = sparse_attention_bwd(q, kv, idx, o, lse, do, ctx.scale, group=1)
        return dq, dkv, None, None, None


def kept_sparse_attention_triton(q, kv, idx, o, lse, scale: float, group=None) -> torch.Tensor:
    """o (kept from `sparse_attention_fwd` over the same q, kv, idx), differentiable in q and kv: the kernel's
    backward from the kept o and lse, on what `_SparseAttention` saves (naive.KeptSparseAttention)."""
    from .naive import KeptSparseAttention

    _check(q, kv, idx)
    bwd = functools.partial(sparse_attention_bwd, scale=float(scale), group=group)
    return KeptSparseAttention.apply(q, kv, idx, o, lse, bwd)


def sparse_attention_triton(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float,
                            group=None) -> torch.Tensor:
    """q [B,S,H,D], kv [B,S_kv,D], idx [B,S,K] int32 (-1 = unused) -> o [B,S,H,D]; differentiable in q, kv.

    Indices must lie in [-1, S_kv), in any order; a query with only -1 gets a zero output. The
    kernel masks indices outside [0, S_kv) like -1 instead of reading out of bounds; it does not
    validate them (that would cost a device sync per call). K is a compile-time constant: each
    distinct K compiles once. group: 1 = one query per program; 2, 4, 8 = that many neighbouring
    queries over the union of their selections (`union.py`); None = the cost model's choice on the
    measured union sizes (or $LONGCTX_SPARSE_GROUP). Every G computes the same function.
    """
    _check(q, kv, idx)
    if not math.isfinite(scale):
        raise ValueError(f"sparse_attention_triton: scale={scale} must be finite")
    return _SparseAttention.apply(q, kv, idx, float(scale), group)
