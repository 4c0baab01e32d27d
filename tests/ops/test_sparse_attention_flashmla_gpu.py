"""FlashMLA's sparse prefill forward with our Triton backward (kernels.sparse_attention = "flashmla") on CUDA in
bf16 at the real width (D=512) against the fp32 torch twin; and the DSA layer running it, by auto at 64 heads."""

from __future__ import annotations

import pytest
import torch

from longctx.ops.sparse_attention.naive import causal_pool_indices, sparse_attention_torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _flashmla():
    from longctx.ops.sparse_attention import flashmla

    why = flashmla.import_error() or flashmla.device_problem("cuda")
    if why:
        pytest.skip(f"FlashMLA cannot run here: {why}")
    return flashmla


def _rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


@pytest.mark.parametrize(
    "B,S,S_kv,H,K",
    [
        (1, 2301, 2301, 64, 2051),  # the real shape past the 2048-token prefix, K padded to 2176
        (2, 333, 333, 16, 2051),  # heads padded 16 -> 64, two sequences, -1 slots in every row
        (1, 700, 1337, 128, 259),  # a chunk against a longer latent prefix (sequence chunks), 128 heads
    ],
)
@pytest.mark.parametrize("block_rows", [None, 300])  # 300: the sequence in several calls, as long ones run
def test_flashmla_matches_fp32_twin(B, S, S_kv, H, K, block_rows, monkeypatch):
    fm = _flashmla()
    if block_rows:
        monkeypatch.setattr(fm, "_BLOCK_BYTES", block_rows * (64 if H <= 64 else 128) * 512 * 2)
    D = 512
    g = torch.Generator(device="cuda").manual_seed(S * 7 + H)
    q = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16().requires_grad_(True)
    kv = torch.randn(B, S_kv, D, device="cuda", generator=g).bfloat16().requires_grad_(True)
    off = S_kv - S  # queries are the last S positions of the latent
    idx = torch.stack([torch.where(i >= 0, i + off, i) for i in
                       (causal_pool_indices(S, K, generator=g) for _ in range(B))]).to(torch.int32)
    scale = D**-0.5 * 2.0
    do = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16()

    o = fm.sparse_attention_flashmla(q, kv, idx, scale)
    dq, dkv = torch.autograd.grad(o, (q, kv), do)
    _, lse = fm.sparse_attention_fwd_flashmla(q.detach(), kv.detach(), idx, scale)

    q32, kv32 = q.detach().float().requires_grad_(True), kv.detach().float().requires_grad_(True)
    o_ref, lse_ref = sparse_attention_torch(q32, kv32, idx, scale, chunk=32, return_lse=True)
    dq_ref, dkv_ref = torch.autograd.grad(o_ref, (q32, kv32), do.float())
    assert o.dtype == torch.bfloat16 and o.shape == q.shape and lse.shape == (B, S, H)
    assert _rel(o, o_ref) <= 5e-3, _rel(o, o_ref)
    assert _rel(lse, lse_ref) <= 1e-5, _rel(lse, lse_ref)
    assert _rel(dq, dq_ref) <= 2e-2, _rel(dq, dq_ref)
    assert _rel(dkv, dkv_ref) <= 2e-2, _rel(dkv, dkv_ref)


def test_dsa_layer_runs_flashmla_by_auto_at_64_heads_and_matches_triton():
    """The layer's three paths (plain, a recompute's kept first pass, the replayed backward) through FlashMLA
    agree with the same layer on Triton."""
    _flashmla()
    from longctx.config import preset
    from longctx.layers.dsa import SparseMLA, keeping_attention

    cfg = preset("h200-ref").replace(attn_heads=64, index_topk=256)  # the layer alone: layer 3 is a DSA layer
    torch.manual_seed(0)
    layer = SparseMLA(cfg, 3).cuda()
    x = torch.randn(1, 1500, cfg.hidden_size, device="cuda")
    outs = {}
    for setting in ("auto", "triton"):
        layer.kernels["sparse_attention"] = setting
        layer.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, _ = layer(x)
        y.float().square().mean().backward()
        outs[setting] = (y.detach().float(), layer.q_b_proj.weight.grad.clone(), layer.last_impl)
        kept = {}
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16), keeping_attention(layer, kept):
            y_first, _ = layer(x)
        assert _rel(y_first, y) <= 1e-3, setting  # the kept first pass runs the same forward
    assert outs["auto"][2] == "dsa:flashmla-fwd+triton-bwd" and outs["triton"][2] == "dsa:triton-sparse"
    assert _rel(outs["auto"][0], outs["triton"][0]) <= 1e-2
    assert _rel(outs["auto"][1], outs["triton"][1]) <= 2e-2
