"""MoE: equality with HF's Glm5NextTextMoE, chunking, the balancers, and router-state release."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from longctx.config import ModelConfig
from longctx.errors import ConfigError
from longctx.layers.moe import MoE, expert_quota, quantile_bias, select_experts


def make_cfg(**kw) -> ModelConfig:
    base = {"hidden_size": 32, "moe_intermediate_size": 16, "n_routed_experts": 8, "experts_per_token": 2,
            "n_shared_experts": 1, "swiglu_limit": 10.0}
    base.update(kw)
    return ModelConfig(**base).validate()


@torch.no_grad()
def randomize(moe: MoE, seed: int, bias_scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in moe.parameters():
        p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    moe.router.bias.copy_(bias_scale * torch.randn(moe.router.bias.shape, generator=g))


def tensor_attrs(module: torch.nn.Module):
    """Every tensor hanging off the modules' plain attributes (lists and dicts one level down)."""
    for mod in module.modules():
        for name, v in vars(mod).items():
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            vals = v if isinstance(v, (list, tuple)) else [v]
            for item in vals:
                items = item.values() if isinstance(item, dict) else [item]
                for t in items:
                    if isinstance(t, torch.Tensor):
                        yield name, t


# ----------------------------------------------------------------------------- HF equality
HF_CASES = {
    "plain": {},
    "grouped": {"n_routed_experts": 16, "n_group": 4, "topk_group": 2, "experts_per_token": 3},
    "clamped_unnormalised": {"norm_topk_prob": False, "swiglu_limit": 0.5, "n_shared_experts": 2},
}


@pytest.mark.parametrize("case", list(HF_CASES))
@pytest.mark.parametrize("chunk", [None, 13])
def test_matches_hf(case, chunk):
    mod = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    cfg = make_cfg(**HF_CASES[case])
    hcfg = Glm5NextTextConfig(
        hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
        n_routed_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.experts_per_token,
        n_shared_experts=cfg.n_shared_experts, n_group=cfg.n_group, topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob,
        swiglu_limit=cfg.swiglu_limit, num_hidden_layers=4,
    )
    hcfg._experts_implementation = "eager"
    hf = mod.Glm5NextTextMoE(hcfg).eval()
    ours = MoE(cfg, layer_idx=1)
    randomize(ours, seed=list(HF_CASES).index(case))
    ours.chunk_tokens = chunk
    with torch.no_grad():
        hf.gate.weight.copy_(ours.router.weight)
        hf.gate.e_score_correction_bias.copy_(ours.router.bias)
        hf.experts.gate_up_proj.copy_(ours.experts.gate_up)
        hf.experts.down_proj.copy_(ours.experts.down)
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(hf.shared_experts, n).weight.copy_(getattr(ours.shared, n).weight)

    x = torch.randn(3, 40, cfg.hidden_size)
    # the selection bias must matter on this input, or the test could not see it being ignored
    s = torch.sigmoid(x.reshape(-1, cfg.hidden_size) @ ours.router.weight.T)
    a = select_experts(s, cfg.experts_per_token, cfg.n_group, cfg.topk_group).sort(-1).values
    b = select_experts(s + ours.router.bias, cfg.experts_per_token, cfg.n_group, cfg.topk_group).sort(-1).values
    assert (a != b).any(dim=-1).float().mean() > 0.1

    with torch.no_grad():
        want = hf(x)
        for train in (False, True):
            ours.train(train)
            got = ours(x)
            assert (got - want).abs().max().item() <= 1e-5
    if cfg.swiglu_limit < 1:  # the clamp is exercised
        h = torch.einsum("th,eih->tei", x.reshape(-1, cfg.hidden_size), ours.experts.gate_up)
        assert (h.abs() > cfg.swiglu_limit).float().mean() > 0.1


def test_shared_expert_omitted_when_zero():
    moe = MoE(make_cfg(n_shared_experts=0), 0)
    assert moe.shared is None
    names = {n for n, _ in moe.named_parameters()} | {n for n, _ in moe.named_buffers()}
    assert names == {"router.weight", "router.bias", "experts.gate_up", "experts.down"}
    assert moe.router.weight.dtype == torch.float32 and "router.bias" in moe.state_dict()


