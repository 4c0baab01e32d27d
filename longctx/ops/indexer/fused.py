"""Fused k-pool indexer: score (query, pool) pairs and select each query's top-k pools in one kernel.

Computes the same int32 [B, S, k_pools] pool ids as `naive.kpool_topk_torch` (ascending, -1
padded, ties to the lower pool id) without writing the [S, NP] score matrix anywhere: memory is
the output plus a CAND-slot candidate buffer per query.

Why this shape of kernel. k_pools is large (512 for top-2048 tokens in pools of 4) and NP is up
to 256k at 1M tokens, so a running top-k list per query (a sort per tile) would cost far more than
the scores. Instead each program (BLOCK_M queries) finds, per query, the k-th largest score by a
radix select over the fp32 bits, recomputing the scores on every pass (tensor-core work is cheap
next to HBM round trips of [S, NP]):

  key    = the score's bits mapped to an int32 that orders like the float (-0.0 folded into +0.0);
  search = pass after pass, the histogram of the next RBITS key bits among the keys that still
           share the known prefix ("group") tells which digit holds the k-th largest and how many
           keys lie above it; the group's min and max let a pass jump over bits they share (a
           run of exactly equal scores costs one pass). A query settles when its group is exactly
           what is still missing, when all its keys are equal, or when it has <= CAND keys;
  emit   = one more pass writes, in pool order, every pool above the prefix and the first
           `missing` pools equal to it (the lower-pool-id tie-break; ascending output). A row
           settled with a small group of unequal keys puts the group in the candidate buffer
           instead, ranks it by (score desc, pool id asc) afterwards, and sorts its row.

Heads are the inner MMA dimension: q rows are (query, head) pairs, [BLOCK_M * BLOCK_H, D] x
[D, BLOCK_N] per tile, ReLU, weighted by w and summed over heads in registers. Counting, pass
statistics and the per-pass cost are in bench/NOTES.md ("indexer").

Runs on CUDA tensors, and on CPU tensors under `TRITON_INTERPRET=1` (the CPU tests do that).
Shapes it cannot take raise a ValueError; there is no fallback path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import triton_interpreting as _interpreting

_MAX_HEADS = 128
_MAX_D = 256
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SIGN = tl.constexpr(-2147483648)  # 0x80000000 as an int32
_IMAX = tl.constexpr(2147483647)


@triton.jit
def _hi_mask(p):
    """int32 with the top p bits set, p in [0, 32]."""
    return tl.where(p == 0, 0, -1 << (32 - tl.maximum(p, 1)))


@triton.jit
def _clz32(x):
    """Leading zero bits of int32 x read as unsigned (32 for 0); 32 cheap steps on a [BLOCK_M] vector."""
    n = tl.zeros_like(x)
    alive = tl.zeros_like(x) == 0
    for b in tl.static_range(31, -1, -1):
        alive = alive & (((x >> b) & 1) == 0)
        n += alive.to(tl.int32)
    return n


@triton.jit
def _load_query_block(Q, W, b, t0, stride_qb, stride_qs, stride_qh, stride_wb, stride_ws, stride_wh, S, H,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr,
                      DOT_F32: tl.constexpr):
    """The MMA operand of queries t0 .. t0+BLOCK_M-1: q rows are (query m, head h) pairs, row = m * BLOCK_H
    + h, [BLOCK_M * BLOCK_H, BLOCK_D]; their head weights as [BLOCK_M, BLOCK_H, 1] fp32; and the masks."""
    rows = tl.arange(0, BLOCK_M * BLOCK_H)
    rm = rows // BLOCK_H
    rh = rows % BLOCK_H
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_ok = ((t0 + rm) < S) & (rh < H)
    q = tl.load(Q + b * stride_qb + (t0 + rm)[:, None].to(tl.int64) * stride_qs + rh[:, None].to(tl.int64) * stride_qh
                + offs_d[None, :], mask=q_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    offs_m = tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, BLOCK_H)
    t = t0 + offs_m
    m_ok = t < S
    w = tl.load(W + b * stride_wb + t[:, None].to(tl.int64) * stride_ws + offs_h[None, :].to(tl.int64) * stride_wh,
                mask=m_ok[:, None] & (offs_h[None, :] < H), other=0.0).to(tl.float32)
    return q, tl.reshape(w, [BLOCK_M, BLOCK_H, 1]), offs_d, d_ok, offs_m, t, m_ok


@triton.jit
def _tile_scores(q, w3, pk_base, stride_pn, n0, NP, offs_d, d_ok, pos, P,
                 BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
                 DOT_F32: tl.constexpr):
    """fp32 scores of BLOCK_M queries x BLOCK_N pools (-0.0 folded into +0.0), selectability, pool ids."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < NP
    kt = tl.load(pk_base + offs_n[None, :] * stride_pn + offs_d[:, None],
                 mask=d_ok[:, None] & n_ok[None, :], other=0.0)
    if DOT_F32:  # interpreter only: its dot multiplies bf16 storage bits as integers
        kt = kt.to(tl.float32)
    s = tl.dot(q, kt, input_precision=PREC)  # [BLOCK_M * BLOCK_H, BLOCK_N], fp32
    s = tl.reshape(tl.maximum(s, 0.0), [BLOCK_M, BLOCK_H, BLOCK_N])
    sc = tl.sum(s * w3, axis=1)
    sc = tl.where(sc == 0.0, 0.0, sc)  # -0.0 -> +0.0: equal floats must get equal keys
    valid = n_ok[None, :] & (offs_n[None, :] * P + (P - 1) <= pos[:, None])
    return sc, valid, offs_n


