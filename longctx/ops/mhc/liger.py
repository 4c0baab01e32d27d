"""mHC (manifold-constrained hyper-connections) through liger-kernel's Triton ops (CUDA only), imported lazily.

Contract: with the parameters of `longctx.layers.residual.MHC` (fn [(2+n)n, nD], base [(2+n)n] fp32,
scale [3] fp32) and streams [..., n, D], the functions of `naive.py`:

    liger_mhc_coefficients(streams, fn, base, scale, iters=, hc_eps=, norm_eps=)
        == naive.mhc_coefficients(streams, fn, base, scale, ...)   (comb[..., j, i]: stream j -> i)
    liger_mhc_pre(streams, pre)                == naive.mhc_pre(streams, pre)
    liger_mhc_post_res(streams, y, post, comb) == naive.mhc_post_res(streams, y, post, comb)

forward and backward, within bf16 rounding (tests/ops/test_mhc_gpu.py). The mapping onto liger 0.8.5's
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
- `chunk` (memory.mhc_chunk, on by default): the pre and post-res ops run liger's kernels over that many
  tokens at a time instead of through liger's autograd Functions, whose whole-sequence fp32 copies would
  be the 256k step's peak (below, before `_spans`).
- Every launch takes at most `launch_rows(n * D)` tokens: liger's kernels address a token's row as
  row x row-stride in int32, so past 2^31 elements they read and write outside their tensors (h200-ref's
  streams hold 6,144 elements a token: 349,525 tokens). Longer inputs go through in pieces, the same ops
  on each (`tests/ops/test_mhc_liger.py` on the CPU; `tests/ops/test_int32_gpu.py` at 524,288 tokens).
- `liger_mhc_enter`: the coefficients and the collapse as one Function (`_Enter`) whose backward also
  takes the expand's gradient of the streams (a `Link` from `liger_mhc_post_res`) and writes the streams'
  gradient once (docs/design/mhc.md, "The entering connection's backward").
- The coefficients' projection runs our kernels (`triton.py`; liger's take 0.28 s of a 128k step, ~6x
  their byte floor) with liger's Sinkhorn kernels around them (`_Coefficients`) for up to 8 streams, where
  our tiles fit the SM's shared memory; wider streams run liger's whole coefficient Function
  (`projection`). H200, 128k tokens (`python bench/mhc.py --project`, bench/results/mhc.json): forward
  2.99 -> 1.35 ms, backward 5.84 -> 2.68 ms a call; the 128k step 3.50 -> 3.36 s.
"""

from __future__ import annotations

import functools

import torch

from ...errors import ConfigError
from .. import int32_rows, warn_tf32
from .. import triton_interpreting as interpreting
from ..loss.liger import LIGER_MIN_VERSION, liger_import_error

__all__ = ["Link", "check_mhc_args", "fused_enter", "liger_mhc_available", "liger_mhc_coefficients", "liger_mhc_enter",
           "liger_mhc_post_res", "liger_mhc_pre"]

MAX_STREAMS = 16
DEFAULT_CHUNK = 16384  # memory.mhc_chunk's default: one chunk's fp32 buffer is 384 MiB at h200-ref's 4 x 1536


def launch_rows(row_elements: int) -> int:
    """The most tokens (rows of `row_elements`) one liger mHC launch may take: its int32 offsets stay in range."""
    return int32_rows(row_elements)


