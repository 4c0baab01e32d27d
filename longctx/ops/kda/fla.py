"""KDA through fla-core 0.6.0's Triton kernels (CUDA only), imported lazily.

Contract. The fla path takes the gate *before* its activation, so the gate, the q/k L2 norm and the
decay cumsum all happen inside the kernel and nothing of size [B, T, H, K] in fp32 is kept:

    fla_chunk_kda(q, k, v, g_raw, beta, A_log=, dt_bias=, lower_bound=, scale=, ...)
        == kda_chunk(l2norm(q), l2norm(k), v, kda_gate(g_raw, A_log, dt_bias, lower_bound), beta, scale, ...)

with `l2norm`, `kda_gate`, `kda_chunk` from `longctx.ops.kda.naive` (tests/ops/test_kda_gpu.py checks
this). q, k are the raw (post conv + SiLU) projections [B,T,H,K]; g_raw = f_b_proj(f_a_proj(x)) as
[B,T,H,K]; A_log [H] and dt_bias [H*K] fp32 parameters (they receive gradients); beta [B,T,H]
already through its sigmoid. With a lower bound in [-5, 0) fla's `safe_gate` path runs (the bounded
decay: 16-token tiles on tensor cores); a lower bound below -5 still bounds the gate but runs fla's
general path; lower_bound None is the softplus gate. initial_state / final state are fp32
[N, H, K, V]. `fla_recurrent_kda` is the same contract, forward only, for decoding.
"""

from __future__ import annotations

import functools
import os

import torch

from .. import warn_tf32

__all__ = ["fla_available", "fla_causal_conv1d", "fla_chunk_kda", "fla_gated_rms_norm", "fla_import_error",
           "fla_recurrent_kda"]


# fla's kernels autotune for every new shape, and Triton keeps the choice on disk only with this set (its
# compiled kernels it keeps anyway): without it, every process autotunes afresh. A 1M-token step's first run
# in a process takes 162 s with no cache, 68.8 s with an earlier process's compiled kernels and autotuning
# choices, 46.9 s warm (H200, dev/LOG.md). Set before fla is first imported (its autotuners
# read it when they are made); a value the user set wins, "0" included.
AUTOTUNE_CACHE_ENV = "TRITON_CACHE_AUTOTUNING"


@functools.lru_cache(maxsize=1)
def _import_error() -> str | None:
    os.environ.setdefault(AUTOTUNE_CACHE_ENV, "1")
    try:
        import fla.ops.kda  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a triton/torch mismatch raised while importing
        return f"{type(e).__name__}: {e}"
    return None


def fla_import_error() -> str | None:
    """Why fla's KDA kernels do not import, or None."""
    return _import_error()


def fla_available() -> bool:
    """True when fla's KDA kernels import and a CUDA device is present."""
    return torch.cuda.is_available() and _import_error() is None


def _require(*tensors: torch.Tensor) -> None:
    err = _import_error()
    if err is not None:
        raise RuntimeError(f"the fla KDA backend needs fla-core 0.6.0 (pip install fla-core==0.6.0); importing it failed: {err}")
    for t in tensors:
        if not t.is_cuda:
            raise RuntimeError(f"the fla KDA backend runs on CUDA tensors only; got a tensor on {t.device}. Use kernels.kda = 'torch'.")


def _common_kwargs(q, A_log, dt_bias, lower_bound, scale, initial_state, output_final_state, cu_seqlens) -> dict:
    """What both fla entry points take alike: the gate in the kernel, L2-normalised q/k, an fp32
    initial state and int64 cu_seqlens on q's device."""
    return {"scale": scale, "use_qk_l2norm_in_kernel": True, "output_final_state": output_final_state,
            "initial_state": None if initial_state is None else initial_state.float(),
            "cu_seqlens": None if cu_seqlens is None else cu_seqlens.to(device=q.device, dtype=torch.long),
            "use_gate_in_kernel": True, "A_log": A_log, "dt_bias": dt_bias, "lower_bound": lower_bound}


