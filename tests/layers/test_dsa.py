"""DSA layer and k-pool indexer: against brute-force references and transformers' glm5_next."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from longctx.config import ModelConfig, preset
from longctx.errors import ConfigError
from longctx.layers.dsa import DSACache, SparseMLA
from longctx.layers.kpool_indexer import IndexerCache, KPoolIndexer
from longctx.ops.sparse_attention import dense_masked_attention, sparse_attention_torch


def make_cfg(**kw) -> ModelConfig:
    base = {"index_heads": 8, "index_topk": 16, "index_pool": 4}
    base.update(kw)
    return preset("tiny").replace(**base)


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int) -> None:
    """Non-degenerate weights (the default pool gate of ones and zero ape would make pooling trivial)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        r = torch.randn(p.shape, generator=g)
        if name.endswith("norm.weight"):
            v = 1 + 0.2 * r
        elif name.endswith("norm.bias"):
            v = 0.1 * r
        elif name.endswith(("pool_ape", "pool_gate")):
            v = 0.5 * r
        else:
            v = r / math.sqrt(p.shape[-1])
        p.copy_(v)


# ------------------------------------------------------------------------------------ references
def ref_pool_scores(ind: KPoolIndexer, x: torch.Tensor, ql: torch.Tensor) -> list:
    """fp64, one query and one pool at a time: scores[b][t] = {pool: score} over selectable pools."""
    P, H, D = ind.pool, ind.n_heads, ind.head_dim
    d = lambda t: t.detach().double()
    x, ql = d(x), d(ql)
    B, S, _ = x.shape
    kr = x @ d(ind.wk.weight).T
    kr = (kr - kr.mean(-1, keepdim=True)) / torch.sqrt(kr.var(-1, unbiased=False, keepdim=True) + 1e-6)
    kr = kr * d(ind.k_norm.weight) + d(ind.k_norm.bias)
    gate = x @ d(ind.pool_gate).T
    out = []
    for b in range(B):
        pk = []
        for p in range(S // P):
            rows = slice(p * P, p * P + P)
            wts = torch.softmax(gate[b, rows] + d(ind.pool_ape), dim=0)  # over the pool's tokens
            pk.append((wts * kr[b, rows]).sum(0))
        per_t = []
        for t in range(S):
            q = (d(ind.wq_b.weight) @ ql[b, t]).view(H, D)
            w = (d(ind.weights_proj.weight) @ x[b, t]) / math.sqrt(H)
            per_t.append({p: float((w * F.relu(q @ pk[p] / math.sqrt(D))).sum()) for p in range((t + 1) // P)})
        out.append(per_t)
    return out


def ref_select(ind: KPoolIndexer, scores: list, S: int) -> list:
    """Per query: (chosen pools, tail tokens), ties to the later pool."""
    P = ind.pool
    k_sel = min(ind.topk // P, S // P)
    res = []
    for per_t in scores:
        rows = []
        for t, sc in enumerate(per_t):
            chosen = sorted(sc, key=lambda p: (-sc[p], -p))[:k_sel]
            cnt = (t + 1) % P if ind.tail else 0
            rows.append((set(chosen), list(range(t + 1 - cnt, t + 1))))
        res.append(rows)
    return res


def check_selection(ind, sel, scores, tol=1e-5):
    """Exact rows, except that a pool may trade places with one whose score is tied within tol."""
    B, S, W = sel.shape
    assert W == ind.width
    ref = ref_select(ind, scores, S)
    P = ind.pool
    for b in range(B):
        for t in range(S):
            row = sel[b, t].tolist()
            n = sum(v >= 0 for v in row)
            assert all(v == -1 for v in row[n:]), f"row {t} not packed: {row}"
            assert row[:n] == sorted(row[:n]) and len(set(row[:n])) == n, f"row {t} not ascending: {row}"
            assert all(0 <= v <= t for v in row[:n]), f"row {t} not causal: {row}"
            pools_ref, tail_ref = ref[b][t]
            complete = [v for v in row[:n] if v // P < (t + 1) // P]
            tail = [v for v in row[:n] if v // P == (t + 1) // P]
            assert tail == tail_ref, (t, tail, tail_ref)
            pools = {v // P for v in complete}
            assert sorted(complete) == sorted(p * P + m for p in pools for m in range(P))
            assert len(pools) == len(pools_ref), (t, pools, pools_ref)
            sc = scores[b][t]
            for p, q in zip(sorted(pools - pools_ref), sorted(pools_ref - pools)):
                assert abs(sc[p] - sc[q]) <= tol * (1 + abs(sc[q])), (t, p, q, sc[p], sc[q])


def rand_inputs(cfg, B, S, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, cfg.hidden_size, generator=g), torch.randn(B, S, cfg.q_lora_rank, generator=g)


# ------------------------------------------------------------------------------------ attention op
def test_sparse_gather_matches_dense_mask_fwd_bwd():
    g = torch.Generator().manual_seed(0)
    B, S, H, D, K = 2, 23, 3, 16, 9
    q = torch.randn(B, S, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(B, S, D, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.full((B, S, K), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(S):
            n = int(torch.randint(0, min(K, t + 1) + 1, (1,), generator=g)) if t else 0
            perm = torch.randperm(t + 1, generator=g)[:n]
            slots = torch.randperm(K, generator=g)[:n]
            idx[b, t, slots] = perm.int()
    outs = []
    for fn in (lambda: sparse_attention_torch(q, kv, idx, 0.3, chunk=5), lambda: dense_masked_attention(q, kv, idx, 0.3)):
        o = fn()
        gq, gkv = torch.autograd.grad((o * torch.linspace(-1, 1, D, dtype=o.dtype)).sum(), (q, kv))
        outs.append((o, gq, gkv))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert outs[0][0][0, 0].abs().max() == 0  # an empty row attends to nothing


def test_layer_sparse_equals_dense_impl_fwd_bwd():
    cfg = make_cfg()
    layer = SparseMLA(cfg, 3)
    randomize(layer, 1)
    layer.double()
    x = torch.randn(2, 45, cfg.hidden_size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    res = []
    for impl in ("sparse", "dense"):
        layer.attn_impl, layer.kernels["sparse_attention"] = impl, "torch"
        y, sel = layer(x)
        assert layer.last_impl == {"sparse": "dsa:torch-sparse", "dense": "dsa:dense-masked"}[impl]
        grads = torch.autograd.grad((y * y).sum(), [p for n, p in layer.named_parameters() if "indexer" not in n])
        res.append((y, sel, *grads))
    assert torch.equal(res[0][1], res[1][1])
    for a, b in zip(res[0], res[1]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


# ------------------------------------------------------------------------------------ selection
@pytest.mark.parametrize("pool,topk,S,tail", [(4, 16, 70, True), (4, 16, 11, True), (16, 32, 75, True),
                                              (16, 32, 21, True), (4, 8, 31, False)])
def test_selection_matches_bruteforce(pool, topk, S, tail):
    cfg = make_cfg(index_pool=pool, index_topk=topk, index_tail=tail)
    ind = KPoolIndexer(cfg, 0)
    randomize(ind, pool + S)
    x, ql = rand_inputs(cfg, 2, S, S)
    sel = ind.select(x, ql, chunk=None)
    assert sel.dtype == torch.int32 and sel.shape == (2, S, cfg.index_width())
    check_selection(ind, sel, ref_pool_scores(ind, x, ql))
    if tail:  # short queries see exactly the dense causal set
        for t in range(min(S, topk)):
            assert sel[:, t, : t + 1].tolist() == [list(range(t + 1))] * 2 and (sel[:, t, t + 1 :] == -1).all()


@pytest.mark.parametrize("pool,topk,S", [(4, 16, 70), (16, 32, 75)])
def test_chunked_equals_unchunked(pool, topk, S):
    cfg = make_cfg(index_pool=pool, index_topk=topk)
    ind = KPoolIndexer(cfg, 0)
    randomize(ind, 5)
    x, ql = rand_inputs(cfg, 2, S, 6)
    full = ind.select(x, ql, chunk=None)
    for chunk in (1, 5, 16, 64, 1000):
        assert torch.equal(ind.select(x, ql, chunk=chunk), full)


# ------------------------------------------------------------------------------------ vs transformers
try:
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention, Glm5NextTextIndexer
except ImportError:  # the semantic reference is a test extra
    Glm5NextTextConfig = None
needs_hf = pytest.mark.skipif(Glm5NextTextConfig is None, reason="needs transformers >= 5.23 (glm5_next)")


def hf_config(cfg: ModelConfig, indexer_types) -> Glm5NextTextConfig:
    n = len(indexer_types)
    hc = Glm5NextTextConfig(
        hidden_size=cfg.hidden_size, num_hidden_layers=n, num_attention_heads=cfg.attn_heads,
        num_key_value_heads=cfg.attn_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim, rms_norm_eps=cfg.rms_norm_eps,
        index_n_heads=cfg.index_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        index_kpool=cfg.index_pool, index_kpool_always_select_tail=cfg.index_tail,
        layer_types=["indexed_attention"] * n, indexer_types=list(indexer_types), mlp_layer_types=["dense"] * n,
    )
    hc._attn_implementation = "eager"
    return hc


RENAME = {"q_a_layernorm": "q_a_norm", "kv_a_proj_with_mqa": "kv_a_proj", "kv_a_layernorm": "kv_a_norm",
          "index_kpool_compress_ape": "pool_ape", "index_kpool_compress_gate": "pool_gate"}


def load_from_hf(ours: torch.nn.Module, hf: torch.nn.Module) -> None:
    sd = {}
    for k, v in hf.state_dict().items():
        parts = k.split(".")
        sd[".".join(RENAME.get(p, p) for p in parts)] = v
    ours.load_state_dict(sd, strict=True)


@needs_hf
@pytest.mark.parametrize("pool,topk,S", [(4, 16, 70), (16, 32, 75), (4, 16, 13)])
def test_selection_matches_hf_indexer(pool, topk, S):
    cfg = make_cfg(index_pool=pool, index_topk=topk)
    torch.manual_seed(0)
    hf = Glm5NextTextIndexer(hf_config(cfg, ["full"]), 0)
    randomize(hf, 7)
    ind = KPoolIndexer(cfg, 0)
    load_from_hf(ind, hf)
    x, ql = rand_inputs(cfg, 2, S, 8)
    ref = hf(x, ql, torch.ones(2, S, dtype=torch.bool), None)
    ours = ind.select(x, ql, chunk=16)
    assert ref.shape == ours.shape
    for b in range(2):
        for t in range(S):
            assert set(ours[b, t].tolist()) == set(ref[b, t].tolist()), (b, t)


@needs_hf
@pytest.mark.parametrize("S", [13, 57])
def test_layer_matches_hf_attention_with_shared_indexer(S):
    cfg = make_cfg(num_layers=2, layer_pattern="DD", mlp_pattern="dd", indexer_pattern="fs")
    hc = hf_config(cfg, ["full", "shared"])
    torch.manual_seed(0)
    hf = [Glm5NextTextAttention(hc, i).eval() for i in range(2)]
    ours = [SparseMLA(cfg, i).eval() for i in range(2)]
    assert ours[1].indexer is None and hf[1].indexer is None
    for i in range(2):
        randomize(hf[i], 10 + i)
        load_from_hf(ours[i], hf[i])
    x = torch.randn(2, S, cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    mask = torch.ones(2, S, dtype=torch.bool)
    with torch.no_grad():
        y0_ref, _, topk_ref = hf[0](x, mask, prev_topk_indices=None)
        y1_ref, _, _ = hf[1](x, mask, prev_topk_indices=topk_ref)
        y0, sel = ours[0](x)
        y1, sel1 = ours[1](x, prev_selection=sel)
    assert sel1 is sel
    assert (y0 - y0_ref).abs().max() <= 1e-5
    assert (y1 - y1_ref).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="prev_selection"):
        ours[1](x)


@needs_hf
@pytest.mark.parametrize("pool,topk,S", [(4, 8, 45), (16, 32, 90)])
def test_exact_ties_resolve_like_hf(pool, topk, S):
    """All scores exactly 0 (every row one big tie): torch.topk on the same rows picks the same pools."""
    cfg = make_cfg(index_pool=pool, index_topk=topk)
    hf = Glm5NextTextIndexer(hf_config(cfg, ["full"]), 0)
    randomize(hf, 12)
    with torch.no_grad():
        hf.weights_proj.weight.zero_()
    ind = KPoolIndexer(cfg, 0)
    load_from_hf(ind, hf)
    x, ql = rand_inputs(cfg, 2, S, 13)
    ref = hf(x, ql, torch.ones(2, S, dtype=torch.bool), None)
    full = ind.select(x, ql, chunk=None)
    for chunk in (1, 7):
        assert torch.equal(ind.select(x, ql, chunk=chunk), full)
    for b in range(2):
        for t in range(S):
            assert set(full[b, t].tolist()) == set(ref[b, t].tolist()), (b, t)


# ------------------------------------------------------------------------------------ decoding
def test_decode_cache_matches_full_forward():
    cfg = make_cfg(num_layers=2, layer_pattern="DD", mlp_pattern="dd", indexer_pattern="fs")
    layers = [SparseMLA(cfg, i).eval() for i in range(2)]
    for i, layer in enumerate(layers):
        randomize(layer, 20 + i)
    S = 53
    x = torch.randn(2, S, cfg.hidden_size, generator=torch.Generator().manual_seed(21))
    with torch.no_grad():
        y0, sel = layers[0](x)
        y1, _ = layers[1](x, prev_selection=sel)
        caches = [DSACache(), DSACache()]
        steps = [13, 1, 1, 1, 5, 2] + [1] * (S - 23)
        got0, got1, s0 = [], [], 0
        for n in steps:
            xs = x[:, s0 : s0 + n]
            a, sel_s = layers[0](xs, cache=caches[0])
            b, _ = layers[1](xs, prev_selection=sel_s, cache=caches[1])
            assert torch.equal(sel_s, sel[:, s0 : s0 + n])
            got0.append(a)
            got1.append(b)
            s0 += n
    assert s0 == S and caches[0].length == S and caches[0].indexer.length == S
    assert caches[0].indexer.pool_keys.n == S // cfg.index_pool
    torch.testing.assert_close(torch.cat(got0, 1), y0, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.cat(got1, 1), y1, rtol=0, atol=1e-5)


def test_indexer_cache_pools_match_full():
    cfg = make_cfg(index_pool=16, index_topk=32)
    ind = KPoolIndexer(cfg, 0)
    randomize(ind, 30)
    x, ql = rand_inputs(cfg, 1, 70, 31)
    full = ind.select(x, ql)
    cache, parts, s0 = IndexerCache(), [], 0
    for n in (3, 20, 1, 30, 16):
        parts.append(ind.select(x[:, s0 : s0 + n], ql[:, s0 : s0 + n], cache=cache))
        s0 += n
    assert torch.equal(torch.cat(parts, 1), full)
    assert cache.raw_k.shape[1] == 70 % 16


# ------------------------------------------------------------------------------------ indexer loss
def ref_kl(ind, x, ql, q_attn, kv, scale, selection, dense):
    """fp64 per query: KL(target over pools || softmax of the indexer's pool scores)."""
    P = ind.pool
    scores = ref_pool_scores(ind, x, ql)
    qa, kv = q_attn.double(), kv.double()
    B, S = x.shape[:2]
    total, count = 0.0, 0
    for b in range(B):
        for t in range(S):
            if dense:
                toks = list(range(t + 1))
            else:
                toks = [v for v in selection[b, t].tolist() if v >= 0]
            logits = scale * qa[b, t] @ kv[b, toks].T  # [H, n]
            prob = torch.softmax(logits, -1).sum(0)
            mass = {}
            for j, pr in zip(toks, prob.tolist()):
                if j // P < (t + 1) // P:
                    mass[j // P] = mass.get(j // P, 0.0) + pr
            if not mass:
                continue
            pools = sorted(mass)
            tgt = torch.tensor([mass[p] for p in pools], dtype=torch.float64)
            tgt = tgt / tgt.sum()
            logq = torch.log_softmax(torch.tensor([scores[b][t][p] for p in pools], dtype=torch.float64), 0)
            total += float((tgt * (tgt.log() - logq)).sum())
            count += 1
    return total / count


@pytest.mark.parametrize("dense", [True, False])
def test_indexer_loss_matches_reference(dense):
    cfg = make_cfg(index_pool=4, index_topk=8)
    ind = KPoolIndexer(cfg, 0)
    randomize(ind, 40)
    S, H, D = 37, 3, 16
    x, ql = rand_inputs(cfg, 2, S, 41)
    g = torch.Generator().manual_seed(42)
    q_attn, kv = torch.randn(2, S, H, D, generator=g), torch.randn(2, S, D, generator=g)
    sel = ind.select(x, ql)
    losses = [ind.kl_loss(x, ql, q_attn, kv, 0.4, selection=sel, dense=dense, chunk=c).item() for c in (None, 6)]
    ref = ref_kl(ind, x, ql, q_attn, kv, 0.4, sel, dense)
    assert ref > 1e-3
    for got in losses:
        assert abs(got - ref) <= 1e-5 * (1 + ref), (got, ref)


@pytest.mark.parametrize("S", [24, 45])  # dense warm-up (S <= 32) and sparse KL
def test_indexer_loss_trains_only_the_indexer(S):
    cfg = make_cfg(index_pool=4, index_topk=8, indexer_loss=True, indexer_loss_dense_below=32)
    layer = SparseMLA(cfg, 3).train()
    randomize(layer, 50)
    layer.indexer.chunk = 7
    x = torch.randn(2, S, cfg.hidden_size, generator=torch.Generator().manual_seed(51), requires_grad=True)
    y, _ = layer(x)
    kl = layer.indexer_loss_value
    assert kl is not None and kl.dim() == 0 and torch.isfinite(kl) and kl > 0
    names, params = zip(*layer.named_parameters())
    grads = torch.autograd.grad(kl, list(params) + [x], allow_unused=True, retain_graph=True)
    for n, gr in zip(names, grads):
        if n.startswith("indexer."):
            assert gr is not None and torch.isfinite(gr).all() and gr.abs().sum() > 0, n
        else:
            assert gr is None, n
    assert grads[-1] is None  # nothing flows back into the layer's input either
    lm = torch.autograd.grad((y * y).sum(), [p for n, p in layer.named_parameters() if n.startswith("indexer.")],
                             allow_unused=True)
    assert all(gr is None for gr in lm)

    opt = torch.optim.Adam(layer.indexer.parameters(), lr=2e-2)
    x = x.detach()
    first = None
    for _ in range(25):
        layer(x)
        loss = layer.indexer_loss_value
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    layer(x)
    assert layer.indexer_loss_value.item() < 0.7 * first


def test_backend_switches_raise_instead_of_falling_back(monkeypatch):
    """kernels.sparse_attention triton on CPU tensors (no interpreter) is one ConfigError naming the setting,
    before anything runs; an unknown attn_impl too."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = make_cfg()
    layer = SparseMLA(cfg, 3)
    x = torch.randn(1, 9, cfg.hidden_size)
    layer(x)
    assert layer.last_impl == "dsa:torch-sparse"  # auto on the CPU is the torch twin
    layer.kernels["sparse_attention"], layer.last_impl = "triton", None
    with pytest.raises(ConfigError, match=r"kernels.sparse_attention = 'triton' cannot run here .*CUDA"):
        layer(x)
    assert layer.last_impl is None
    layer.kernels["sparse_attention"] = "cuda"
    with pytest.raises(ConfigError, match="kernels.sparse_attention must be one of auto, torch, triton"):
        layer(x)
    layer.kernels["sparse_attention"], layer.attn_impl = "auto", "flash"
    with pytest.raises(ConfigError, match="attn_impl"):
        layer(x)


def test_forced_selection_skips_indexer_and_kl(monkeypatch):
    cfg = make_cfg(indexer_loss=True)
    layer = SparseMLA(cfg, 3).train()
    randomize(layer, 60)
    x = torch.randn(1, 30, cfg.hidden_size)
    y, sel = layer(x)
    assert layer.indexer_loss_value is not None

    def boom(*a, **k):
        raise AssertionError("indexer ran")

    monkeypatch.setattr(layer.indexer, "select", boom)
    y2, sel2 = layer(x, forced_selection=sel)
    assert sel2 is sel and torch.equal(y2, y) and layer.indexer_loss_value is None
    assert isinstance(layer.init_cache(1), DSACache)


def test_indexer_loss_under_no_grad_first_pass():
    """Under full recompute the first forward runs without a graph; the KL must still train."""
    cfg = make_cfg(indexer_loss=True)
    layer = SparseMLA(cfg, 3).train()
    randomize(layer, 61)
    with torch.no_grad():
        layer(torch.randn(1, 40, cfg.hidden_size))
    kl = layer.indexer_loss_value
    assert kl.requires_grad
    kl.backward()
    assert layer.indexer.wq_b.weight.grad.abs().sum() > 0 and layer.q_b_proj.weight.grad is None


def test_pool_scores_are_fp32_under_autocast():
    """score(t, p) in fp32 as documented, also under bf16 autocast: bf16 scores tie, and torch.topk
    breaks ties differently for the decode path's shorter rows."""
    cfg = make_cfg(index_pool=4, index_topk=16)
    ind = KPoolIndexer(cfg, 0)
    randomize(ind, 5)
    x, ql = rand_inputs(cfg, 1, 40, 6)
    pk = torch.randn(1, 10, cfg.index_head_dim)
    ref = ind.pool_scores(ql, x, pk)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ind.pool_scores(ql.bfloat16(), x.bfloat16(), pk.bfloat16())
        q_in = ql.bfloat16().float()  # what the projections see: bf16-rounded inputs
    want = ind.pool_scores(q_in, x.bfloat16().float(), pk.bfloat16().float())
    assert got.dtype == torch.float32
    # the projections (wq_b, weights_proj) stay under autocast; the score matmuls must not be bf16
    assert (got - want).abs().max() <= 2e-2 * want.abs().max(), (got - want).abs().max()
    assert ref.shape == got.shape


@pytest.mark.parametrize("pool,topk,tail", [(4, 16, True), (4, 16, False), (3, 12, True), (1, 8, True)])
@pytest.mark.parametrize("p0", [0, 37])
def test_compact_selection_expands_to_the_same_indices(pool, topk, tail, p0):
    """`compact` keeps one entry per pool; `expand` must rebuild every slot exactly, including the
    early queries with fewer complete pools than top-k (-1 padding) and the tail of the own pool."""
    cfg = make_cfg(index_pool=pool, index_topk=topk, index_tail=tail)
    idx = KPoolIndexer(cfg, 0)
    randomize(idx, 3)
    g = torch.Generator().manual_seed(5)
    T = 90
    x = torch.randn(2, p0 + T, cfg.hidden_size, generator=g)
    q = torch.randn(2, p0 + T, cfg.q_lora_rank, generator=g)
    cache = IndexerCache()
    if p0:
        idx.select(x[:, :p0], q[:, :p0], cache=cache)
    sel = idx.select(x[:, p0:], q[:, p0:], cache=cache)
    assert (sel >= 0).any() and (p0 or (sel < 0).any())
    comp = idx.compact(sel)
    assert comp.shape[-1] == idx.compact_width() == -(-cfg.index_width() // pool)
    assert torch.equal(idx.expand(comp, p0, rows=17), sel)
