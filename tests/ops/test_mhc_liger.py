"""liger's mHC kernels address rows with int32 offsets (past 2^31 elements, 349,525 tokens of h200-ref,
they read and write outside their tensors). `longctx.ops.mhc.liger` hands every launch at most `launch_rows` tokens; here with
liger replaced by plain-torch stand-ins that record how many tokens each call got (no liger, no GPU), and
the limit lowered so that a few tokens already need several pieces: the same outputs and gradients as
one call, and no call over the limit, for the coefficients and both stream ops, chunked and not. With the
same stand-ins (and torch ones for our projection's kernels), the fused enter's Link wiring: the exit's
gradient of the streams reaches the enter's backward, and only for the streams the enter read."""

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
    assert mhc_liger.fused_enter(streams, 16)
    assert not mhc_liger.fused_enter(streams, 0)  # memory.mhc_chunk = 0: liger's own Functions
    monkeypatch.setattr(ops, "INT32_ELEMENTS", 4 * n * D)  # 4 tokens a launch
    assert not mhc_liger.fused_enter(streams, 16) and mhc_liger.fused_enter(streams[:, :2], 16)
    monkeypatch.setattr(mhc_liger, "PROJECT_MAX_STREAMS", 0)  # liger's projection: nothing to fuse into
    assert not mhc_liger.fused_enter(streams[:, :2], 16)


def _fake_enter_kernels(monkeypatch):
    """Stand-ins for what `liger._Enter` and `_Coefficients` call besides the stream ops: liger's split and
    Sinkhorn (a row softmax here, with its backward) and our projection kernels (torch, the collapse's and
    another gradient of x summed in as the kernel does)."""
    from longctx.ops.mhc import triton as tri

    lops = sys.modules["liger_kernel.ops.mhc"]  # the stand-in module `_fake_liger` installed

    def split(mix, b, a_pre, a_post, a_res, *, tmax, pre_eps, sinkhorn_eps, post_mult, return_hist):
        N = mix.shape[0]
        pre = torch.sigmoid(mix[:, :n] * a_pre + b[:n]) + pre_eps
        post = post_mult * torch.sigmoid(mix[:, n:2 * n] * a_post + b[n:2 * n])
        comb = torch.softmax((mix[:, 2 * n:] * a_res + b[2 * n:]).view(N, n, n), -1)
        return (pre, post, comb) + ((comb,) if return_hist else ())

    def sinkhorn_bwd(mix, b, a_res, g_comb, *, tmax, sinkhorn_eps, hist):
        c = hist
        return c * (g_comb - (g_comb * c).sum(-1, keepdim=True))

    def project_fwd(x2, phi, eps):
        xf = x2.float()
        invr = torch.rsqrt(xf.square().mean(-1) + eps)
        return (xf * invr[:, None]) @ phi, invr

    def project_bwd(x2, phi, mix, invr, gz, pre=None, grad_in=None):
        xf, K = x2.float(), x2.shape[1]
        g = gz.float()
        gx = (g * invr[:, None]) @ phi.t() - ((g * mix).sum(1) * invr * invr / K)[:, None] * xf
        if pre is not None:
            h, go = pre
            gx = gx + (h[:, :, None] * go.float()[:, None, :]).reshape(gx.shape)
        if grad_in is not None:
            gx = gx + grad_in.float()
        return gx.to(x2.dtype), (xf * invr[:, None]).t() @ g

    def pre_grad(x2, go, ns):
        return (x2.float().view(x2.shape[0], ns, -1) * go.float()[:, None, :]).sum(-1)

    monkeypatch.setattr(lops, "mhc_split_sinkhorn_fwd", split, raising=False)
    monkeypatch.setattr(lops, "mhc_sinkhorn_bwd", sinkhorn_bwd, raising=False)
    for name, f in (("project_fwd", project_fwd), ("project_bwd", project_bwd), ("pre_grad", pre_grad)):
        monkeypatch.setattr(tri, name, f)


@pytest.mark.parametrize("same_streams", [True, False])
def test_fused_enter_hands_the_expand_gradient_through_its_link(monkeypatch, same_streams):
    """The connection through `MHC` with the fused enter (`liger_mhc_enter`: the exit's gradient of the streams
    handed over by a Link and added in the enter's backward) against the separate Functions summed by
    autograd, fp64 streams through stand-in kernels (which, like liger's, compute in fp32): every output and
    gradient within fp32 rounding. An exit on other streams than the enter read gets no link and returns its
    gradient to autograd."""
    pytest.importorskip("triton")
    import dataclasses

    from longctx.config import preset
    from longctx.layers.residual import MHC

    _fake_liger(monkeypatch)
    _fake_enter_kernels(monkeypatch)
    monkeypatch.setattr(mhc_liger, "PROJECT_MAX_STREAMS", 8)  # our projection (stand-ins), so the enter fuses
    torch.manual_seed(0)
    mhc = MHC(dataclasses.replace(preset("tiny"), hc_streams=n, hidden_size=D)).double()
    with torch.no_grad():
        mhc.base.normal_(0.0, 0.5)
    mhc.liger_chunk = 5
    mhc.pick = lambda streams: "liger"
    g = torch.Generator().manual_seed(1)
    s0 = torch.randn(2, 9, n, D, generator=g, dtype=torch.float64)
    w = torch.randn(D, D, generator=g, dtype=torch.float64) * D**-0.5
    gout = torch.randn(2, 9, n, D, generator=g, dtype=torch.float64)
    runs = {}
    for fused in (True, False):
        monkeypatch.setattr(mhc_liger, "fused_enter", (lambda s_, c: c > 0) if fused else (lambda s_, c: False))
        mhc.zero_grad(set_to_none=True)
        s = s0.clone().requires_grad_(True)
        t = s0.clone().requires_grad_(True) if not same_streams else s
        x, ctx = mhc.enter(s)
        assert (ctx[3] is not None) == fused
        out = mhc.exit(t, ctx, torch.tanh(x @ w))
        (out * gout).sum().backward()
        runs[fused] = [x, out, s.grad, t.grad, mhc.fn.grad, mhc.base.grad, mhc.scale.grad]
    for a, b in zip(runs[True], runs[False]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