def fla_chunk_kda(
    q, k, v, g_raw, beta, *, A_log, dt_bias, lower_bound, scale,
    initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=64,
):
    """Training / prefill: fla `chunk_kda` (fwd + bwd). Returns (o [B,T,H,V] in v.dtype, final state or None)."""
    from fla.ops.kda import chunk_kda

    _require(q)
    warn_tf32("KDA: fla-core's chunk_kda (kernels.kda 'fla', auto's choice on CUDA; forward and backward)",
              "its Triton dots keep tl.dot's default precision; set kernels.kda = 'torch' for fp32 products", q, k, v)
    if chunk_size not in (32, 64):
        raise ValueError(f"the fla KDA kernel takes chunk_size 32 or 64; got {chunk_size}. Set model.kda_chunk_size to 64.")
    if q.shape[-1] > 256:
        raise ValueError(f"the fla KDA kernel takes head_dim <= 256; got q {tuple(q.shape)}.")
    return chunk_kda(
        q, k, v, g_raw, beta,
        safe_gate=lower_bound is not None and -5.0 <= lower_bound < 0.0,
        chunk_size=chunk_size,
        **_common_kwargs(q, A_log, dt_bias, lower_bound, scale, initial_state, output_final_state, cu_seqlens),
    )


def fla_recurrent_kda(
    q, k, v, g_raw, beta, *, A_log, dt_bias, lower_bound, scale,
    initial_state=None, output_final_state=True, cu_seqlens=None,
):
    """Decoding: fla `fused_recurrent_kda` (forward only). Returns (o, final state fp32 or None)."""
    from fla.ops.kda import fused_recurrent_kda

    _require(q)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g_raw, beta, A_log, dt_bias)):
        raise RuntimeError("fla's fused_recurrent_kda has no backward; run decoding under torch.no_grad() or use kernels.kda = 'torch'.")
    return fused_recurrent_kda(
        q, k, v, g_raw, beta,
        **_common_kwargs(q, A_log, dt_bias, lower_bound, scale, initial_state, output_final_state, cu_seqlens),
    )


def fla_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                      window: torch.Tensor | None = None):
    """SiLU(depthwise causal conv) of x [B, T, C] with weight [C, W] through fla's Triton kernel: the same
    function as `naive.causal_conv1d` (weight[:, W-1] multiplies the current token, taps never cross a
    cu_seqlens boundary), in x's layout and dtype (no transposes or fp32 copies).

    With `window` [B, C, W-1] (the W-1 inputs before x, oldest first; not with cu_seqlens) it returns
    (y, the new window), both differentiable: fla's state is [B, C, W] with column W + j holding input
    j < 0, so the window is its columns 1.. and column 0 (input -W) is never read by a width-W conv."""
    _require(x, weight)
    from fla.modules.causal_conv1d.ops import causal_conv1d

    if cu_seqlens is not None:
        if window is not None:
            raise ValueError("fla_causal_conv1d: a window continues unpacked rows; drop cu_seqlens.")
        cu_seqlens = cu_seqlens.to(device=x.device, dtype=torch.long)
    if window is None:
        y, _ = causal_conv1d(x, weight=weight, activation="silu", backend="triton", cu_seqlens=cu_seqlens)
        return y
    W = weight.shape[-1]
    if window.shape != (x.shape[0], x.shape[2], W - 1):
        raise ValueError(f"fla_causal_conv1d: window {tuple(window.shape)}, expected {(x.shape[0], x.shape[2], W - 1)}")
    init = torch.nn.functional.pad(window.to(x.dtype), (1, 0)).contiguous()
    y, final = causal_conv1d(x, weight=weight, initial_state=init, output_final_state=True, activation="silu",
                             backend="triton")
    return y, final[..., 1:]


def fla_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x) * sigmoid(gate) over the last dim, in x's dtype, through fla's fused Triton
    kernel: the same function as `naive.gated_rms_norm` (fp32 inside), which keeps four fp32 copies
    of x's size for backward where fla's keeps x, the gate and one fp32 rstd per row."""
    _require(x, gate)
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    return rms_norm_gated(x, gate, weight, None, activation="sigmoid", eps=eps)
