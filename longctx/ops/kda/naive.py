"""Kimi Delta Attention in plain torch: the recurrence, its chunkwise form, and a one-token step.

Per head, with k (and q) L2-normalised, g <= 0 a per-key-channel log decay and beta in (0, 1):

    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T        S: [K, V]
    o_t = S_t^T (scale * q_t)

`kda_recurrent` is the token-by-token reference. `kda_chunk` computes the same function a chunk
at a time (the WY / UT-transform form) and is what training uses on the CPU; `kda_step` is the
decode step. Everything runs in fp32 (fp64 when the inputs are fp64), whatever the input dtype,
because the state accumulates rounding over the whole sequence. All three are ordinary autograd
code. The layer-level helpers `l2norm` and `kda_gate` live here too, so the fla wrapper and its
test can state their contract in terms of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["kda_recurrent", "kda_chunk", "kda_step", "kda_gate", "l2norm"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


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
    B, T, H, K = q.shape
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