def _in_pieces(op, rows: int, *tensors):
    """op over the tensors' leading (token) dimension in pieces of at most `rows`: one call when they fit.
    `op` returns a tensor or a tuple of tensors, each concatenated back along that dimension (split's
    backward assembles the inputs' gradients in one buffer)."""
    N = tensors[0].shape[0]
    if N <= rows:
        return op(*tensors)
    outs = [op(*piece) for piece in zip(*(t.split(rows) for t in tensors))]
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs)
    return tuple(torch.cat(parts) for parts in zip(*outs))


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
        raise ConfigError(f"kernels.mhc 'liger' takes model.hc_streams a power of two <= {MAX_STREAMS} (streams "
                          f"{tuple(streams.shape)} have n = {n}); set kernels.mhc to 'torch' or change hc_streams.")
    if iters < 1:
        raise ConfigError(f"kernels.mhc 'liger' needs model.hc_sinkhorn_iters >= 1 (got {iters}); raise it or set "
                          "kernels.mhc to 'torch'.")
    M = (2 + n) * n
    if fn.shape != (M, n * D):
        raise ValueError(f"liger mHC: fn {tuple(fn.shape)} must be [(2+n)n, nD] = [{M}, {n * D}] for streams "
                         f"{tuple(streams.shape)}.")
    if base.shape != (M,) or scale.shape != (3,):
        raise ValueError(f"liger mHC: base {tuple(base.shape)} must be [{M}] and scale {tuple(scale.shape)} [3].")
    if streams.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"liger mHC: streams must be bf16, fp16 or fp32, got {streams.dtype}.")
    if not ((streams.is_cuda or interpreting()) and fn.device == streams.device == base.device == scale.device):
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
    lead, (n, D) = streams.shape[:-2], streams.shape[-2:]

    ours = projection(n) == "triton"
    if not ours:
        warn_tf32(f"mHC: liger-kernel's coefficient projection (liger_mhc_coeffs, which runs for hc_streams > "
                  f"{PROJECT_MAX_STREAMS})",
                  "its Triton dot keeps tl.dot's default precision; set kernels.mhc = 'torch' for fp32 products",
                  streams)

    def coeffs(x):
        if ours:
            return _Coefficients.apply(x, fn, base, scale, int(iters), float(hc_eps), float(norm_eps))
        s_pre, s_post, s_comb = scale.unbind(0)
        return liger_mhc_coeffs(x, fn.t(), base, s_pre, s_post, s_comb, allow_fp32=True, tmax=int(iters),
                                rms_eps=float(norm_eps), pre_eps=float(hc_eps), sinkhorn_eps=float(hc_eps), post_mult=2.0)

    pre, post, comb = _in_pieces(coeffs, launch_rows(n * D), streams.reshape(-1, n, D))
    return pre.view(*lead, n), post.view(*lead, n), comb.view(*lead, n, n)


def fused_enter(streams: torch.Tensor, chunk: int) -> bool:
    """Whether `liger_mhc_enter` runs the coefficients and the collapse as one Function (`_Enter`): with our
    projection (n <= PROJECT_MAX_STREAMS), the stream ops in chunks (memory.mhc_chunk > 0), and at most
    `launch_rows` tokens, since liger's Sinkhorn kernels inside `_Enter` take the whole call, as every liger
    launch here takes at most that many (longer calls go in pieces, unfused)."""
    n, D = streams.shape[-2:]
    return chunk > 0 and projection(n) == "triton" and streams.numel() // (n * D) <= launch_rows(n * D)


def liger_mhc_enter(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                    iters: int, hc_eps: float, norm_eps: float, chunk: int):
    """(x_in [..., D], (post [..., n], comb [..., n, n], link)): the collapse of the streams and the exit's
    coefficients, as `liger_mhc_pre(streams, pre)` after `liger_mhc_coefficients`. Where `fused_enter`, one
    Function (`_Enter`) whose backward sums the gradients of
    the streams in one kernel, the exit's among them when `liger_mhc_post_res` is handed the link; else
    those two functions and no link (None)."""
    n, D = streams.shape[-2:]
    if not fused_enter(streams, chunk):
        pre, post, comb = liger_mhc_coefficients(streams, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)
        return liger_mhc_pre(streams, pre, chunk=chunk), (post, comb, None)
    _require()
    check_mhc_args(streams, fn, base, scale, iters)
    lead = streams.shape[:-2]
    link = Link()
    x_in, post, comb = _Enter.apply(streams.reshape(-1, n, D), fn, base, scale, int(iters), float(hc_eps),
                                    float(norm_eps), min(chunk, launch_rows(n * D)), link)
    return x_in.view(*lead, D), (post.view(*lead, n), comb.view(*lead, n, n), link)


