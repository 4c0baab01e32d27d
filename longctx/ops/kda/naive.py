"""Kimi Delta Attention in plain torch: the recurrence, its chunkwise form, and a one-token step.

Per head, with k (and q) L2-normalised, g <= 0 a per-key-channel log decay and beta in (0, 1):

    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T        S: [K, V]
    o_t = S_t^T (scale * q_t)

`kda_recurrent` is the token-by-token reference. `kda_chunk` computes the same function a chunk
at a time (the WY / UT-transform form) and is what training uses on the CPU; `kda_step` is the
decode step. Everything runs in fp32 (fp64 when the inputs are fp64), whatever the input dtype,
because the state accumulates rounding over the whole sequence. All three are ordinary autograd
code. The layer-level helpers `l2norm` and `kda_gate`, the short conv before the recurrence
(`causal_conv1d`) and the gated output norm after it (`gated_rms_norm`) live here too, so the fla
wrappers (`fla.py`) and their tests can state their contracts in terms of them.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d", "gated_rms_norm", "kda_chunk", "kda_gate", "kda_recurrent", "kda_step", "l2norm"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _outside_autocast(fn):
    """Run `fn` with autocast off on its inputs' device: its casts to fp32 are otherwise undone by
    autocast, which runs matmuls and einsums in bf16. Under autocast the state S would be rounded to bf16
    between chunks and the decode step would read it through bf16 einsums: 5.7e-3 rel-RMS between the
    training and decode paths of one layer on identical inputs, against 0.3e-3 in fp32
    (`tests/ops/test_kda.py::test_twin_computes_in_fp32_under_autocast` holds it to autocast-off's result)."""

    @functools.wraps(fn)
    def run(q, *a, **kw):
        with torch.autocast(q.device.type, enabled=False):
            return fn(q, *a, **kw)

    return run


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, in fp32 (fp64 stays fp64); fla's in-kernel form."""
    x = x.to(_compute_dtype(x))
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def kda_gate(g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """The KDA forget gate (log decay per key channel) from its pre-activation.

    g_raw [..., H, K], A_log [H], dt_bias [H*K]. With a lower bound b < 0 (the bounded decay):
    b * sigmoid(exp(A_log) * (g_raw + dt_bias)), so every step keeps at least e^b of the state.
    Without (None): -exp(A_log) * softplus(g_raw + dt_bias), unbounded below. Computed in fp32.
    """
    H, K = g_raw.shape[-2:]
    x = g_raw.to(_compute_dtype(g_raw)) + dt_bias.to(_compute_dtype(g_raw)).view(H, K)
    rate = A_log.to(x.dtype).exp().view(H, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * x)
    return -rate * F.softplus(x)


# ------------------------------------------------------------------------------ recurrence
def _check_shapes(q, k, v, g, beta):
    B, T, H, _ = q.shape
    if k.shape != q.shape or g.shape != q.shape or v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(
            f"kda: expected q, k, g [B,T,H,K], v [B,T,H,V], beta [B,T,H] with the same B,T,H; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}."
        )


def _step(S, q, k, v, g, beta):
    """One recurrence step on [B,H,*] slices; q already scaled. Returns (o [B,H,V], S)."""
    S = S * g.exp().unsqueeze(-1)
    pred = torch.einsum("bhk,bhkv->bhv", k, S)
    S = S + torch.einsum("bhk,bhv->bhkv", k, (v - pred) * beta.unsqueeze(-1))
    return torch.einsum("bhk,bhkv->bhv", q, S), S


@_outside_autocast
def kda_recurrent(q, k, v, g, beta, scale, initial_state=None, output_final_state=False):
    """Token-by-token KDA (the slow reference). Returns (o [B,T,H,V] in q.dtype, final state or None)."""
    _check_shapes(q, k, v, g, beta)
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype, cd = q.dtype, _compute_dtype(q)
    q, k, v, g, beta = (x.to(cd) for x in (q, k, v, g, beta))
    q = q * scale
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(cd)
    outs = []
    for t in range(T):
        o, S = _step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        outs.append(o)
    o = torch.stack(outs, 1) if outs else q.new_zeros(B, 0, H, V)
    return o.to(out_dtype), (S if output_final_state else None)


@_outside_autocast
def kda_step(q, k, v, g, beta, scale, state):
    """Decode one token (T == 1). `state` [B,H,K,V] is not modified; returns (o [B,1,H,V] in q.dtype, new state)."""
    _check_shapes(q, k, v, g, beta)
    if q.shape[1] != 1:
        raise ValueError(f"kda_step takes one token (T == 1); got q {tuple(q.shape)}. Use kda_chunk for T > 1.")
    cd = _compute_dtype(q)
    o, S = _step(
        state.to(cd), q[:, 0].to(cd) * scale, k[:, 0].to(cd), v[:, 0].to(cd), g[:, 0].to(cd), beta[:, 0].to(cd)
    )
    return o.unsqueeze(1).to(q.dtype), S


# ------------------------------------------------------------------------------ chunkwise form
def _suffix_sum(g: torch.Tensor) -> torch.Tensor:
    """sum_{m > j} g_m along dim -2, summed directly (not as G_end - G_j, which loses the small
    differences of two large fp32 cumsums)."""
    r = g.flip(-2).cumsum(-2).flip(-2)
    return F.pad(r[..., 1:, :], (0, 0, 0, 1))


def _intra_chunk_scores(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A[x][..., i, j] = sum_c x_ic k_jc exp(G_ic - G_jc) for j <= i, 0 above, for x in (q, k).

    q, k, g [..., C, K] (g the per-token log decays, G their running sum); returns [2, ..., C, C].
    The usual factorisation (q exp G)(k exp -G)^T needs exp(-G), up to e^{5C} with the bounded
    gate and unbounded with the softplus gate. Instead the lower triangle is assembled from a
    binary split of the chunk: each off-diagonal block (rows = second half of a span, columns =
    first half) is referenced to the boundary r between the halves, as
    (x_i exp(G_i - G_r)) . (k_j exp(G_r - G_j)). Both exponents are sums of g over the tokens
    between (summed locally, so their fp32 error scales with the exponent itself, not with G),
    hence <= 0: nothing overflows, and a factor only underflows when the true product is below
    fp32's range anyway. The work is still matmuls, about one [C,K]x[K,C] product per chunk over
    log2 C levels, batched over all chunks at once.
    """
    C = q.shape[-2]
    P = 1 << (C - 1).bit_length()
    if P != C:  # pad the chunk to a power of two: zero q/k rows add nothing
        q, k, g = (F.pad(x, (0, 0, 0, P - C)) for x in (q, k, g))
    x = torch.stack([q, k])
    blocks = (x * k).sum(-1)[..., None, None]  # [2, ..., P, 1, 1]: the diagonal, exp(0) = 1
    s = 1
    while s < P:
        n = P // (2 * s)
        gp = g.unflatten(-2, (n, 2, s))  # [..., n, 2, s, K]
        rows = x.unflatten(-2, (n, 2, s))[..., 1, :, :] * gp[..., 1, :, :].cumsum(-2).exp()
        cols = k.unflatten(-2, (n, 2, s))[..., 0, :, :] * _suffix_sum(gp[..., 0, :, :]).exp()
        off = rows @ cols.transpose(-1, -2)  # [2, ..., n, s, s]
        d = blocks.unflatten(-3, (n, 2))
        d0, d1 = d[..., 0, :, :], d[..., 1, :, :]
        blocks = torch.cat([torch.cat([d0, torch.zeros_like(d0)], -1), torch.cat([off, d1], -1)], -2)
        s *= 2
    return blocks.squeeze(-3)[..., :C, :C]


def _check_cu_seqlens(cu_seqlens: torch.Tensor, B: int, T: int) -> list[int]:
    if B != 1:
        raise ValueError(f"kda_chunk with cu_seqlens takes packed documents in one row (B == 1); got B = {B}.")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype.is_floating_point:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N+1]; got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}.")
    b = [int(x) for x in cu_seqlens.tolist()]
    if b[0] != 0 or b[-1] != T or any(y < x for x, y in itertools.pairwise(b)):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {T}; got {b[:4]}...{b[-2:]} ({len(b) - 1} documents).")
    return b


@_outside_autocast
def kda_chunk(q, k, v, g, beta, scale, initial_state=None, output_final_state=False, chunk_size=64, cu_seqlens=None):
    """Chunkwise KDA, the same function as `kda_recurrent` (autograd through it is the CPU backward).

    Within a chunk of C tokens with cumulative log decay G (per key channel, G_i = sum_{j<=i} g_j),
    the deltas u = beta * (v - k^T D S_prev) solve a unit lower-triangular system (the UT
    transform): (I + L) u = beta v - beta (k exp G) S0 with L_ij = beta_i sum_c k_ic k_jc exp(G_ic - G_jc),
    so u = U - W S0 with W, U from one triangular solve per chunk. Then
        o     = A_qk U + (q exp G - A_qk W) S0          (A_qk the causal decayed q.k block, diag included)
        S_end = (Diag(exp G_C) - Kd^T W) S0 + Kd^T U,   Kd = k exp(G_C - G).
    Everything but the last line's recurrence over chunks is batched over all chunks; the loop
    does one [K,K]x[K,V] matmul per chunk. Working memory is O(T*C + T/C*K*V) per head: no
    [T, T] matrix. Every exponential has a non-positive argument: exp G, exp(G_C - G) directly,
    and the pairwise exp(G_i - G_j) through the block split of `_intra_chunk_scores`, so it is
    safe in fp32 for any decay, bounded or not.

    Shapes as `kda_recurrent`; T need not be a multiple of chunk_size. cu_seqlens (int [N+1],
    B == 1) marks packed documents: chunks never straddle a document (each is padded up to a
    chunk boundary internally) and the state restarts at each; initial_state and the final
    state are then [N, H, K, V]. Returns (o in q.dtype, final state in fp32/fp64 or None).
    """
    _check_shapes(q, k, v, g, beta)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"kda_chunk: chunk_size must be a positive integer; got {chunk_size!r}.")
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    out_dtype, cd = q.dtype, _compute_dtype(q)
    bounds = _check_cu_seqlens(cu_seqlens, B, T) if cu_seqlens is not None else None
    n_seq = B if bounds is None else len(bounds) - 1
    if initial_state is not None and tuple(initial_state.shape) != (n_seq, H, K, V):
        raise ValueError(f"kda_chunk: initial_state must be {[n_seq, H, K, V]}; got {list(initial_state.shape)}.")

    q, k, v, g = (x.to(cd).transpose(1, 2) for x in (q, k, v, g))  # [B, H, T, D]
    beta = beta.to(cd).transpose(1, 2)  # [B, H, T]
    q = q * scale
    if bounds is None:
        pad = (-T) % C
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
        N = (T + pad) // C
        segments = [(0, N, slice(None))]
        dst = None
    else:
        # Lay each document out from a chunk boundary; pad slots read a zero token (index T).
        starts = torch.tensor(bounds[:-1])
        lens = torch.tensor(bounds[1:]) - starts
        nch = (lens + C - 1) // C
        first = torch.cumsum(nch, 0) - nch
        doc = torch.repeat_interleave(torch.arange(n_seq), lens)
        dst = first[doc] * C + torch.arange(T) - starts[doc]
        N = int(nch.sum())
        src = torch.full((N * C,), T, dtype=torch.long)
        src[dst] = torch.arange(T)
        src, dst = src.to(q.device), dst.to(q.device)
        q, k, v, g = (torch.cat([x, x.new_zeros(B, H, 1, x.shape[-1])], 2)[:, :, src] for x in (q, k, v, g))
        beta = torch.cat([beta, beta.new_zeros(B, H, 1)], 2)[:, :, src]
        segments = [(int(f), int(f + n), slice(d, d + 1)) for d, (f, n) in enumerate(zip(first, nch))]

    if N == 0:
        o = q.new_zeros(B, T, H, V).to(out_dtype)
        S0 = q.new_zeros(n_seq, H, K, V) if initial_state is None else initial_state.to(cd)
        return o, (S0 if output_final_state else None)

    q, k, v, g = (x.unflatten(2, (N, C)) for x in (q, k, v, g))  # [B, H, N, C, D]
    beta = beta.unflatten(2, (N, C)).unsqueeze(-1)  # [B, H, N, C, 1]
    G = g.cumsum(-2)
    A_qk, A_kk = _intra_chunk_scores(q, k, g)
    L = (A_kk * beta).tril(-1)
    WU = torch.linalg.solve_triangular(L, torch.cat([k * G.exp(), v], -1) * beta, upper=False, unitriangular=True)
    W, U = WU.split([K, V], -1)
    Kd_t = (k * _suffix_sum(g).exp()).transpose(-1, -2)  # [B, H, N, K, C]: k_j exp(G_C - G_j)
    trans = torch.diag_embed(G[..., -1, :].exp()) - Kd_t @ W  # [B, H, N, K, K]
    inject = Kd_t @ U  # [B, H, N, K, V]
    P = q * G.exp() - A_qk @ W  # output's read-out of the chunk's starting state
    o = A_qk @ U  # output from within the chunk

    trans, inject = trans.unbind(2), inject.unbind(2)
    before, finals = [None] * N, []
    for c0, c1, sl in segments:
        S = q.new_zeros(B if bounds is None else 1, H, K, V) if initial_state is None else initial_state[sl].to(cd)
        for n in range(c0, c1):
            before[n] = S
            S = trans[n] @ S + inject[n]
        finals.append(S)
    o = o + P @ torch.stack(before, 2)
    o = o.flatten(2, 3)  # [B, H, N*C, V]
    o = o[:, :, :T] if dst is None else o[:, :, dst]
    final = (finals[0] if bounds is None else torch.cat(finals, 0)) if output_final_state else None
    return o.transpose(1, 2).to(out_dtype), final


# ------------------------------------------------------------------------------ short conv, output norm
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                  window: torch.Tensor | None = None):
    """SiLU(depthwise causal conv) of x [B, T, C] with weight [C, W] (weight[:, W-1] multiplies the current
    token), computed in the weight's dtype and returned in x's; taps never cross a cu_seqlens boundary.

    With `window` [B, C, W-1] (the W-1 inputs before x, oldest first; not with cu_seqlens) it returns
    (y, the new window in the weight's dtype). The contract of `fla.fla_causal_conv1d`."""
    _, T, C = x.shape
    W = weight.shape[-1]
    w = weight.unsqueeze(1)  # [C, 1, W]
    xt = x.transpose(1, 2).to(w.dtype)  # [B, C, T]
    if window is not None:
        if cu_seqlens is not None:
            raise ValueError("causal_conv1d: a window continues unpacked rows; drop cu_seqlens.")
        xt = torch.cat([window.to(w.dtype), xt], -1)
        y = F.conv1d(xt, w, groups=C)
        return F.silu(y).transpose(1, 2).to(x.dtype), xt[..., xt.shape[-1] - (W - 1):]
    if cu_seqlens is None:
        y = F.conv1d(F.pad(xt, (W - 1, 0)), w, groups=C)
    else:
        starts = cu_seqlens.to(device=x.device, dtype=torch.long)
        pos = torch.arange(T, device=x.device)
        pos = pos - starts[torch.searchsorted(starts, pos, right=True) - 1]  # position inside its document
        y = xt * w[:, :, W - 1]
        for i in range(1, W):  # tap i reads x_{t-i}: valid when the token is >= i into its document
            y = y + F.pad(xt, (i, 0))[..., :T] * w[:, :, W - 1 - i] * (pos >= i)
    return F.silu(y).transpose(1, 2).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x) * sigmoid(gate) over the last dim, in x's dtype. Computed in fp32, or fp64 for
    fp64 inputs (the KDA twin's exact checks: an fp32 rounding here made them differ by 1e-7 relative).
    The contract of `fla.fla_gated_rms_norm`."""
    cd = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(cd)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(cd) * xf * torch.sigmoid(gate.to(cd))).to(x.dtype)
