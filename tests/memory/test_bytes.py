"""The byte model (longctx.memory.model_bytes) against what the CPU measures: a block's kept tensors
against `SavedTensorMeter`, the offloader's host bytes against what it moved, autocast's cached copies
against `LiveBytes`; the per-element counts it rests on (what the RMSNorm and the clamped SwiGLU save);
and the terms it adds for liger's mHC backward, the chunked step's DSA prefix and the kept attention."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from longctx.config import preset
from longctx.measure.meter import LiveBytes, SavedTensorMeter, meter_model_step
from longctx.memory.model_bytes import _mhc_stream_workspace, estimate
from longctx.memory.plan import MemoryPlan, apply_plan
from longctx.memory.recompute import RecomputePolicy
from longctx.model import LongCtxModel
from memory_steps import RECOMPUTE, S, _batch, _cfg, _model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_rms_norm_keeps_its_input_and_one_rstd_per_row():
    """ops.rms_norm.RMSNormFn: the plain-autograd arithmetic op for op in forward (bit-identical outputs), but
    only x (its own dtype) and an fp32 rstd per row kept for backward (plain autograd: 6 bytes per
    element of a bf16 x, here 2); gradients as plain autograd's in fp32, and nearer fp64's in bf16
    (plain autograd rounds the normalised rows' gradient to bf16 on the way)."""
    from longctx.layers.norms import RMSNorm
    from longctx.ops.rms_norm import rms_norm_plain

    torch.manual_seed(0)
    B, T, D = 2, 50, 64
    norm = RMSNorm(D)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(D))
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    for dt in (torch.float32, torch.bfloat16):
        x = (3 * torch.randn(B, T, D)).to(dt).requires_grad_(True)
        dy = torch.randn(B, T, D).to(dt)
        meter = SavedTensorMeter()
        with meter.measure():
            y = norm(x)
        if dt == torch.bfloat16:
            assert meter.total() == B * T * (2 * D + 4) + D * 4  # x, rstd, the fp32 weight
        gx, gw = torch.autograd.grad(y, (x, norm.weight), dy)
        x2, w2 = x.detach().clone().requires_grad_(True), norm.weight.detach().clone().requires_grad_(True)
        y2 = rms_norm_plain(x2, w2, norm.eps)
        gx2, gw2 = torch.autograd.grad(y2, (x2, w2), dy)
        assert torch.equal(y, y2) and gx.dtype == dt and gw.dtype == torch.float32
        if dt == torch.float32:
            assert rel(gx, gx2) < 1e-6 and rel(gw, gw2) < 1e-6
        else:
            x3 = x.detach().double().requires_grad_(True)
            y3 = norm.weight.double() * (x3 * torch.rsqrt(x3.pow(2).mean(-1, keepdim=True) + norm.eps))
            gx3, = torch.autograd.grad(y3, (x3,), dy.double())
            assert rel(gx, gx3) < rel(gx2, gx3) and rel(gx, gx3) < 4e-3 and rel(gw, gw2) < 1e-6


def test_clamped_swiglu_keeps_only_gate_and_up():
    """ops.swiglu.ClampedSwiGLU: plain autograd's ops forward and backward (outputs and gradients
    bit-identical, values on the clamp bounds included), but only gate and up kept for backward (one
    storage where they are views of the experts' [2I] projection: 2 rows of the width, plain autograd 5)."""
    from longctx.ops.swiglu import clamped_swiglu, clamped_swiglu_packed, clamped_swiglu_plain

    torch.manual_seed(0)
    T, I, lim = 40, 32, 1.5
    for dt in (torch.float64, torch.bfloat16):
        h0 = (2 * torch.randn(T, 2 * I)).to(dt)
        h0[0, :4], h0[0, I:I + 4] = lim, -lim
        dy = torch.randn(T, I).to(dt)
        h2 = h0.clone().requires_grad_(True)
        plain = SavedTensorMeter()
        with plain.measure():
            y2 = clamped_swiglu_plain(h2[:, :I], h2[:, I:], lim)
        assert plain.total() == 5 * T * I * h0.element_size()  # h (2 rows), clamped gate, its SiLU, clamped up
        gh2, = torch.autograd.grad(y2, (h2,), dy)
        # the two-view form (DenseMLP) and the packed one (the experts: one [2I] gradient, no slice backward)
        for fn in (lambda h: clamped_swiglu(h[:, :I], h[:, I:], lim), lambda h: clamped_swiglu_packed(h, lim)):
            h = h0.clone().requires_grad_(True)
            meter = SavedTensorMeter()
            with meter.measure():
                y = fn(h)
            assert meter.total() == h.numel() * h.element_size()
            gh, = torch.autograd.grad(y, (h,), dy)
            assert torch.equal(y, y2) and torch.equal(gh, gh2)
        packed = clamped_swiglu_packed(h0.clone().requires_grad_(True), lim)
        assert [type(f).__name__ for f, _ in packed.grad_fn.next_functions if f is not None] == ["AccumulateGrad"]


