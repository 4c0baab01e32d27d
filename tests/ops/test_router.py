"""The router's logits through split-weight bf16 matmuls (longctx/ops/router/bf16x3.py) against the fp32
twin and fp64: the split is exact, the logits and the weight's gradient are the fp32 product's to fp32
rounding, the tokens' gradient within its own bf16 rounding. On the CPU the bf16 matmuls with fp32 output
run as fp32 matmuls of the same bf16 values (the same exact products); tests/ops/test_router_gpu.py runs
cuBLAS's."""

from __future__ import annotations

import pytest
import torch

from longctx.errors import ConfigError
from longctx.ops.router import pick, router_logits
from longctx.ops.router.bf16x3 import split3


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def test_split3_is_exact_over_fp32s_range():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(4096, generator=g) * torch.logspace(-30, 30, 4096)  # magnitudes across fp32's normal range
    hi, mid, lo = split3(t)
    assert hi.dtype == mid.dtype == lo.dtype == torch.bfloat16
    assert torch.equal((lo.float() + mid.float()) + hi.float(), t)
    assert torch.equal(hi.float(), t.bfloat16().float())  # the leading piece is t's bf16 rounding
    assert (mid.float().abs() <= hi.float().abs() * 2**-8).all() and (lo.float().abs() <= mid.float().abs() * 2**-8).all()


def _case(t, hidden, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).bfloat16()
    w = torch.randn(E, hidden, generator=g) * 0.02
    dy = torch.randn(t, E, generator=g)
    return x, w, dy


def _run(x, w, dy, impl):
    from longctx.ops.router.bf16x3 import router_logits_bf16x3
    from longctx.ops.router.naive import router_logits_torch

    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = (router_logits_bf16x3 if impl == "bf16x3" else router_logits_torch)(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("t,hidden,E", [(300, 1536, 32), (64, 96, 8), (5, 4096, 288)])
def test_bf16x3_is_the_fp32_product(t, hidden, E):
    x, w, dy = _case(t, hidden, E)
    y, gx, gw = _run(x, w, dy, "bf16x3")
    y_t, gx_t, gw_t = _run(x, w, dy, "torch")
    ref_y = x.double() @ w.double().t()
    ref_gx, ref_gw = dy.double() @ w.double(), dy.double().t() @ x.double()
    assert y.dtype == gw.dtype == torch.float32 and gx.dtype == torch.bfloat16
    assert _rel(y, ref_y) < 1e-6 and _rel(y, y_t) < 1e-6, (_rel(y, ref_y), _rel(y_t, ref_y))
    assert _rel(gw, ref_gw) < 1e-6 and _rel(gw, gw_t) < 1e-6, (_rel(gw, ref_gw), _rel(gw_t, ref_gw))
    # dx ends in bf16: its error is that rounding, as the twin's is (the dropped split terms are ~2^-16)
    assert _rel(gx, ref_gx) < 4e-3 and abs(_rel(gx, ref_gx) - _rel(gx_t, ref_gx)) < 2e-4, (_rel(gx, ref_gx), _rel(gx_t, ref_gx))
    assert (gx.float() != gx_t.float()).float().mean() < 0.02  # equal but for a few ties in the rounding


@pytest.mark.parametrize("t", [300, 64, 5])
def test_the_weight_gradient_sums_token_pieces(t, monkeypatch):
    """W's gradient in pieces of TOKEN_CHUNK tokens (full pieces batched, a ragged tail apart, or the tail
    alone) is the whole sum: pieces of 16 tokens against one piece, and against fp64."""
    import longctx.ops.router.bf16x3 as b

    x, w, dy = _case(t, 96, 8)
    gw_whole = _run(x, w, dy, "bf16x3")[2]
    monkeypatch.setattr(b, "TOKEN_CHUNK", 16)
    gw = _run(x, w, dy, "bf16x3")[2]
    ref = dy.double().t() @ x.double()
    assert _rel(gw, ref) < 1e-6 and _rel(gw, gw_whole) < 1e-6, (_rel(gw, ref), _rel(gw_whole, ref))
    mm = b._mm
    no_pieces = lambda a, c, dt: torch.zeros(*a.shape[:2], c.shape[2]) if a.dim() == 3 else mm(a, c, dt)  # noqa: E731
    monkeypatch.setattr(b, "_mm", no_pieces)
    if t >= 16:  # the batched pieces count: without them the sum is the tail's alone
        assert _rel(_run(x, w, dy, "bf16x3")[2], ref) > 0.1


def test_bf16x3_takes_leading_dims_and_no_tokens():
    x, w, dy = _case(12, 64, 8)
    y, gx, gw = _run(x.view(3, 4, 64), w, dy.view(3, 4, 8), "bf16x3")
    y2, gx2, gw2 = _run(x, w, dy, "bf16x3")
    assert torch.equal(y.view(12, 8), y2) and torch.equal(gx.view(12, 64), gx2) and torch.equal(gw, gw2)
    y, gx, gw = _run(x[:0], w, dy[:0], "bf16x3")
    assert y.shape == (0, 8) and gx.shape == (0, 64) and torch.equal(gw, torch.zeros_like(gw))


def test_the_setting_picks_by_device_and_dtype():
    x, w = torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 8)
    assert pick("auto", x, w) == "torch" and pick("torch", x, w) == "torch"  # the CPU runs the twin, quietly
    with pytest.raises(ConfigError, match=r"kernels.router = 'bf16x3' cannot run here \(it runs on CUDA"):
        router_logits(x, w, "bf16x3")
    with pytest.raises(ConfigError, match="kernels.router must be one of auto, torch, bf16x3"):
        pick("fused", x, w)
    from longctx.ops.router import rejects

    assert rejects(x, w) is None
    assert "takes bf16 tokens" in rejects(x.float(), w) and "fp32 router weight" in rejects(x, w.bfloat16())


def test_bench_router_cpu_smoke(tmp_path):
    """bench/router.py --cpu-smoke: both paths on both shapes, the JSON it writes."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "bench" / "router.py"), "--cpu-smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "router_cpu_smoke.json").read_text())
    for c in res["cases"].values():
        assert c["bf16x3"]["rel_rms_vs_fp64"]["y"] < 1e-6 and c["torch"]["fwd_bwd_ms"] > 0
