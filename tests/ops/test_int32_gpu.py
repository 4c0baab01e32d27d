"""Past 2^31 elements on the GPU: each kernel a whole-sequence step of h200-ref runs, on a tensor just past
2^31 elements (what a 524,288-token step holds), with its last rows checked against the same op on those
rows alone (a small call, far from any limit). Why: a kernel that addresses elements with int32 offsets
reads and writes out of bounds past 2^31 elements, which shows only as an illegal memory access somewhere
in a 512k whole-sequence step; this names the kernel that fails. A failing kernel can leave the
CUDA context unusable, so the tests run in pipeline order (torch's matmuls, then ours, then liger's and
fla's) and the first failure is the one to read. Each needs ~10-20 GB of GPU memory. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LIMIT = 2**31
TAIL = 64  # rows compared at the end (and at the start) of each tensor


def _rows_past(width: int) -> int:
    """Rows of `width` elements just past 2^31 elements in all."""
    return LIMIT // width + 1


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _ends(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t[:TAIL], t[-TAIL:]])


def _randn(*shape, seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g, dtype=torch.float32).to(dtype)


def test_matmul_output_past_int32():
    """cuBLAS, the dense MLP's up projection: [R, 1536] x [1536, 8192] -> R x 8192 > 2^31 elements."""
    R = _rows_past(8192)
    x, w = _randn(R, 1536, seed=1), _randn(8192, 1536, seed=2) * 0.02
    y = torch.nn.functional.linear(x, w)
    torch.cuda.synchronize()
    assert _rel(_ends(y), torch.nn.functional.linear(_ends(x), w)) <= 1e-2


def test_dsa_absorption_einsum_past_int32():
    """The DSA layer's query absorption (layers/dsa.py): [1, S, 16, 128] x [16, 128, 512] -> [1, S, 16, 512]
    past 2^31 elements, as torch runs it (a batched matmul over heads)."""
    H, N, L = 16, 128, 512
    S = _rows_past(H * L)
    q, w = _randn(1, S, H, N, seed=17), _randn(H, N, L, seed=18) * 0.05
    out = torch.einsum("bthn,hnl->bthl", q, w)
    torch.cuda.synchronize()
    ref = torch.einsum("bthn,hnl->bthl", q[:, -TAIL:].contiguous(), w)
    assert _rel(out[:, -TAIL:], ref) <= 1e-2


def test_fused_swiglu_past_int32():
    """Our packed SwiGLU on the dense MLP's [gate | up], forward and backward."""
    from longctx.ops.swiglu.naive import ClampedSwiGLUPacked
    from longctx.ops.swiglu.triton import clamped_swiglu_packed_triton

    R = _rows_past(8192)
    h = (_randn(R, 8192, seed=3) * 4).requires_grad_(True)
    dy = _randn(R, 4096, seed=4)
    y = clamped_swiglu_packed_triton(h, 7.0)
    (dh,) = torch.autograd.grad(y, h, dy)
    torch.cuda.synchronize()
    hs = _ends(h.detach()).requires_grad_(True)
    ys = ClampedSwiGLUPacked.apply(hs, 7.0)
    (dhs,) = torch.autograd.grad(ys, hs, _ends(dy))
    assert _rel(_ends(y), ys) <= 1e-3 and _rel(_ends(dh), dhs) <= 1e-3


def test_fused_rms_norm_past_int32():
    """Our RMSNorm on rows of 1536, forward and backward (the input gradient's last rows)."""
    from longctx.ops.rms_norm.naive import RMSNormFn
    from longctx.ops.rms_norm.triton import rms_norm_triton

    R = _rows_past(1536)
    x = _randn(R, 1536, seed=5).requires_grad_(True)
    w = (1 + 0.1 * _randn(1536, seed=6, dtype=torch.float32)).requires_grad_(True)
    dy = _randn(R, 1536, seed=7)
    y = rms_norm_triton(x, w, 1e-5)
    dx, _ = torch.autograd.grad(y, (x, w), dy)
    torch.cuda.synchronize()
    xs = _ends(x.detach()).requires_grad_(True)
    ys = RMSNormFn.apply(xs, w.detach(), 1e-5)
    (dxs,) = torch.autograd.grad(ys, xs, _ends(dy))
    assert _rel(_ends(y), ys) <= 1e-3 and _rel(_ends(dx), dxs) <= 1e-3