@triton.jit
def _tile_keys(q, w3, pk_base, stride_pn, n0, NP, offs_d, d_ok, pos, P,
               BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
               DOT_F32: tl.constexpr):
    """Scores of BLOCK_M queries x BLOCK_N pools as order-preserving int32 keys, plus selectability."""
    sc, valid, offs_n = _tile_scores(q, w3, pk_base, stride_pn, n0, NP, offs_d, d_ok, pos, P,
                                     BLOCK_M, BLOCK_H, BLOCK_N, PREC, DOT_F32)
    bits = sc.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip magnitude bits -> signed int order
    return key, valid, offs_n


@triton.jit
def _kpool_topk_kernel(
    Q, W, PK, OUT, PASSES, CKEY, CPID,
    stride_qb, stride_qs, stride_qh,
    stride_wb, stride_ws, stride_wh,
    stride_pb, stride_pn,
    stride_ob, stride_os,
    S, H, NP, K, P, q_offset,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    RBITS: tl.constexpr, HIST_TL: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr,
    CAND: tl.constexpr, K_POW2: tl.constexpr, SORT_M: tl.constexpr,
):
    NB: tl.constexpr = 1 << RBITS
    n_blocks = tl.cdiv(S, BLOCK_M)
    blk = n_blocks - 1 - tl.program_id(0)  # longest causal ranges first: a shorter tail
    b = tl.program_id(1).to(tl.int64)
    t0 = blk * BLOCK_M

    q, w3, offs_d, d_ok, offs_m, t, m_ok = _load_query_block(
        Q, W, b, t0, stride_qb, stride_qs, stride_qh, stride_wb, stride_ws, stride_wh, S, H,
        D, BLOCK_D, BLOCK_H, BLOCK_M, DOT_F32)
    pk_base = PK + b * stride_pb

    pos = q_offset + t  # absolute positions
    n_valid = tl.where(m_ok, tl.minimum((pos + 1) // P, NP), 0)
    n_hi = tl.minimum((q_offset + tl.minimum(t0 + BLOCK_M, S)) // P, NP)  # pools any row of the block sees

    # Search state per query. Settled rows with n_valid <= K keep an empty prefix and take every
    # selectable pool ("equal to the empty prefix" = all, and `need` = K covers them).
    pos_b = tl.zeros([BLOCK_M], dtype=tl.int32)  # bits of the k-th key known so far
    pref = tl.zeros([BLOCK_M], dtype=tl.int32)  # those bits (unsigned view), zeros below
    need = tl.zeros([BLOCK_M], dtype=tl.int32) + K  # keys still to take from the group
    grp = n_valid  # keys in the group (those sharing the prefix)
    done = n_valid <= K
    passes = tl.full([], 0, tl.int32)
    hrow = offs_m[:, None] * NB

    while tl.sum((~done).to(tl.int32)) > 0:
        active = ~done
        nb = tl.minimum(RBITS, 32 - pos_b)
        shift = 32 - pos_b - nb
        dmask = (1 << nb) - 1
        m = _hi_mask(pos_b)
        hist = tl.zeros([BLOCK_M * NB], dtype=tl.int32)
        gmin = tl.zeros([BLOCK_M], dtype=tl.int32) + _IMAX
        gmax = tl.zeros([BLOCK_M], dtype=tl.int32) - _IMAX - 1
        for n0 in range(0, n_hi, BLOCK_N):
            key, valid, offs_n = _tile_keys(q, w3, pk_base, stride_pn, n0, NP, offs_d, d_ok, pos, P,
                                            BLOCK_M, BLOCK_H, BLOCK_N, PREC, DOT_F32)
            u = key ^ _SIGN  # unsigned bit order
            ing = valid & active[:, None] & ((u & m[:, None]) == pref[:, None])
            dig = (u >> shift[:, None]) & dmask[:, None]
            if HIST_TL:
                # one flattening, so the mask cannot be reordered differently from the bins
                flat = tl.reshape(tl.where(ing, hrow + dig, BLOCK_M * NB), [BLOCK_M * BLOCK_N], can_reorder=True)
                hist += tl.histogram(flat, BLOCK_M * NB, mask=flat < BLOCK_M * NB)
            else:
                one = (dig[:, :, None] == tl.arange(0, NB)[None, None, :]) & ing[:, :, None]
                hist += tl.reshape(tl.sum(one.to(tl.int32), axis=1), [BLOCK_M * NB])
            gmin = tl.minimum(gmin, tl.min(tl.where(ing, key, _IMAX), axis=1))
            gmax = tl.maximum(gmax, tl.max(tl.where(ing, key, -_IMAX - 1), axis=1))

        h2 = tl.reshape(hist, [BLOCK_M, NB])
        ge = tl.sum(h2, axis=1)[:, None] - tl.cumsum(h2, axis=1) + h2  # keys with digit >= d
        d_star = tl.sum((ge >= need[:, None]).to(tl.int32), axis=1) - 1  # digit holding the k-th key
        at = tl.arange(0, NB)[None, :] == d_star[:, None]
        c_ge = tl.sum(tl.where(at, ge, 0), axis=1)
        c = tl.sum(tl.where(at, h2, 0), axis=1)
        need_n = need - (c_ge - c)
        pos_n = pos_b + nb
        pref_n = pref | (d_star << shift)
        # the whole group shares more bits than this digit: jump to the first bit where it differs
        lo_u = gmin ^ _SIGN
        common = _clz32(lo_u ^ (gmax ^ _SIGN))
        jump = common > pos_n
        pref_n = tl.where(jump, lo_u & _hi_mask(common), pref_n)
        pos_n = tl.where(jump, common, pos_n)
        pos_b = tl.where(active, pos_n, pos_b)
        pref = tl.where(active, pref_n, pref)
        need = tl.where(active, need_n, need)
        grp = tl.where(active, c, grp)
        # settled: the group is exactly what is missing, or all its keys are equal, or it is small
        # enough (<= CAND) to be ranked directly after the emit pass
        done = done | (active & ((c == need_n) | (pos_n == 32) | (c <= CAND)))
        passes += 1

    # Emit: above the prefix, or equal to it among the first `need` such keys in pool order. A
    # deferred row (a small group of unequal keys) writes its group to the candidate buffer instead.
    defer = m_ok & (grp > need) & (pos_b < 32)
    m = _hi_mask(pos_b)
    pref_s = pref ^ _SIGN  # signed view for ordered comparison
    cnt = tl.zeros([BLOCK_M], dtype=tl.int32)
    seen = tl.zeros([BLOCK_M], dtype=tl.int32)
    out_rows = OUT + b * stride_ob + t.to(tl.int64) * stride_os
    cand_off = ((tl.program_id(1) * n_blocks + blk) * BLOCK_M + offs_m).to(tl.int64) * CAND
    ckey_rows = CKEY + cand_off
    cpid_rows = CPID + cand_off
    for n0 in range(0, n_hi, BLOCK_N):
        key, valid, offs_n = _tile_keys(q, w3, pk_base, stride_pn, n0, NP, offs_d, d_ok, pos, P,
                                        BLOCK_M, BLOCK_H, BLOCK_N, PREC, DOT_F32)
        top = (key ^ _SIGN) & m[:, None]
        gt = valid & ((top ^ _SIGN) > pref_s[:, None])
        eq = valid & (top == pref[:, None])
        eq_rank = seen[:, None] + tl.cumsum(eq.to(tl.int32), axis=1)
        take = gt | (eq & (eq_rank <= need[:, None]) & ~defer[:, None])
        slot = cnt[:, None] + tl.cumsum(take.to(tl.int32), axis=1) - 1
        ids = tl.broadcast_to(offs_n[None, :], [BLOCK_M, BLOCK_N])
        tl.store(out_rows[:, None] + slot, ids, mask=take & m_ok[:, None] & (slot < K))
        if CAND > 0:
            put = eq & defer[:, None] & (eq_rank <= CAND)
            tl.store(ckey_rows[:, None] + eq_rank - 1, key, mask=put)
            tl.store(cpid_rows[:, None] + eq_rank - 1, ids, mask=put)
        cnt += tl.sum(take.to(tl.int32), axis=1)
        seen += tl.sum(eq.to(tl.int32), axis=1)
    n_defer = tl.sum(defer.to(tl.int32))
    if CAND > 0:  # noqa: SIM102 - a compile-time branch around a run-time one
        if n_defer > 0:
            # rank each candidate by (key desc, pool id asc) among its row's; the buffer is in pool order
            tl.debug_barrier()
            offs_c = tl.arange(0, CAND)
            c_ok = defer[:, None] & (offs_c[None, :] < grp[:, None])
            ck = tl.load(ckey_rows[:, None] + offs_c[None, :], mask=c_ok, other=-_IMAX - 1)
            cp = tl.load(cpid_rows[:, None] + offs_c[None, :], mask=c_ok, other=0)
            ki = ck[:, :, None]
            kj = ck[:, None, :]
            before = c_ok[:, None, :] & ((kj > ki) | ((kj == ki) & (offs_c[None, None, :] < offs_c[None, :, None])))
            rank = tl.sum(before.to(tl.int32), axis=2)
            chosen = c_ok & (rank < need[:, None])
            tl.store(out_rows[:, None] + cnt[:, None] + rank, cp, mask=chosen)
            cnt = tl.where(defer, cnt + need, cnt)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        tl.store(out_rows[:, None] + offs_k[None, :], tl.full([BLOCK_M, BLOCK_K], -1, tl.int32),
                 mask=m_ok[:, None] & (offs_k[None, :] >= cnt[:, None]) & (offs_k[None, :] < K))
    if CAND > 0:  # noqa: SIM102 - a compile-time branch around a run-time one
        if n_defer > 0:
            # a deferred row holds its picks after the pools above the prefix: restore ascending order
            # (-1 padding of the other rows sorts last as INT_MAX, so whole rows can be sorted)
            tl.debug_barrier()
            offs_k = tl.arange(0, K_POW2)
            for r0 in tl.static_range(0, BLOCK_M, SORT_M):
                tr = t0 + r0 + tl.arange(0, SORT_M)
                ptrs = OUT + b * stride_ob + tr[:, None].to(tl.int64) * stride_os + offs_k[None, :]
                ok = (tr[:, None] < S) & (offs_k[None, :] < K)
                row = tl.load(ptrs, mask=ok, other=-1)
                row = tl.sort(tl.where(row < 0, _IMAX, row), dim=1)
                tl.store(ptrs, tl.where(row == _IMAX, -1, row), mask=ok)
    stat = PASSES + 2 * (tl.program_id(1) * n_blocks + blk)
    tl.store(stat, passes)
    tl.store(stat + 1, n_defer)




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
    """Tile sizes, not tuned on a GPU yet: 256 (query, head) MMA rows per program, 64 pools per tile,
    4-bit radix digits (a BLOCK_M * 16-bin histogram per tile; see bench/NOTES.md)."""
    block_h = triton.next_power_of_2(H)
    block_m = max(1, min(64, 256 // block_h))
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 128, "RBITS": 4, "HIST_TL": True, "CAND": 32,
            "BLOCK_H": block_h, "BLOCK_D": max(16, triton.next_power_of_2(D)), "num_warps": 8, "num_stages": 2}


def _last_contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


LAST_LAUNCH: dict = {}  # config, search passes per program, compiled-kernel facts: for the benchmark


def kpool_topk_triton(q: torch.Tensor, w: torch.Tensor, pk: torch.Tensor, pool: int, k_pools: int,
                      q_offset: int = 0, cfg: dict | None = None) -> torch.Tensor:
    """int32 [B, S, k_pools] pool ids, the same function as `naive.kpool_topk_torch` (see there).

    q [B,S,H,D] and pk [B,NP,D] share bf16/fp16/fp32 (fp32 runs the MMAs in IEEE fp32); w [B,S,H]
    is read as fp32; q_offset is the absolute position of q[:, 0]. `cfg` overrides the tile config
    (BLOCK_M, BLOCK_N, BLOCK_K, RBITS, HIST_TL, CAND, num_warps, num_stages). Supported: H <= 128,
    D <= 256, k_pools <= 8192 with the candidate buffer (any with CAND=0). Extra memory: the output
    plus 8 * CAND bytes per query.
    """
    _check(q, w, pk, pool, k_pools, q_offset)
    q, pk = _last_contig(q), _last_contig(pk)
    B, S, H, D = q.shape
    NP = pk.shape[1]
    c = dict(_cfg(H, D), **(cfg or {}))
    pow2 = lambda v: v >= 1 and v & (v - 1) == 0
    if (c["BLOCK_M"] * c["BLOCK_H"] < 16 or c["BLOCK_N"] < 16 or c["BLOCK_M"] * (1 << c["RBITS"]) < 32
            or not all(pow2(c[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) or not 1 <= c["RBITS"] <= 8
            or not (c["CAND"] == 0 or pow2(c["CAND"]))):
        raise ValueError(f"kpool_topk_triton: tile config {c} unsupported (powers of two with BLOCK_M*BLOCK_H >= 16, "
                         f"BLOCK_N >= 16, BLOCK_M * 2**RBITS >= 32, RBITS in 1..8, CAND 0 or a power of two)")
    if c["BLOCK_H"] < H or c["BLOCK_D"] < max(D, 16):
        raise ValueError(f"kpool_topk_triton: BLOCK_H={c['BLOCK_H']}, BLOCK_D={c['BLOCK_D']} must cover H={H}, D={D}")
    if c["CAND"] and k_pools > 8192:
        raise ValueError(f"kpool_topk_triton: k_pools={k_pools} too large for the row sort of the candidate "
                         f"path (<= 8192); pass cfg={{'CAND': 0}}")
    out = torch.empty(B, S, k_pools, dtype=torch.int32, device=q.device)
    if S == 0 or B == 0 or k_pools == 0:
        return out.fill_(-1)
    n_blocks = triton.cdiv(S, c["BLOCK_M"])
    stats = torch.zeros(B * n_blocks, 2, dtype=torch.int32, device=q.device)  # search passes, deferred rows
    n_cand = B * n_blocks * c["BLOCK_M"] * c["CAND"]
    cand_key = torch.empty(max(n_cand, 1), dtype=torch.int32, device=q.device)
    cand_pid = torch.empty(max(n_cand, 1), dtype=torch.int32, device=q.device)
    k_pow2 = max(16, triton.next_power_of_2(k_pools))
    grid = (n_blocks, B)
    if _interpreting():
        _fix_interpreter_loop_bounds()
    kern = _kpool_topk_kernel[grid](
        q, w, pk, out, stats, cand_key, cand_pid,
        q.stride(0), q.stride(1), q.stride(2),
        w.stride(0), w.stride(1), w.stride(2),
        pk.stride(0), pk.stride(1),
        out.stride(0), out.stride(1),
        S, H, NP, k_pools, pool, q_offset,
        D=D, BLOCK_D=c["BLOCK_D"], BLOCK_H=c["BLOCK_H"], BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"],
        BLOCK_K=c["BLOCK_K"], RBITS=c["RBITS"], HIST_TL=c["HIST_TL"],
        PREC="ieee" if q.dtype == torch.float32 or _interpreting() else "tf32",
        DOT_F32=_interpreting() and q.dtype != torch.float32,
        CAND=c["CAND"], K_POW2=k_pow2, SORT_M=max(1, min(c["BLOCK_M"], 8192 // k_pow2)),
        num_warps=c["num_warps"], num_stages=c["num_stages"],
    )
    LAST_LAUNCH.clear()
    LAST_LAUNCH.update(c, passes=stats[:, 0], deferred=stats[:, 1], n_regs=getattr(kern, "n_regs", None),
                       n_spills=getattr(kern, "n_spills", None))
    return out