def test_router_stays_fp32_when_model_is_cast():
    moe = MoE(make_cfg(), 0).to(torch.bfloat16)
    assert moe.router.weight.dtype == moe.router.bias.dtype == torch.float32
    assert moe.experts.gate_up.dtype == moe.shared.up_proj.weight.dtype == torch.bfloat16
    assert isinstance(moe.router.weight, torch.nn.Parameter) and "bias" in moe.router._buffers
    y = moe(torch.randn(5, 32, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and moe.last_impl == "moe:loop"


def test_group_limit_validated():
    with pytest.raises(ConfigError, match="topk_group"):
        MoE(make_cfg(n_routed_experts=8, n_group=4, topk_group=1, experts_per_token=3), 0)


# ----------------------------------------------------------------------------- chunking, combine, router grads
@pytest.mark.parametrize("combine", [None, torch.float32])
def test_chunked_equals_unchunked(combine):
    cfg = make_cfg(n_routed_experts=8, experts_per_token=3, swiglu_limit=1.0)
    ref = MoE(cfg, 0)
    randomize(ref, seed=3)
    chk = MoE(cfg, 0)
    chk.load_state_dict(ref.state_dict())
    chk.chunk_tokens, ref.combine_dtype, chk.combine_dtype = 7, combine, combine
    x = torch.randn(2, 25, cfg.hidden_size)
    g = torch.randn_like(x)
    outs = []
    for m in (ref, chk):
        xi = x.clone().requires_grad_()
        y = m(xi)
        (y * g).sum().backward()
        outs.append((y.detach(), xi.grad, {n: p.grad for n, p in m.named_parameters()}))
    (y0, gx0, gp0), (y1, gx1, gp1) = outs
    torch.testing.assert_close(y1, y0, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gx1, gx0, atol=1e-5, rtol=1e-4)
    for n in gp0:
        assert gp0[n] is not None and gp0[n].abs().sum() > 0, n
        torch.testing.assert_close(gp1[n], gp0[n], atol=1e-5, rtol=1e-4)
    assert ref.last_impl == chk.last_impl == "moe:loop"
    torch.testing.assert_close(chk.last_load, ref.last_load)


def test_weighted_combine_matches_index_add_and_keeps_only_the_expert_outputs():
    """The combine (moe_bf16_combine on) against the plain zeros.index_add_(0, token, ys * w) in fp64:
    output and both gradients; what each keeps for backward: the plain form keeps its [k x tokens,
    hidden] products too (index_add_ saves its source), ours only the experts' outputs."""
    from longctx.layers.moe import _WeightedCombine

    g = torch.Generator().manual_seed(0)
    t, k, D = 13, 3, 8
    ys = torch.randn(t * k, D, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(t, k, generator=g, dtype=torch.float64, requires_grad=True)
    order = torch.randperm(t * k, generator=g)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(t * k)
    dy = torch.randn(t, D, generator=g, dtype=torch.float64)
    runs = {}
    for name in ("plain", "ours"):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
            if name == "plain":
                y = torch.zeros(t, D, dtype=torch.float64).index_add_(0, order // k, ys * w.flatten()[order][:, None])
            else:
                y = _WeightedCombine.apply(ys, w, order, inv)
        gys, gw = torch.autograd.grad(y, (ys, w), dy)
        rows = [x for x in saved if x.is_floating_point() and x.shape == (t * k, D)]
        runs[name] = (y, gys, gw, rows)
    for a, b in zip(runs["ours"][:3], runs["plain"][:3]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    assert len(runs["plain"][3]) == 2  # ys (for w's gradient) and the product (index_add_'s source)
    assert len(runs["ours"][3]) == 1 and runs["ours"][3][0].data_ptr() == ys.data_ptr()
    # a chunk with no tokens (a zero-length shard): empty output and gradients, no error
    e_ys = torch.zeros(0, D, dtype=torch.float64, requires_grad=True)
    e_w = torch.zeros(0, k, dtype=torch.float64, requires_grad=True)
    none = torch.zeros(0, dtype=torch.long)
    y0 = _WeightedCombine.apply(e_ys, e_w, none, none)
    assert y0.shape == (0, D)
    y0.sum().backward()
    assert e_ys.grad.shape == (0, D) and e_w.grad.shape == (0, k)


def test_gathered_rows_and_shared_base_match_autograd():
    """The experts' input rows x[token] (`_GatherRows`: each token's k gradients summed by one embedding_bag)
    and the combine with the shared expert's output added in its product (`base`) against plain autograd
    in fp64; a chunk with no tokens gives empty gradients."""
    from longctx.layers.moe import _GatherRows, _WeightedCombine

    g = torch.Generator().manual_seed(1)
    t, k, D = 11, 3, 8
    x = torch.randn(t, D, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(t, k, generator=g, dtype=torch.float64, requires_grad=True)
    base = torch.randn(t, D, generator=g, dtype=torch.float64, requires_grad=True)
    order = torch.randperm(t * k, generator=g)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(t * k)
    dy = torch.randn(t, D, generator=g, dtype=torch.float64)
    ours = _WeightedCombine.apply(_GatherRows.apply(x, order // k, inv, k).sin(), w, order, inv, base)
    plain = _WeightedCombine.apply(x[order // k].sin(), w, order, inv) + base
    torch.testing.assert_close(ours, plain, atol=1e-12, rtol=1e-12)
    for a, b in zip(torch.autograd.grad(ours, (x, w, base), dy), torch.autograd.grad(plain, (x, w, base), dy)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    e_x = torch.zeros(0, D, dtype=torch.float64, requires_grad=True)
    none = torch.zeros(0, dtype=torch.long)
    _GatherRows.apply(e_x, none, none, k).sum().backward()
    assert e_x.grad.shape == (0, D)


def test_router_logits_save_input_dtype_and_match_autograd():
    moe = MoE(make_cfg(), 0)
    randomize(moe, 5)
    x = torch.randn(30, 32, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(30, 8)
    (moe.router(x) * g).sum().backward()
    gx, gw = x.grad.clone(), moe.router.weight.grad.clone()
    x.grad = moe.router.weight.grad = None
    (torch.sigmoid(torch.nn.functional.linear(x.float(), moe.router.weight)) * g).sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, moe.router.weight.grad)


# ----------------------------------------------------------------------------- balancers
M, N, K, H = 4096, 16, 2, 32


def skewed(balancer: str, **kw) -> tuple[MoE, torch.Tensor]:
    """A router that sends most tokens to experts 0-2: a strong shared input direction d that those
    experts' router rows align with."""
    cfg = make_cfg(hidden_size=H, n_routed_experts=N, experts_per_token=K, balancer=balancer, **kw)
    moe = MoE(cfg, 0).train()
    g = torch.Generator().manual_seed(0)
    d = torch.randn(H, generator=g)
    d = d / d.norm()
    off = torch.zeros(N)
    off[:3] = torch.tensor([1.0, 0.8, 0.6])
    with torch.no_grad():
        moe.router.weight.copy_(0.05 * torch.randn(N, H, generator=g) + off[:, None] * d)
        moe.experts.gate_up.normal_(generator=g).mul_(0.1)
        moe.experts.down.normal_(generator=g).mul_(0.1)
    x = torch.randn(M, H, generator=g) + 3 * d
    return moe, x


def test_quantile_balances_after_one_update():
    moe, x = skewed("quantile")
    with torch.no_grad():
        moe(x)
    assert moe.last_balance >= 2.0
    assert torch.equal(moe.router.bias, torch.zeros(N))  # not applied yet
    assert moe.apply_balance_update()
    with torch.no_grad():
        moe(x)
    assert moe.last_balance <= 1.05, moe.last_load
    plain, _ = skewed("none")
    with torch.no_grad():
        plain(x)
    assert plain.last_balance >= 2.0
    assert not plain.apply_balance_update() and torch.equal(plain.router.bias, torch.zeros(N))


def test_quantile_single_step_matches_definition():
    """One dual step against a sort-based fp64 reference; and each expert's threshold admits q tokens."""
    torch.manual_seed(1)
    m, n, k = 1000, 12, 3
    s = torch.rand(m, n) ** 2
    bias = 0.05 * torch.randn(n)
    got = quantile_bias(s, bias, k, iters=1)
    sd, bd = s.double(), bias.double()
    q = expert_quota(m, n, k)
    assert q == 250
    alpha = (sd + bd).sort(dim=1, descending=True).values[:, k]
    beta = (sd - alpha[:, None]).sort(dim=0, descending=True).values[q]
    torch.testing.assert_close(got.double(), -beta, atol=1e-6, rtol=0)
    # s_ij - alpha_i > beta_j for q tokens (ties, e.g. at -bias_j for the tokens whose (k+1)-th choice
    # is j, may sit on the threshold itself)
    v, thr = sd - alpha[:, None], -got.double()[None]
    assert ((v > thr + 1e-6).sum(0) <= q).all() and ((v >= thr - 1e-6).sum(0) >= q).all()
    assert expert_quota(10, 3, 1) == 3 and expert_quota(11, 3, 1) == 4 and expert_quota(4, 4, 4) == 3


def test_sign_step_moves_toward_balance():
    moe, x = skewed("sign", balancer_rate=0.02)
    with torch.no_grad():
        moe(x)
    load, first = moe.last_load.clone(), moe.last_balance
    pending = moe.pending_bias
    torch.testing.assert_close(pending, 0.02 * torch.sign(load.mean() - load))
    for _ in range(30):
        moe.apply_balance_update()
        with torch.no_grad():
            moe(x)
    assert first >= 2.0 and moe.last_balance < 0.6 * first
    assert (moe.router.bias[:3] < 0).all()


def test_aux_loss_positive_with_router_gradient():
    moe, x = skewed("aux", aux_loss_coef=0.01)
    x = x[:500]
    moe(x).sum()  # graph built but unused
    loss = moe.aux_loss
    assert loss is not None and loss.item() > 0 and loss.grad_fn is not None
    s = torch.sigmoid(x @ moe.router.weight.detach().T)
    f = moe.last_load / (500 * K)
    want = 0.01 * N * (f * (s / s.sum(-1, keepdim=True)).mean(0)).sum()
    torch.testing.assert_close(loss.detach(), want)
    assert loss.item() > 0.01  # skewed routing costs more than the balanced value (= coef)
    (gw,) = torch.autograd.grad(loss, moe.router.weight)
    assert gw.abs().sum() > 0
    assert moe.pending_bias is None
    moe.eval()
    with torch.no_grad():
        moe(x)
    assert moe.aux_loss is None


@pytest.mark.parametrize("balancer", ["quantile", "sign"])
def test_pending_update_idempotent_and_deferred(balancer):
    moe, x = skewed(balancer, balancer_rate=0.01)
    x = x[:1024].clone().requires_grad_()
    before = moe.router.bias.clone()
    moe(x)
    p1 = moe.pending_bias.clone()
    assert torch.equal(moe.router.bias, before)
    moe(x)  # the same batch again (e.g. a recompute outside backward)
    torch.testing.assert_close(moe.pending_bias, p1, atol=0, rtol=0)
    # a recompute inside backward leaves the pending update alone
    fresh, _ = skewed(balancer, balancer_rate=0.01)
    y = checkpoint(fresh, x, use_reentrant=False)
    assert fresh._pending_count == 1
    y.sum().backward()
    assert fresh._pending_count == 1
    torch.testing.assert_close(fresh.pending_bias, p1, atol=0, rtol=0)
    # eval forwards do not touch it
    moe.eval()
    with torch.no_grad():
        moe(x)
    torch.testing.assert_close(moe.pending_bias, p1, atol=0, rtol=0)
    moe.apply_balance_update()
    assert torch.equal(moe.router.bias, p1) and moe.pending_bias is None
    assert not torch.equal(p1, before)


@pytest.mark.parametrize("balancer", ["quantile", "sign", "aux", "none"])
def test_router_state_released(balancer):
    moe, x = skewed(balancer)
    moe.chunk_tokens = 300
    x = x[:1000].clone().requires_grad_()
    y = moe(x)
    for name, t in tensor_attrs(moe):
        if name == "aux_loss":
            assert balancer == "aux" and t.numel() == 1
            continue
        assert t.grad_fn is None and not t.requires_grad, name
        assert t.numel() <= moe.n_experts, (name, t.shape)
    (y.sum() + (moe.aux_loss if moe.aux_loss is not None else 0)).backward()
    assert moe.router.weight.grad.abs().sum() > 0
    moe.release_router_state = False
    moe(x)
    assert len(moe.router_state) == 4 and all(d["scores"].grad_fn is None for d in moe.router_state)


# ----------------------------------------------------------------------------- CUDA fast path
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_mm_matches_loop_cuda():
    cfg = make_cfg(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, experts_per_token=4)
    moe = MoE(cfg, 0).cuda()
    randomize(moe, 11)
    moe.experts.to(torch.bfloat16)
    moe.shared.to(torch.bfloat16)
    x = torch.randn(4, 512, 64, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    res = {}
    for impl in ("grouped_mm", "loop"):
        moe.impl = impl
        for p in moe.parameters():
            p.grad = None
        xi = x.clone().requires_grad_()
        y = moe(xi)
        (y.float() * g.float()).sum().backward()
        assert moe.last_impl == f"moe:{impl}"
        res[impl] = (y.float(), xi.grad.float(), {n: p.grad.float() for n, p in moe.named_parameters()})
    moe.impl = "auto"
    moe(x)
    assert moe.last_impl == "moe:grouped_mm"

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    (y0, gx0, gp0), (y1, gx1, gp1) = res["grouped_mm"], res["loop"]
    assert rel(y0, y1) < 5e-3 and rel(gx0, gx1) < 1e-2
    for n in gp0:
        assert rel(gp0[n], gp1[n]) < 2e-2, n