@pytest.mark.parametrize("case", ["token_major_past_2^31", "head_major_512k_regular", "head_major_512k_kept"])
def test_sparse_attention_past_int32(case):
    """Our DSA kernel with queries [S, 16, 512] past 2^31 elements. Token-major (contiguous) just past it; and
    head-major at S = 524,288 (2^32 elements), the layout torch's einsum hands the DSA layer (head stride S x
    512, so (H - 1) x head stride passes 2^31 from 279,621 tokens, which the kernels' int64 head offsets
    cover), through the regular Function and the kept-output path the
    block recompute runs (`reuse_attention`): the last queries' output and dq against the kernel on those
    queries alone (same kv and indices, contiguous)."""
    from longctx.ops.sparse_attention.naive import causal_pool_indices

    from longctx.ops.sparse_attention.triton import (
        kept_sparse_attention_triton,
        sparse_attention_fwd,
        sparse_attention_triton,
    )

    H, D, K = 16, 512, 2051
    head_major = case.startswith("head_major")
    S = 2**32 // (H * D) if head_major else _rows_past(H * D)

    def layout(x):  # [1, S, H, D] in the case's layout
        return x.transpose(1, 2).contiguous().transpose(1, 2) if head_major else x

    g = torch.Generator(device="cuda").manual_seed(8)
    q = layout(_randn(1, S, H, D, seed=9)).requires_grad_(True)
    kv = _randn(1, S, D, seed=10).requires_grad_(True)
    idx = causal_pool_indices(S, K, generator=g)[None]
    do = layout(_randn(1, S, H, D, seed=11))
    assert not head_major or q.stride(2) == S * D
    scale = D**-0.5
    if case.endswith("kept"):
        with torch.no_grad():
            o_kept, lse = sparse_attention_fwd(q, kv, idx, scale)
        o = kept_sparse_attention_triton(q, kv, idx, o_kept, lse, scale)
    else:
        o = sparse_attention_triton(q, kv, idx, scale)
    dq, dkv = torch.autograd.grad(o, (q, kv), do)
    torch.cuda.synchronize()
    assert torch.isfinite(dkv).all()
    qs = q.detach()[:, -TAIL:].contiguous().requires_grad_(True)
    os_ = sparse_attention_triton(qs, kv.detach(), idx[:, -TAIL:].contiguous(), scale)
    (dqs,) = torch.autograd.grad(os_, qs, do[:, -TAIL:].contiguous())
    # each query's output and dq are its own (no atomics): equal but for a launch config chosen by shape
    assert _rel(o[:, -TAIL:], os_) <= 5e-3 and _rel(dq[:, -TAIL:], dqs) <= 5e-3


def test_liger_mhc_past_int32():
    """liger's mHC through longctx.ops.mhc.liger (the coefficients in launch_rows pieces, the stream ops
    in chunks) on streams [N, 4, 1536] past 2^31 elements: the last tokens against the ops on those tokens."""
    from longctx.config import preset
    from longctx.layers.residual import MHC
    from longctx.ops.mhc import liger as mhc_liger

    mhc = MHC(preset("h200-ref")).cuda()
    N = _rows_past(4 * 1536)
    streams = _randn(N, 4, 1536, seed=12)
    y = _randn(N, 1536, seed=13)
    kw = dict(iters=mhc.iters, hc_eps=mhc.hc_eps, norm_eps=mhc.norm_eps)
    with torch.no_grad():
        pre, post, comb = mhc_liger.liger_mhc_coefficients(streams, mhc.fn, mhc.base, mhc.scale, **kw)
        h = mhc_liger.liger_mhc_pre(streams, pre, chunk=16384)
        out = mhc_liger.liger_mhc_post_res(streams, y, post, comb, chunk=16384)
        torch.cuda.synchronize()
        tail = slice(N - TAIL, N)
        ref = mhc_liger.liger_mhc_coefficients(streams[tail], mhc.fn, mhc.base, mhc.scale, **kw)
        for a, b in zip((pre, post, comb), ref):
            assert _rel(a[tail], b) <= 1e-5
        assert _rel(h[tail], mhc_liger.liger_mhc_pre(streams[tail], pre[tail], chunk=16384)) <= 1e-3
        assert _rel(out[tail], mhc_liger.liger_mhc_post_res(streams[tail], y[tail], post[tail], comb[tail],
                                                           chunk=16384)) <= 1e-3


def test_fla_conv_past_int32():
    """fla's causal conv on KDA's [q | k | v] ([1, T, 4608] past 2^31 elements), forward and backward:
    the last tokens against the conv of those tokens with the W - 1 before them as its window."""
    from longctx.ops.kda import fla_causal_conv1d

    C, W = 4608, 4
    T = _rows_past(C)
    x = _randn(1, T, C, seed=14).requires_grad_(True)
    w = (0.5 * _randn(C, W, seed=15)).requires_grad_(True)
    dy = _randn(1, T, C, seed=16)
    y = fla_causal_conv1d(x, w)
    dx, _ = torch.autograd.grad(y, (x, w), dy)
    torch.cuda.synchronize()
    xs = x.detach()[:, -(TAIL + W - 1):]
    ys = fla_causal_conv1d(xs.contiguous(), w.detach())[:, W - 1:]
    assert _rel(y[:, -TAIL:], ys) <= 1e-3
    # the gradient of the last tokens' inputs, through every output that reads them: a window of outputs
    xs = x.detach()[:, -(TAIL + 2 * (W - 1)):].contiguous().requires_grad_(True)
    (dxs,) = torch.autograd.grad(fla_causal_conv1d(xs, w.detach()), xs, dy[:, -(TAIL + 2 * (W - 1)):].contiguous())
    assert _rel(dx[:, -TAIL:], dxs[:, -TAIL:]) <= 1e-3
