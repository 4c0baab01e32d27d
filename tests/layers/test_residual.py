"""mHC against transformers' hyper-connection; block attention residuals; the fp32-cast recompute."""

from __future__ import annotations

import pytest
import torch

from longctx.config import preset
from longctx.layers.residual import MHC, AttnRes, AttnResStream, build_residuals


def test_mhc_matches_transformers():
    from hf_reference import text_config
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperConnection

    hf = Glm5NextTextHyperConnection(Glm5NextTextConfig(**text_config()))
    cfg = preset("tiny")
    ours = MHC(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (hf.fn, hf.base, hf.scale):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        ours.fn.copy_(hf.fn), ours.base.copy_(hf.base), ours.scale.copy_(hf.scale)
    streams = torch.randn(2, 9, 4, 32, generator=g, dtype=torch.float32)
    y = torch.randn(2, 9, 32, generator=g)
    post, comb, collapsed = hf(streams)
    ref = post.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
    x, ctx = ours.enter(streams)
    torch.testing.assert_close(x, collapsed, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.exit(streams, ctx, y), ref, rtol=0, atol=1e-6)


def _saved_fp32_bytes(fn, *args):
    """Bytes of fp32 tensors autograd saves for backward while running fn(*args)."""
    sizes = []

    def pack(t):
        if t.dtype == torch.float32:
            sizes.append(t.numel() * 4)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return sum(sizes), out


def test_mhc_cast_recompute_keeps_no_fp32_copy_and_same_grads():
    cfg = preset("tiny")
    mhc = MHC(cfg).to(torch.bfloat16)
    mhc.base.data = mhc.base.data.float()
    mhc.scale.data = mhc.scale.data.float()
    streams = torch.randn(1, 64, 4, 32, dtype=torch.bfloat16, requires_grad=True)
    fp32_copy = streams.numel() * 4

    def run(recompute):
        mhc.recompute_cast = recompute

        def step(s):
            x, ctx = mhc.enter(s)
            return mhc.exit(s, ctx, x).float().sum()

        return _saved_fp32_bytes(step, streams)

    kept_on, loss_on = run(True)
    kept_off, loss_off = run(False)
    # the plain path saves the fp32 normalised copy of the streams; the recompute path does not
    assert kept_off - kept_on >= fp32_copy
    g_on = torch.autograd.grad(loss_on, streams)[0]
    g_off = torch.autograd.grad(loss_off, streams)[0]
    assert torch.equal(g_on, g_off)  # bit-identical, as the 1M-token GLM-5.3-Flash training report says


def test_attnres_zero_query_is_uniform_average_and_blocks_close():
    cfg = preset("tiny").replace(residual="attnres", attnres_blocks=2)
    stream, pairs = build_residuals(cfg)
    assert isinstance(stream, AttnResStream) and all(isinstance(m, AttnRes) for p in pairs for m in p)
    closes = [m.closes_block for p in pairs for m in p]
    assert closes == [False, False, False, True, False, False, False, True]
    h = torch.randn(1, 5, 32)
    state = stream.init(h)
    ys = []
    for res in [m for p in pairs for m in p][:5]:
        x, ctx = res.enter(state)
        y = torch.randn_like(x)
        ys.append(y)
        state = res.exit(state, ctx, y)
    blocks, partial = state
    assert len(blocks) == 2 and torch.allclose(blocks[1], sum(ys[:4]), atol=1e-6)
    assert torch.allclose(partial, ys[4])
    x, _ = pairs[2][1].enter(state)  # zero-initialised query: plain mean of the sources
    assert torch.allclose(x, (blocks[0] + blocks[1] + partial) / 3, atol=1e-5)


@pytest.mark.parametrize("residual", ["mhc", "attnres", "plain"])
def test_model_trains_with_each_residual(residual):
    from longctx.model import LongCtxModel

    torch.manual_seed(0)
    model = LongCtxModel(preset("tiny").replace(residual=residual))
    ids = torch.randint(0, 97, (2, 24))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        out = model(ids[:, :-1], labels=ids[:, 1:])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        model.apply_balance_updates()
        losses.append(out.lm_loss.item())
    assert losses[-1] < 0.8 * losses[0]
    if residual == "attnres":  # the pseudo-queries leave zero once trained
        assert any(m.query.abs().sum() > 0 for m in model.modules() if isinstance(m, AttnRes))
