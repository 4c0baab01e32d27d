"""liger's mHC kernels address rows with int32 offsets (past 2^31 elements, 349,525 tokens of h200-ref,
they read and write outside their tensors). `longctx.ops.mhc.liger` hands every launch at most `launch_rows` tokens; here with
liger replaced by plain-torch stand-ins that record how many tokens each call got (no liger, no GPU), and
the limit lowered so that a few tokens already need several pieces: the same outputs and gradients as
one call, and no call over the limit, for the coefficients and both stream ops, chunked and not."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from longctx import ops
from longctx.ops.mhc import liger as mhc_liger

n, D = 4, 8


def _fake_liger(monkeypatch) -> list:
    """Stand-ins for the liger functions mhc_liger calls; returns the list of (op, tokens) per call."""
    calls = []

    def coeffs(x, phi, b, a_pre, a_post, a_res, **kw):
        calls.append(("coeffs", x.shape[0]))
        N = x.shape[0]
        mix = x.float().reshape(N, n * D) @ phi
        pre = torch.sigmoid(mix[:, :n] * a_pre + b[:n])
        post = 2 * torch.sigmoid(mix[:, n:2 * n] * a_post + b[n:2 * n])
        comb = torch.softmax((mix[:, 2 * n:] * a_res + b[2 * n:]).view(N, n, n), -1)
        return pre, post, comb

    def pre_fn(x, h):
        calls.append(("pre", x.shape[0]))
        return (h[..., None] * x.float()).sum(-2).to(x.dtype)

    def post_fn(x, f, hp, hr):
        calls.append(("post_res", x.shape[0]))
        return (hp[..., None] * f[:, None, :].float() + hr @ x.float()).to(x.dtype)

    def pre_fwd(x, h, out):
        out.copy_(pre_fn(x, h))

    def pre_bwd(x, h, go, out_grad_x, out_grad_h):
        calls.append(("pre_bwd", x.shape[0]))
        out_grad_x.copy_(h[..., None] * go[:, None, :].float())
        out_grad_h.copy_((x.float() * go[:, None, :].float()).sum(-1))

    def post_fwd(x, f, hp, hr, out):
        out.copy_(post_fn(x, f, hp, hr))

    def post_bwd(x, f, hp, hr, go, out_grad_x, out_grad_f, out_grad_hpost, out_grad_hres):
        calls.append(("post_res_bwd", x.shape[0]))
        g = go.float()
        out_grad_x.copy_(hr.transpose(-1, -2) @ g)
        out_grad_f.copy_((hp[..., None] * g).sum(-2))
        out_grad_hpost.copy_((g * f[:, None, :].float()).sum(-1))
        out_grad_hres.copy_(g @ x.float().transpose(-1, -2))

    functional = types.SimpleNamespace(liger_mhc_coeffs=coeffs, liger_mhc_pre=pre_fn, liger_mhc_post_res=post_fn)
    ops = types.SimpleNamespace(mhc_pre_fwd=pre_fwd, mhc_pre_bwd=pre_bwd, mhc_post_res_fwd=post_fwd,
                                mhc_post_res_bwd=post_bwd)
    for name, mod in (("liger_kernel", types.ModuleType("liger_kernel")),
                      ("liger_kernel.transformers", types.ModuleType("liger_kernel.transformers")),
                      ("liger_kernel.transformers.functional", functional),
                      ("liger_kernel.ops", types.ModuleType("liger_kernel.ops")), ("liger_kernel.ops.mhc", ops)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(mhc_liger, "_import_error", lambda: None)
    monkeypatch.setattr(mhc_liger, "check_mhc_args", lambda *a: None)  # it wants CUDA tensors
    # the coefficients through liger's whole Function (the stand-in above), as for streams wider than our
    # projection takes, not our projection, whose Triton kernels these CPU tensors cannot run
    monkeypatch.setattr(mhc_liger, "PROJECT_MAX_STREAMS", 0)
    return calls


def _step(chunk: int, seed: int = 0):
    """Coefficients, pre and post-res over streams [2, 9, n, D] (bf16), and every gradient."""
    g = torch.Generator().manual_seed(seed)
    M = (2 + n) * n
    streams = torch.randn(2, 9, n, D, generator=g).bfloat16().requires_grad_(True)
    y = torch.randn(2, 9, D, generator=g).bfloat16().requires_grad_(True)
    fn = (0.1 * torch.randn(M, n * D, generator=g)).requires_grad_(True)
    base = torch.randn(M, generator=g).requires_grad_(True)
    scale = torch.rand(3, generator=g).requires_grad_(True)
    pre, post, comb = mhc_liger.liger_mhc_coefficients(streams, fn, base, scale, iters=3, hc_eps=1e-6, norm_eps=1e-6)
    h = mhc_liger.liger_mhc_pre(streams, pre, chunk=chunk)
    o = mhc_liger.liger_mhc_post_res(streams, y, post, comb, chunk=chunk)
    assert (pre.shape, comb.shape, h.shape, o.shape) == ((2, 9, n), (2, 9, n, n), (2, 9, D), (2, 9, n, D))
    (h.float().square().sum() + o.float().sin().sum()).backward()
    return [t.detach() for t in (pre, post, comb, h, o)] + [t.grad for t in (streams, y, fn, base, scale)]


@pytest.mark.parametrize("chunk", [0, 7])
def test_launches_stay_under_the_int32_limit_and_compute_the_same(monkeypatch, chunk):
    calls = _fake_liger(monkeypatch)
    whole = _step(chunk)
    assert max(t for _, t in calls) == 18  # the coefficients: one call over all 18 tokens
    calls.clear()
    monkeypatch.setattr(ops, "INT32_ELEMENTS", 4 * n * D)  # 4 tokens a launch
    assert mhc_liger.launch_rows(n * D) == 4
    pieces = _step(chunk)
    assert calls and max(t for _, t in calls) == 4, calls
    assert sum(t for op, t in calls if op == "coeffs") == 18 and len([op for op, _ in calls if op == "coeffs"]) == 5
    for a, b in zip(pieces, whole):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_launch_rows_for_h200_ref():
    """h200-ref's streams: 4 x 1536 = 6,144 elements a token: 349,525 tokens a launch (the 512k step needs two)."""
    assert mhc_liger.launch_rows(4 * 1536) == 349_525
    assert mhc_liger.launch_rows(4 * 1536) * 4 * 1536 <= 2**31 - 1 < (mhc_liger.launch_rows(4 * 1536) + 1) * 4 * 1536


def test_enter_fuses_within_one_launch_and_with_chunked_stream_ops(monkeypatch):
    """The coefficients and the collapse run as one Function (`liger._Enter`) only where every launch takes the
    whole call and the stream ops go in chunks; otherwise the separate Functions (in pieces) run."""
    streams = torch.zeros(2, 9, n, D)
    assert mhc_liger._fused_here(streams, 16)
    assert not mhc_liger._fused_here(streams, 0)  # memory.mhc_chunk = 0: liger's own Functions
    monkeypatch.setattr(ops, "INT32_ELEMENTS", 4 * n * D)  # 4 tokens a launch
    assert not mhc_liger._fused_here(streams, 16) and mhc_liger._fused_here(streams[:, :2], 16)
    monkeypatch.setattr(mhc_liger, "PROJECT_MAX_STREAMS", 0)  # liger's projection: nothing to fuse into
    assert not mhc_liger._fused_here(streams[:, :2], 16)