def test_estimate_kept_matches_the_meter_under_recompute():
    cfg = preset("tiny")
    s = 512
    model = _model(cfg)
    ids, labels = _batch(cfg, s=s, b=1)
    apply_plan(model, RECOMPUTE)
    m = meter_model_step(model, ids, labels)
    e = estimate(cfg, s, RECOMPUTE, act_bytes=4)
    assert [m.bytes[f"layer{i}"] for i in range(cfg.num_layers)] == list(e["kept_gpu"].values())
    # with the indexer KL the kept inputs of its graph are in the estimate too (to within 10 %)
    cfg = cfg.replace(indexer_loss=True)
    model = _model(cfg).train()
    apply_plan(model, RECOMPUTE)
    m = meter_model_step(model, ids, labels)
    e = estimate(cfg, s, RECOMPUTE, act_bytes=4)
    got, want = m.bytes["layer3"], e["kept_gpu"]["layer 3 (D)"]
    assert abs(got - want) < 0.1 * got, (got, want)
    # offloaded blocks move from the GPU column to the host column
    e2 = estimate(cfg, s, MemoryPlan.from_dict({"recompute": "on", "offload": "2"}), act_bytes=4)
    assert list(e2["kept_host"].values()) == list(e["kept_gpu"].values())[:2]


def test_estimate_counts_what_the_offloader_moves_and_brings_back():
    """With every block offloaded, the estimate's host column per block is what the offloader moved for it
    (input, selection, kept attention output and lse), and an offloaded block's backward holds its own saved
    tensors back on the device plus the previous block's, prefetched: counting one block input for both
    leaves the D blocks' backward 9 GiB under the H200's peak at 256k (`bench/memory.py --peak`)."""
    cfg = _cfg(layer_pattern="KKDD", indexer_pattern="ffff")
    plan = MemoryPlan.from_dict({"recompute": "on", "offload": str(cfg.num_layers), "reuse_attention": True,
                                 "pin_memory": False})
    model = _model(cfg)
    ids, labels = _batch(cfg, b=1)
    apply_plan(model, plan)
    policy = RecomputePolicy(recompute=True, offload_layers=cfg.num_layers, reuse_selection=True, pin_memory=False,
                             force_offload=True, reuse_attention=True)
    policy.offloader.min_bytes = 0
    model.block_fn = policy
    out = model(ids, labels=labels, return_logits=False)
    off = policy.offloader
    moved = {g: sum(h.nbytes for h in off.groups[g]) for g in off.group_order}
    e = estimate(cfg, S, plan, act_bytes=4)
    assert list(e["kept_host"].values()) == [moved[i] for i in range(cfg.num_layers)]
    assert moved[3] > moved[1] > 0  # a DSA block also sends its selection, attention output and lse
    # host buffers of their exact size, pageable or page-locked (memory/host_buffers.py; GPU test: tests/memory/test_host_buffers_gpu.py)
    assert e["host_bytes"] == sum(moved.values()) == off.kept_bytes
    assert estimate(cfg, S, dataclasses.replace(plan, pin_memory=True), act_bytes=4)["host_bytes"] == e["host_bytes"]
    out.loss.backward()
    policy.end_step()
    # the peak phase is a block's backward; its working set names both of those terms
    assert e["peak_phase"].startswith("the backward of layer "), e["peak_phase"]
    i = int(e["peak_phase"].split("layer ")[1].split()[0])
    assert e["working"]["offloaded block's saved tensors (back on the GPU)"] == moved[i]
    assert e["working"].get("prefetched offload block", 0) == (moved[i - 1] if i > 0 else 0)


def test_estimate_counts_liger_mhc_post_res_backward():
    """liger's whole-sequence post-res Function (mhc_chunk 0) makes S x (nD x 8 + D x 6) bytes of fp32
    copies at the start of a block's backward (17.27 GiB measured at 256k for h200-ref on the H200); in
    chunks only one chunk's buffers. Only where liger runs."""
    cfg, S, G = preset("h200-ref"), 262144, 2**30
    n, D = cfg.hc_streams, cfg.hidden_size
    on = MemoryPlan.from_dict({"recompute": "on", "offload": "0", "seq_chunk": "off"})
    off = MemoryPlan.from_dict({"recompute": "on", "offload": "0", "seq_chunk": "off", "mhc_chunk": 0})
    from longctx.config.kernels import KernelConfig

    liger = {"mhc": "liger"}  # what kernels.planned says for h200-ref on a GPU under auto
    assert _mhc_stream_workspace(cfg, S, off, liger) == S * (n * D * 8 + D * 6)  # 14.25 GiB
    assert _mhc_stream_workspace(cfg, S, on, liger) < 1.5 * G
    assert _mhc_stream_workspace(cfg, S, off, {"mhc": "torch"}) == 0
    for gpu, impl in (("cpu", "auto"), ("h200", "torch")):
        kernels = KernelConfig(mhc=impl)
        assert estimate(cfg, S, on, 1, gpu, kernels=kernels)["gpu_bytes"] == \
            estimate(cfg, S, off, 1, gpu, kernels=kernels)["gpu_bytes"]
    e_on, e_off = (estimate(cfg, S, p, 1, "h200")["gpu_bytes"] for p in (on, off))
    assert 10 * G < e_off - e_on < 15 * G
    assert "mHC stream-op workspace (backward)" in estimate(cfg, S, off, 1, "h200")["working"]


