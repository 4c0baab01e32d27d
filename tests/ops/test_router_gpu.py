"""The router's split-weight bf16 logits (longctx/ops/router/bf16x3.py) on the GPU, cuBLAS's bf16 matmuls
with fp32 output, against the fp32 twin (longctx/ops/router/naive.py) and fp64: logits and the weight's
gradient to the bf16 matmuls' fp32 accumulation, the tokens' gradient to its bf16 rounding, the same saved tensors, the same
experts chosen, and auto's choice in a MoE layer. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def _run(fn, x, w, dy):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("t,hidden,E", [(131072, 1536, 32), (4099, 4096, 288), (3, 96, 8), (0, 1536, 32)])
def test_bf16x3_router_matches_the_fp32_twin(t, hidden, E):
    from longctx.ops.router.bf16x3 import router_logits_bf16x3
    from longctx.ops.router.naive import router_logits_torch

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, hidden, device="cuda", generator=g).bfloat16()
    w = torch.randn(E, hidden, device="cuda", generator=g) * 0.02
    dy = torch.randn(t, E, device="cuda", generator=g)
    y, gx, gw = _run(router_logits_bf16x3, x, w, dy)
    y_t, gx_t, gw_t = _run(router_logits_torch, x, w, dy)
    assert y.dtype == gw.dtype == torch.float32 and gx.dtype == torch.bfloat16
    if t == 0:
        assert y.shape == (0, E) and gx.shape == (0, hidden) and not gw.any()
        return
    xd, wd, dyd = x.double(), w.double(), dy.double()
    errs = {"y": (_rel(y, xd @ wd.t()), _rel(y_t, xd @ wd.t())), "gw": (_rel(gw, dyd.t() @ xd), _rel(gw_t, dyd.t() @ xd)),
            "gx": (_rel(gx, dyd @ wd), _rel(gx_t, dyd @ wd))}
    print(t, hidden, E, errs)
    # cuBLAS's bf16 matmuls accumulate less exactly than its fp32 ones, the error growing with the sum's
    # length K (about 1e-9 K on Hopper, docs/design/moe.md): `hidden` terms for the logits, TOKEN_CHUNK
    # tokens for the weight's gradient. The bound allows 2.5x that rate.
    from longctx.ops.router.bf16x3 import TOKEN_CHUNK

    for k, K in (("y", hidden), ("gw", min(t, TOKEN_CHUNK))):
        assert errs[k][0] < 1e-6 + 2.5e-9 * K, (k, errs)
    assert errs["gx"][0] < 4e-3 and abs(errs["gx"][0] - errs["gx"][1]) < 2e-4, errs
    # the experts a token would choose: the same but for near ties
    k = min(4, E)
    same = (y.topk(k).indices.sort().values == y_t.topk(k).indices.sort().values).all(-1).float().mean().item()
    assert same > 0.999, same


def test_bf16x3_keeps_what_the_twin_keeps():
    from longctx.measure.meter import SavedTensorMeter
    from longctx.ops.router.bf16x3 import router_logits_bf16x3
    from longctx.ops.router.naive import router_logits_torch

    x = torch.randn(4096, 1536, device="cuda").bfloat16().requires_grad_(True)
    w = torch.randn(32, 1536, device="cuda").requires_grad_(True)
    kept = {}
    for name, fn in (("torch", router_logits_torch), ("bf16x3", router_logits_bf16x3)):
        meter = SavedTensorMeter()
        with meter.measure():
            fn(x, w)
        kept[name] = meter.total()
    assert kept["bf16x3"] == kept["torch"] == x.numel() * 2 + w.numel() * 4, kept


def test_auto_takes_bf16x3_for_bf16_tokens_in_a_moe_layer():
    from longctx.layers.moe import Router

    r = Router(32, 1536).cuda()
    x = torch.randn(64, 1536, device="cuda")
    r(x.bfloat16())
    assert r.last_impl == "router:bf16x3"
    with pytest.warns(RuntimeWarning, match="kernels.router auto runs the plain-torch twin on CUDA"):
        r(x)
    assert r.last_impl == "router:torch"