def liger_mhc_pre(streams: torch.Tensor, pre: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """sum_j pre[j] * streams[j], accumulated in fp32, in the streams' dtype: [..., D].
    `chunk` > 0: liger's kernels over `chunk` tokens at a time (`_ChunkedPre`), else liger's own Function."""
    _require()
    lead, (n, D) = streams.shape[:-2], streams.shape[-2:]
    x, h = streams.reshape(-1, n, D), pre.reshape(-1, n)
    if chunk > 0:
        return _ChunkedPre.apply(x, h.float(), min(chunk, launch_rows(n * D))).view(*lead, D)
    from liger_kernel.transformers.functional import liger_mhc_pre as _pre

    return _in_pieces(_pre, launch_rows(n * D), x, h).view(*lead, D)


def liger_mhc_post_res(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                       chunk: int = 0, link: Link | None = None) -> torch.Tensor:
    """out[i] = post[i] * y + sum_j comb[j, i] * streams[j], in the streams' dtype: [..., n, D].
    `chunk` > 0: liger's kernels over `chunk` tokens at a time (`_ChunkedPostRes`), else liger's own Function.
    `link` (from `liger_mhc_enter` on these same streams, with `chunk` > 0): the streams' gradient goes to
    the enter's backward rather than to autograd."""
    _require()
    if y.shape != streams.shape[:-2] + streams.shape[-1:]:
        raise ValueError(f"liger mHC: the sub-layer output {tuple(y.shape)} must be streams {tuple(streams.shape)} "
                         "without the stream dimension.")
    y = y.to(streams.dtype)
    n, D = streams.shape[-2:]
    x, f = streams.reshape(-1, n, D), y.reshape(-1, D)
    h_post, h_res = post.reshape(-1, n), comb.transpose(-1, -2).reshape(-1, n, n)
    if chunk > 0:
        out = _ChunkedPostRes.apply(x, f, h_post.float(), h_res.float(), min(chunk, launch_rows(n * D)), link)
        return out.view(streams.shape)
    from liger_kernel.transformers.functional import liger_mhc_post_res as _post_res

    return _in_pieces(_post_res, launch_rows(n * D), x, f, h_post, h_res).view(streams.shape)


# liger 0.8.5's autograd Functions for the two stream ops make whole-sequence fp32 tensors: the forward
# writes an fp32 [N, n, D] (post-res) or [N, D] (pre) output and casts it; the backward copies the
# incoming bf16 gradient to fp32 and writes fp32 input gradients, then casts them. For post-res that is
# N x (n D x 10 + D x 6) bytes alive at the start of a block's backward, 17.25 GiB at 256k tokens for
# h200-ref, which is what a 256k step's peak exceeds its estimate by when they run (`python bench/memory.py
# --peak 262144:mhc_chunk_off` prints each phase's peak beside the estimate).
# The Functions below call the same kernels on `chunk` tokens at a time and let them store straight into
# the bf16 outputs and input gradients (a Triton store converts its fp32 value to the pointer's type,
# round-to-nearest-even as torch's cast; with an fp32 buffer and a copy kernel per chunk a 128k step's
# copies and casts take 368 ms, without them 243 ms: `python bench/memory.py --profile 131072
# --profile-stacks`), and hand the kernels the bf16 gradient directly (they load it and convert to fp32
# themselves, exactly). On the H200 the outputs and the pre op's input gradient are liger's Functions' bit
# for bit, the post-res op's input gradients within 1.2e-5 rel-RMS (a bf16 gradient where liger's Function
# passes an fp32 copy compiles another kernel: tests/mhc_chunk_check.py). Under the Triton interpreter they agree to one bf16 step:
# the interpreter's fp32 -> bf16 store truncates where the GPU rounds to nearest. The atomically
# accumulated coefficient gradients may differ in summation order, as between two runs of liger's own.
# What stays: the bf16 outputs and gradients and the fp32 coefficient gradients ([N, n] and [N, n, n]).
# `chunk` only bounds a launch (the kernels' fp32 temporaries live in registers).


# Our projection's tiles hold the [*, (2 + n) n] product in registers and fn^T's [64, (2 + n) n] fp32 slice in
# shared memory per stage: at n = 8 (M = 80, padded to 128) the sm_90 build fits (bwd 160 KiB shared, no
# spills); at n = 16 (M = 288 -> 512) it needs 392 / 640 KiB of shared memory and cannot launch
# (`python dev/compile_sm90.py`). Wider streams run liger's projection.
PROJECT_MAX_STREAMS = 8


def projection(n: int) -> str:
    """Which projection the coefficients of n streams run: "triton" (ours, `_Coefficients`) up to
    PROJECT_MAX_STREAMS, "liger" (liger's coefficient Function) beyond; the step's implementation record
    says mhc:liger+triton-proj or mhc:liger."""
    return "triton" if n <= PROJECT_MAX_STREAMS else "liger"


def _coefficients_fwd(x, fn, base, scale, iters, hc_eps, norm_eps, want_grad: bool):
    """Our projection, then liger's split and Sinkhorn: x [N, n, D] -> ((pre, post, comb) fp32 in liger's
    layout, what their backward keeps)."""
    from liger_kernel.ops.mhc import mhc_split_sinkhorn_fwd

    from .triton import project_fwd

    N, n, D = x.shape
    x2 = x.reshape(N, n * D).contiguous()
    phi = fn.detach().float().t().contiguous()
    mix, invr = project_fwd(x2, phi, norm_eps)
    b, sc = base.detach().float().contiguous(), scale.detach().float()
    got = mhc_split_sinkhorn_fwd(mix, b, sc[0], sc[1], sc[2], tmax=iters, pre_eps=hc_eps, sinkhorn_eps=hc_eps,
                                 post_mult=2.0, return_hist=want_grad)
    return got[:3], (x2, phi, mix, invr, b, sc, *got[3:])


def _logit_grads(saved, n: int, iters: int, eps: float, g_pre, g_post, g_comb):
    """From the coefficients' gradients: (the projection's output gradient [N, M], grad base, grad scale).
    The logits are scale_i * mix + base; pre = sigmoid + eps, post = 2 sigmoid, comb = Sinkhorn."""
    from liger_kernel.ops.mhc import mhc_sinkhorn_bwd

    x2, phi, mix, invr, b, sc, *hist = saved
    N = x2.shape[0]
    dev = mix.device
    g_pre = torch.zeros(N, n, device=dev) if g_pre is None else g_pre.float()
    g_post = torch.zeros(N, n, device=dev) if g_post is None else g_post.float()
    g_comb = torch.zeros(N, n, n, device=dev) if g_comb is None else g_comb.float().contiguous()
    z_res = mhc_sinkhorn_bwd(mix, b, sc[2], g_comb, tmax=iters, sinkhorn_eps=eps,
                             hist=hist[0] if hist else None).reshape(N, n * n)
    s_pre = torch.sigmoid(mix[:, :n] * sc[0] + b[:n])
    s_post = torch.sigmoid(mix[:, n:2 * n] * sc[1] + b[n:2 * n])
    z = torch.cat([g_pre * s_pre * (1 - s_pre), g_post * 2 * s_post * (1 - s_post), z_res], 1)  # d logits [N, M]
    per_col = torch.cat([sc[0].expand(n), sc[1].expand(n), sc[2].expand(n * n)])
    grad_scale = torch.stack([(z[:, :n] * mix[:, :n]).sum(), (z[:, n:2 * n] * mix[:, n:2 * n]).sum(),
                              (z[:, 2 * n:] * mix[:, 2 * n:]).sum()])
    return (z * per_col).contiguous(), z.sum(0), grad_scale


class _Coefficients(torch.autograd.Function):
    """liger's coefficient Function with the projection mix = RMSNorm(x) @ fn^T done by ours: x [N, n, D]
    -> (pre [N, n], post [N, n], comb [N, n, n]) fp32, liger's layout (comb[o, i]). The Sinkhorn runs in
    liger's kernels, forward (keeping its history when a gradient is wanted) and backward; the sigmoid
    gates' derivatives and the sums for base and scale are torch on [N, M]."""

    @staticmethod
    def forward(ctx, x, fn, base, scale, iters, hc_eps, norm_eps):
        coeffs, saved = _coefficients_fwd(x, fn, base, scale, iters, hc_eps, norm_eps, any(ctx.needs_input_grad))
        ctx.save_for_backward(*saved)
        ctx.meta = (*x.shape[1:], iters, hc_eps)
        return coeffs

    @staticmethod
    def backward(ctx, g_pre, g_post, g_comb):
        from .triton import project_bwd

        saved = ctx.saved_tensors
        n, D, iters, eps = ctx.meta
        gz, g_base, g_scale = _logit_grads(saved, n, iters, eps, g_pre, g_post, g_comb)
        x2, phi, mix, invr = saved[:4]
        gx, gphi = project_bwd(x2, phi, mix, invr, gz)
        return gx.view(-1, n, D), gphi.t(), g_base, g_scale, None, None, None


class Link:
    """Hands the expand's gradient of the streams to the entering connection's backward, which sums it
    into its own in one kernel (`_Enter`). The streams of a connection feed two autograd nodes, the enter
    (coefficients and collapse) and the exit (the expand, `_ChunkedPostRes`); as two gradients autograd
    adds them, a read of two and a write of one [N, n D] tensor. The exit's backward always runs first
    (the enter's outputs post and comb are the exit's inputs), so it leaves its gradient here and returns
    none for the streams; the enter adds it and clears it."""

    __slots__ = ("grad",)

    def __init__(self):
        self.grad: torch.Tensor | None = None


class _Enter(torch.autograd.Function):
    """The entering half of a connection: coefficients (`_coefficients_fwd`) and the collapse x_in = sum_i
    pre_i x_i (liger's kernel over `chunk` tokens at a time), x [N, n, D] -> (x_in [N, D], post [N, n],
    comb [N, n, n] liger's layout). Backward reads x twice where the separate Functions read it three times
    and autograd adds their gradients twice: the collapse's coefficient gradient (`triton.pre_grad`), then
    the projection's backward with the collapse's and the expand's (`Link`) gradients of x summed in
    (`triton.project_bwd`). At 128k tokens of h200-ref, [N, n D] bf16 is 1.6 GB: from 10.25 such passes
    over memory a connection to 4.5 (counted)."""

    @staticmethod
    def forward(ctx, x, fn, base, scale, iters, hc_eps, norm_eps, chunk, link):
        from liger_kernel.ops.mhc import mhc_pre_fwd

        (pre, post, comb), saved = _coefficients_fwd(x, fn, base, scale, iters, hc_eps, norm_eps,
                                                     any(ctx.needs_input_grad))
        x2, N, (n, D) = saved[0], x.shape[0], x.shape[1:]
        pre = pre.contiguous()
        x_in = torch.empty((N, D), device=x.device, dtype=x.dtype)
        xv = x2.view(N, n, D)
        for a, b in _spans(N, chunk):
            mhc_pre_fwd(xv[a:b], pre[a:b], out=x_in[a:b])
        ctx.save_for_backward(pre, *saved)
        ctx.meta, ctx.link = (n, D, iters, hc_eps), link
        return x_in, post, comb

    @staticmethod
    def backward(ctx, g_in, g_post, g_comb):
        from .triton import pre_grad, project_bwd

        pre, *saved = ctx.saved_tensors
        n, D, iters, eps = ctx.meta
        x2, phi, mix, invr = saved[:4]
        g_pre = pre_grad(x2, g_in, n) if g_in is not None else None
        gz, g_base, g_scale = _logit_grads(saved, n, iters, eps, g_pre, g_post, g_comb)
        link, expand = ctx.link, None
        if link is not None:
            expand, link.grad = link.grad, None
        gx, gphi = project_bwd(x2, phi, mix, invr, gz, pre=None if g_in is None else (pre, g_in),
                               grad_in=None if expand is None else expand.view(x2.shape))
        return gx.view(-1, n, D), gphi.t(), g_base, g_scale, None, None, None, None, None


def _spans(N: int, chunk: int):
    return ((a, min(a + chunk, N)) for a in range(0, N, chunk))


class _ChunkedPre(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h_pre, chunk):  # x [N, n, D], h_pre [N, n] fp32 -> [N, D] in x's dtype
        from liger_kernel.ops.mhc import mhc_pre_fwd

        x, h_pre = x.contiguous(), h_pre.contiguous()
        N, n, D = x.shape
        out = torch.empty((N, D), device=x.device, dtype=x.dtype)
        for a, b in _spans(N, chunk):
            mhc_pre_fwd(x[a:b], h_pre[a:b], out=out[a:b])
        ctx.save_for_backward(x, h_pre)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from liger_kernel.ops.mhc import mhc_pre_bwd

        x, h_pre = ctx.saved_tensors
        N, n, D = x.shape
        go = grad_out.contiguous()
        gx = torch.empty_like(x)
        gh = torch.zeros((N, n), device=x.device, dtype=torch.float32)
        for a, b in _spans(N, ctx.chunk):
            mhc_pre_bwd(x[a:b], h_pre[a:b], go[a:b], out_grad_x=gx[a:b], out_grad_h=gh[a:b])
        return gx, gh, None


class _ChunkedPostRes(torch.autograd.Function):
    """`link` (a `Link`, or None): the streams' gradient goes there, for the entering connection's backward
    to sum in, instead of back to autograd."""

    @staticmethod
    def forward(ctx, x, f, h_post, h_res, chunk, link=None):  # x [N, n, D], f [N, D], h_post [N, n], h_res [N, n, n] (liger's layout)
        from liger_kernel.ops.mhc import mhc_post_res_fwd

        x, f, h_post, h_res = x.contiguous(), f.contiguous(), h_post.contiguous(), h_res.contiguous()
        N, n, D = x.shape
        out = torch.empty_like(x)
        for a, b in _spans(N, chunk):
            mhc_post_res_fwd(x[a:b], f[a:b], h_post[a:b], h_res[a:b], out=out[a:b])
        ctx.save_for_backward(x, f, h_post, h_res)
        ctx.chunk, ctx.link = chunk, link
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from liger_kernel.ops.mhc import mhc_post_res_bwd

        x, f, h_post, h_res = ctx.saved_tensors
        N, n, D = x.shape
        go = grad_out.contiguous()
        gx, gf = torch.empty_like(x), torch.empty_like(f)
        g_post = torch.zeros((N, n), device=x.device, dtype=torch.float32)
        g_res = torch.zeros((N, n, n), device=x.device, dtype=torch.float32)
        for a, b in _spans(N, ctx.chunk):
            mhc_post_res_bwd(x[a:b], f[a:b], h_post[a:b], h_res[a:b], go[a:b], out_grad_x=gx[a:b],
                             out_grad_f=gf[a:b], out_grad_hpost=g_post[a:b], out_grad_hres=g_res[a:b])
        if ctx.link is not None and ctx.needs_input_grad[0]:
            ctx.link.grad, gx = gx, None
        return gx, gf, g_post, g_res, None, None
