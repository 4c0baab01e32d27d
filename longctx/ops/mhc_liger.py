"""mHC (manifold-constrained hyper-connections) through liger-kernel's Triton ops (CUDA only), imported lazily.

Contract: with the parameters of `longctx.layers.residual.MHC` (fn [(2+n)n, nD], base [(2+n)n] fp32,
scale [3] fp32) and streams [..., n, D],

    pre, post, comb = liger_mhc_coefficients(streams, fn, base, scale, iters=, hc_eps=, norm_eps=)
        == MHC.coefficients(streams)                               (comb[..., j, i]: stream j -> i)
    liger_mhc_pre(streams, pre)             == (pre[..., None] * streams).sum(-2).to(streams.dtype)
    liger_mhc_post_res(streams, y, post, comb)
        == post[..., None] * y[..., None, :] + comb^T @ streams      (out[i] = post[i] y + sum_j comb[j, i] s[j])

forward and backward, within bf16 rounding (tests/test_gpu_mhc.py). The mapping onto liger 0.8.5's
`liger_mhc_coeffs` / `liger_mhc_pre` / `liger_mhc_post_res`:

- phi = fn^T ([nD, (2+n)n]; liger's layout is [K, M]); b = base; alpha_pre/post/res = scale[0/1/2].
  The split order (pre n, post n, comb n*n row-major) is the same.
- pre_eps = sinkhorn_eps = hc_eps, post_mult = 2, tmax = hc_sinkhorn_iters, rms_eps = rms_norm_eps:
  pre = sigmoid + eps, post = 2 sigmoid, comb = row softmax + eps, a column normalisation, then
  (tmax - 1) rounds of rows then columns, each dividing by (sum + eps): our Sinkhorn exactly.
- liger's post/res reads h_res[o, i] (row = output stream); ours uses comb[j, i] with j the input
  stream, so `liger_mhc_post_res` is given comb transposed (a [.., n, n] fp32 copy per token).
- Precision: liger computes the projection with fp32 accumulation from bf16 streams and the fp32 fn
  through tl.dot, i.e. TF32 products on tensor cores (ours is full fp32); the collapse and the
  expand accumulate in fp32 (ours expands in the streams' dtype). Sinkhorn maths is fp32 in both.
- n must be a power of two (tl.arange) and at most 16 (liger's register budget); iters >= 1.
  Backward keeps the Sinkhorn history, tmax * n^2 fp32 per token, and the bf16 streams; no fp32
  copy of the streams is saved, so MHC.recompute_cast has nothing to do on this path.
"""

from __future__ import annotations

import functools

import torch

from ..errors import ConfigError
from .fused_loss import LIGER_MIN_VERSION, liger_import_error

__all__ = ["check_mhc_args", "liger_mhc_available", "liger_mhc_coefficients", "liger_mhc_post_res", "liger_mhc_pre"]

MAX_STREAMS = 16


def _import_mhc_ops():
    from liger_kernel.transformers.functional import (  # noqa: F401
        liger_mhc_coeffs,
        liger_mhc_post_res,
        liger_mhc_pre,
    )


@functools.lru_cache(maxsize=1)
def _import_error() -> str | None:
    return liger_import_error(_import_mhc_ops, "its mHC ops")


def import_error() -> str | None:
    """Why liger's mHC ops cannot be imported, or None."""
    return _import_error()


def liger_mhc_available() -> bool:
    """True when liger-kernel's mHC ops import and a CUDA device is present."""
    return torch.cuda.is_available() and _import_error() is None


def streams_supported(n: int) -> bool:
    """Whether liger's kernels take n streams (a power of two, at most 16)."""
    return 1 <= n <= MAX_STREAMS and n & (n - 1) == 0


def check_mhc_args(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int) -> None:
    """Raise ConfigError / ValueError (naming the shape) for what liger's mHC cannot take."""
    if streams.dim() < 3:
        raise ValueError(f"liger mHC takes streams [..., n, D]; got {tuple(streams.shape)}.")
    n, D = streams.shape[-2:]
    if not streams_supported(n):
        raise ConfigError(f"residual_impl 'liger' takes model.hc_streams a power of two <= {MAX_STREAMS} (streams "
                          f"{tuple(streams.shape)} have n = {n}); set residual_impl to 'torch' or change hc_streams.")
    if iters < 1:
        raise ConfigError(f"residual_impl 'liger' needs model.hc_sinkhorn_iters >= 1 (got {iters}).")
    M = (2 + n) * n
    if fn.shape != (M, n * D):
        raise ValueError(f"liger mHC: fn {tuple(fn.shape)} must be [(2+n)n, nD] = [{M}, {n * D}] for streams "
                         f"{tuple(streams.shape)}.")
    if base.shape != (M,) or scale.shape != (3,):
        raise ValueError(f"liger mHC: base {tuple(base.shape)} must be [{M}] and scale {tuple(scale.shape)} [3].")
    if streams.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"liger mHC: streams must be bf16, fp16 or fp32, got {streams.dtype}.")
    if not (streams.is_cuda and fn.device == streams.device == base.device == scale.device):
        raise ValueError(f"liger mHC runs on one CUDA device; got streams on {streams.device}, fn on {fn.device}, "
                         f"base on {base.device}, scale on {scale.device}.")


def _require() -> None:
    err = _import_error()
    if err is not None:
        raise RuntimeError(f"liger mHC needs liger-kernel >= {LIGER_MIN_VERSION}; {err}")


def liger_mhc_coefficients(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                           iters: int, hc_eps: float, norm_eps: float):
    """(pre [..., n], post [..., n], comb [..., n, n]) fp32, as MHC.coefficients (comb[j, i]: stream j -> i)."""
    _require()
    from liger_kernel.transformers.functional import liger_mhc_coeffs

    check_mhc_args(streams, fn, base, scale, iters)
    s_pre, s_post, s_comb = scale.unbind(0)
    return liger_mhc_coeffs(
        streams, fn.t(), base, s_pre, s_post, s_comb,
        allow_fp32=True, tmax=int(iters), rms_eps=float(norm_eps), pre_eps=float(hc_eps),
        sinkhorn_eps=float(hc_eps), post_mult=2.0,
    )


def liger_mhc_pre(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_j pre[j] * streams[j], accumulated in fp32, in the streams' dtype: [..., D]."""
    _require()
    from liger_kernel.transformers.functional import liger_mhc_pre as _pre

    return _pre(streams, pre)


def liger_mhc_post_res(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out[i] = post[i] * y + sum_j comb[j, i] * streams[j], in the streams' dtype: [..., n, D]."""
    _require()
    from liger_kernel.transformers.functional import liger_mhc_post_res as _post_res

    if y.shape != streams.shape[:-2] + streams.shape[-1:]:
        raise ValueError(f"liger mHC: the sub-layer output {tuple(y.shape)} must be streams {tuple(streams.shape)} "
                         "without the stream dimension.")
    return _post_res(streams, y.to(streams.dtype), post, comb.transpose(-1, -2))