def test_estimate_counts_the_autocast_cached_copies_not_the_experts():
    """Autocast caches a bf16 copy of each weight its casts see (linear layers) until its region ends;
    the experts are cast per call by the MoE and the embedding is indexed in fp32, so neither is
    cached. A sequence-chunked step runs in one autocast region, so the cached copies live through it.
    Counted here with LiveBytes after a no-grad forward (the forward sweep) under CPU autocast."""
    cfg = preset("tiny")
    assert "m" in cfg.mlp_kinds()
    torch.manual_seed(0)
    model = LongCtxModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16), LiveBytes() as live:
        with torch.no_grad():
            out = model(ids)
        del out
        cached = live.current
    est = estimate(cfg, 64, MemoryPlan(), gpu="cpu", _chunk="earlier")["static"]["bf16 weight copies"]
    every_weight = 2 * sum(p.numel() for p in model.parameters())
    assert abs(est - cached) <= 0.02 * cached, (est, cached)
    assert every_weight > 1.3 * cached  # counting every parameter would be far off


def test_chunked_estimate_counts_the_dsa_prefix_in_dsa_phases_and_both_chunk_cases():
    """The backward of a DSA block holds the prefix rows, their gradient and the fp32 dkv; a KDA block's
    does not. The last chunk (gradients created as it goes, the whole prefix) and the earlier chunks
    (every gradient, the prefix one chunk shorter) are both phases of the estimate."""
    cfg = preset("h200-ref")
    kinds = cfg.layer_kinds()
    plan = MemoryPlan.from_dict({"recompute": "on", "offload": "0", "seq_chunk": "off"})
    X = 3 * 2**30
    with_p = estimate(cfg, 131072, plan, gpu="h200", _chunk="earlier", _dsa_prefix=X)["phases_gpu_bytes"]
    without = estimate(cfg, 131072, plan, gpu="h200", _chunk="earlier")["phases_gpu_bytes"]
    for name in with_p:
        layer_kind = name.rsplit("(", 1)[-1].rstrip(")") if "backward of layer" in name else None
        extra = with_p[name] - without[name]
        assert abs(extra - (X if layer_kind == "D" else 0)) <= 1, (name, extra)
    assert "D" in kinds and "K" in kinds
    chunked = MemoryPlan.from_dict({"recompute": "on", "offload": "0", "seq_chunk": "131072"})
    e = estimate(cfg, 1048576, chunked, gpu="h200")
    names = list(e["phases_gpu_bytes"])
    assert any(n.startswith("last chunk: ") for n in names) and any(n.startswith("earlier chunks: ") for n in names)
    assert "the forward sweep" in names
    assert abs(e["gpu_bytes"] - max(e["phases_gpu_bytes"].values())) < 2**20  # the peak is the largest phase


def test_estimate_counts_the_kept_attention_once():
    """reuse_attention under block recompute: each DSA block keeps S x heads x (kv_lora x act bytes + 4)
    more, and the peak (a DSA block's backward) rises by that for every DSA block but the one whose
    recompute reuses it; in the sequence-chunked step the same per chunk."""
    cfg = preset("h200-ref")
    S = 131072
    base = MemoryPlan.from_dict({"recompute": "on", "offload": "0", "seq_chunk": "off", "reuse_attention": False})
    on = dataclasses.replace(base, reuse_attention=True)
    e0, e1 = estimate(cfg, S, base), estimate(cfg, S, on)
    per = S * cfg.attn_heads * (cfg.kv_lora_rank * 2 + 4)
    kinds = cfg.layer_kinds()
    for i, k in enumerate(kinds):
        name = f"layer {i} ({k})"
        assert e1["kept_gpu"][name] - e0["kept_gpu"][name] == (per if k == "D" else 0), name
    assert e1["peak_phase"] == e0["peak_phase"] == "the backward of layer 11 (D)"
    assert e1["gpu_bytes"] - e0["gpu_bytes"] == (kinds.count("D") - 1) * per
    chunked = MemoryPlan.from_dict({"recompute": "on", "offload": "0", "seq_chunk": str(S), "reuse_attention": False})
    c0, c1 = estimate(cfg, 4 * S, chunked), estimate(cfg, 4 * S, dataclasses.replace(chunked, reuse_attention=True))
    assert c1["gpu_bytes"] - c0["gpu_bytes"] == (kinds.count("D") - 1) * per
