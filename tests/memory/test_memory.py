"""The memory system (longctx.memory) on the CPU: recompute and offload change nothing but memory,
each block keeps only its input, every switch does what it says, the estimator agrees with the
meter and the CLI, and the GPU benchmark script still runs (at tiny sizes).

What a block keeps is measured with `SavedTensorMeter` (saved_tensors_hooks), transient peaks with
`LiveBytes` (a dispatch mode counting live storages); the expectations are computed independently,
from the tensors each block received."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longctx.config import preset
from longctx.errors import ConfigError
from longctx.layers.dsa import SparseMLA
from longctx.layers.kpool_indexer import KPoolIndexer
from longctx.layers.moe import MoE
from longctx.layers.residual import MHC
from longctx.memory.estimate import (
    ALLOCATOR_SLACK,
    GPU_FIT,
    auto_plan,
    estimate,
    plan_choices,
    whole_sequence_max,
    whole_sequence_warning,
    widest_activation,
)
from longctx.measure.meter import LiveBytes, SavedTensorMeter, meter_model_step
from longctx.memory.offload import Offloader
from longctx.memory.plan import MemoryPlan, apply_plan
from longctx.memory.recompute import RecomputePolicy, _flatten
from longctx.model import LongCtxModel

ROOT = Path(__file__).resolve().parents[2]
S, B = 64, 2
PLAIN = MemoryPlan.from_dict({"recompute": "off", "offload": "off"})
RECOMPUTE = MemoryPlan.from_dict({"recompute": "on", "offload": "off", "reuse_attention": False})  # full recompute: a block keeps its input
pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(residual="mhc", **kw):
    # layers K, D(full indexer), D(shared selection), D(full): every kind of block and selection hand-off
    base = {"residual": residual, "num_layers": 4, "layer_pattern": "KDDD", "indexer_pattern": "ffsf", "index_topk": 16}
    return preset("tiny").replace(**{**base, **kw})


def _model(cfg, seed=0):
    torch.manual_seed(seed)
    return LongCtxModel(cfg)


def _batch(cfg, seed=1, s=S, b=B):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (b, s), generator=g),
            torch.randint(0, cfg.vocab_size, (b, s), generator=g))


def _step(model, ids, labels, plan=None, policy=None, autocast=False):
    """One forward + backward; returns (loss, {name: grad})."""
    if plan is not None:
        apply_plan(model, plan)
    if policy is not None:
        model.block_fn = policy
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(ids, labels=labels, return_logits=False)
    out.loss.backward()
    model.clear_aux()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.block_fn = None
    return out.loss.detach(), grads


def _assert_same(ref, got, rtol=1e-5, atol=1e-7):
    (l0, g0), (l1, g1) = ref, got
    torch.testing.assert_close(l1, l0, rtol=rtol, atol=atol)
    assert set(g0) == set(g1), set(g0) ^ set(g1)
    assert len(g0) > 40  # every block's parameters took part
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=rtol, atol=atol, msg=lambda m, n=n: f"{n}: {m}")


def _nbytes(t):
    return t.untyped_storage().nbytes()


# ------------------------------------------------------------------ recompute: exact, keeps only inputs
@pytest.mark.parametrize("residual", ["mhc", "plain", "attnres"])
@pytest.mark.parametrize("reuse", [True, False])
def test_recompute_same_loss_and_grads_and_keeps_only_block_inputs(residual, reuse):
    cfg = _cfg(residual)
    model = _model(cfg)
    ids, labels = _batch(cfg)
    ref = _step(model, ids, labels, PLAIN)
    # full recompute alone (reuse_attention adds the attention output: test_reuse_attention_...)
    plan = MemoryPlan.from_dict({"recompute": "on", "offload": "off", "reuse_selection": reuse, "reuse_attention": False})
    _assert_same(ref, _step(model, ids, labels, plan))

    # What each block keeps, from the meter, against what it was given: its state, the incoming
    # selection on a shared layer, its own selection on a full layer with reuse (storages counted once).
    policy = apply_plan(model, plan)
    seen = {}

    def spy(block, state, selection, cu_seqlens):
        state_out, sel_out = policy(block, state, selection, cu_seqlens)
        kept = list(_flatten(state)[0])
        if block.kind == "D" and block.mixer.indexer is None:
            kept.append(selection)
        if block.kind == "D" and block.mixer.indexer is not None and reuse:
            kept.append(sel_out)
        seen[block.idx] = kept
        return state_out, sel_out

    model.block_fn = spy
    meter = meter_model_step(model, ids, labels)
    counted = set()
    sel_bytes = B * S * cfg.index_width() * 4
    for i in range(cfg.num_layers):
        want = 0
        for t in seen[i]:
            if t.untyped_storage().data_ptr() not in counted:
                counted.add(t.untyped_storage().data_ptr())
                want += _nbytes(t)
        assert meter.bytes[f"layer{i}"] == want, (i, dict(meter.bytes), want)
    if residual == "mhc":  # spelled out once: 4 streams x hidden fp32, + an int32 selection where kept
        state = B * S * cfg.hc_streams * cfg.hidden_size * 4
        extra = [0, sel_bytes, 0, sel_bytes] if reuse else [0, 0, sel_bytes, 0]
        assert [meter.bytes[f"layer{i}"] for i in range(4)] == [state + e for e in extra]
    apply_plan(model, PLAIN)
    full = meter_model_step(model, ids, labels)
    assert full.bytes["layer0"] > 8 * meter.bytes["layer0"]


def test_reuse_attention_same_grads_one_attention_forward_and_keeps_its_output():
    """memory.reuse_attention: block recompute keeps each DSA block's attention output and log-sum-exp
    and runs only the attention's backward (sparse_attention_bwd_torch on the CPU, the kernel's backward
    on CUDA). The loss and every gradient equal the plain step's; the attention forward runs once per
    DSA block, not twice; each DSA block keeps its output ([B, S, H, kv_lora] in the compute dtype) and
    an fp32 lse beside what reuse_selection keeps; the step log names the kept path; on by default, off
    in the baseline."""
    import longctx.ops.sparse_attention as sa

    cfg = _cfg()
    model = _model(cfg)
    ids, labels = _batch(cfg)
    ref = _step(model, ids, labels, PLAIN)
    plan = MemoryPlan.from_dict({"recompute": "on", "offload": "off", "reuse_attention": True})
    calls = []
    orig = sa.sparse_attention_torch
    sa.sparse_attention_torch = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        _assert_same(ref, _step(model, ids, labels, plan))
        n_kept = len(calls)
        assert "dsa:torch-sparse+kept x3" in model.impl_report()  # the recompute's, the last to run
        calls.clear()
        _step(model, ids, labels, RECOMPUTE)
        n_plain = len(calls)
    finally:
        sa.sparse_attention_torch = orig
    n_dsa = cfg.layer_kinds().count("D")
    assert n_kept == n_dsa and n_plain == 2 * n_dsa, (n_kept, n_plain)

    # what each block keeps: the meter, with and without the switch (mHC state in fp32, here no autocast)
    kept_bytes = {}
    for reuse in (False, True):
        apply_plan(model, MemoryPlan.from_dict({"recompute": "on", "offload": "off", "reuse_attention": reuse}))
        kept_bytes[reuse] = meter_model_step(model, ids, labels).bytes
    H, L = cfg.attn_heads, cfg.kv_lora_rank
    for i, kind in enumerate(cfg.layer_kinds()):
        extra = B * S * H * (L * 4 + 4) if kind == "D" else 0  # fp32 model: o in fp32, lse fp32
        assert kept_bytes[True][f"layer{i}"] - kept_bytes[False][f"layer{i}"] == extra, (i, kept_bytes)
    assert MemoryPlan().reuse_attention and not MemoryPlan.baseline().reuse_attention
    apply_plan(model, PLAIN)


def test_kept_attention_backward_twin_matches_autograd():
    """sparse_attention_bwd_torch (the twin of the kernel's backward, from the forward's o and lse)
    against autograd through the forward twin, fp64: padded (-1) slots, a query with none, repeated
    indices, two sequences, chunks that do not divide S."""
    from longctx.ops.sparse_attention import sparse_attention_bwd_torch, sparse_attention_torch

    g = torch.Generator().manual_seed(0)
    Bq, Sq, H, D, K = 2, 37, 3, 16, 9
    q = torch.randn(Bq, Sq, H, D, dtype=torch.float64, generator=g).requires_grad_(True)
    kv = torch.randn(Bq, Sq, D, dtype=torch.float64, generator=g).requires_grad_(True)
    idx = torch.randint(-1, Sq, (Bq, Sq, K), generator=g, dtype=torch.int32)
    idx[0, 3] = -1
    idx[1, 5, :4] = 7
    o, lse = sparse_attention_torch(q, kv, idx, 0.3, chunk=8, return_lse=True)
    do = torch.randn(o.shape, dtype=torch.float64, generator=g)
    o.backward(do)
    dq, dkv = sparse_attention_bwd_torch(q.detach(), kv.detach(), idx, o.detach(), lse.detach(), do, 0.3, chunk=5)
    torch.testing.assert_close(dq, q.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dkv, kv.grad, rtol=1e-12, atol=1e-12)
    assert dq[0, 3].abs().max() == 0


def test_kda_blocks_pass_the_selection_on_without_keeping_it():
    # K D K D with indexer "fs": the K block between the full and the shared layer must hand the
    # selection on; without reuse only the shared layer keeps it (once).
    cfg = _cfg(layer_pattern="KDKD", indexer_pattern="ffss")
    model = _model(cfg)
    ids, labels = _batch(cfg)
    ref = _step(model, ids, labels, PLAIN)
    plan = MemoryPlan.from_dict({"recompute": "on", "offload": "off", "reuse_selection": False, "reuse_attention": False})
    _assert_same(ref, _step(model, ids, labels, plan))
    apply_plan(model, plan)
    m = meter_model_step(model, ids, labels)
    state = B * S * cfg.hc_streams * cfg.hidden_size * 4
    assert [m.bytes[f"layer{i}"] for i in range(4)] == [state, state, state, state + B * S * cfg.index_width() * 4]


def test_recompute_redoes_blocks_under_the_forward_autocast():
    # Backward runs outside the caller's autocast; a recompute that forgot it would redo the block in
    # fp32 and give different (bf16-rounding-sized) gradients.
    cfg = _cfg()
    model = _model(cfg)
    ids, labels = _batch(cfg)
    ref = _step(model, ids, labels, PLAIN, autocast=True)
    _assert_same(ref, _step(model, ids, labels, RECOMPUTE, autocast=True), rtol=1e-6, atol=1e-8)


def test_indexer_kl_under_recompute():
    # The KL is computed once, in the first forward, and trains the indexer the same way.
    cfg = _cfg(indexer_loss=True)
    model = _model(cfg)
    ids, labels = _batch(cfg)
    model.train()
    ref = _step(model, ids, labels, PLAIN)
    _assert_same(ref, _step(model, ids, labels, MemoryPlan.from_dict(
        {"recompute": "on", "offload": "off", "reuse_selection": False})))
    assert any("indexer" in n for n in ref[1])


def test_aux_balancer_with_recompute_is_refused():
    model = _model(_cfg(balancer="aux"))
    with pytest.raises(ConfigError, match="memory.recompute"):
        apply_plan(model, RECOMPUTE)
    apply_plan(model, PLAIN)  # without recompute it is fine


# ------------------------------------------------------------------ offload (logic path on the CPU)
class _CheckedOffloader(Offloader):
    """Asserts the prefetch: once a tensor of block i is back, all of block i-1's are on their way."""

    def unpack(self, h):
        group = getattr(h, "group", None)
        out = super().unpack(h)
        if group is not None:
            pos = self.group_order.index(group)
            if pos > 0:
                for prev in self.groups[self.group_order[pos - 1]]:
                    assert self.handles[prev.index] is None or prev.gpu is not None, "previous block not prefetched"
        return out


@pytest.mark.parametrize("residual,reuse_attention", [("mhc", False), ("attnres", False), ("mhc", True)])
def test_offload_forced_on_cpu(residual, reuse_attention):
    """reuse_attention: the kept attention output and lse go to the host with the block's input and come
    back for its recompute (same gradients, more bytes offloaded)."""
    cfg = _cfg(residual)
    model = _model(cfg)
    ids, labels = _batch(cfg)
    ref = _step(model, ids, labels, PLAIN)
    policy = RecomputePolicy(recompute=True, offload_layers=3, reuse_selection=True, pin_memory=False, force_offload=True,
                             reuse_attention=reuse_attention)
    policy.offloader = off = _CheckedOffloader(pin_memory=False, min_bytes=0, force=True)
    calls = []
    fetch = off._fetch
    off._fetch = lambda h: (calls.append(h.group), fetch(h))[1]

    apply_plan(model, RECOMPUTE)
    model.block_fn = policy
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=labels, return_logits=False)
    # blocks 0..2 offloaded, block 3 kept on the device
    assert off.group_order == [0, 1, 2]
    n = off.live_handles()
    assert n == len(off.handles) >= 3 + 1 + 2 * reuse_attention  # states, layer 1's selection (and o, lse)
    sizes = sorted(h.nbytes for h in off.handles)
    # layers 1 and 2 (DSA, offloaded) hand their fp32 lse (and o) to the host too, and only with the switch
    assert sizes.count(B * S * cfg.attn_heads * 4) == (2 if reuse_attention else 0), sizes
    assert off.bytes_offloaded == off._live_host == sum(h.nbytes for h in off.handles) > 0
    out.loss.backward()
    got = (out.loss.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None})
    model.block_fn = None
    _assert_same(ref, got)
    assert off.live_handles() == 0 and off._live_host == 0  # every handle consumed once
    assert calls[0] == 2 and sorted(set(calls)) == [0, 1, 2]  # backward fetched from the last block down
    assert off.peak_host_bytes == off.bytes_offloaded
    policy.end_step()
    assert off.handles == [] and off.groups == {} and off.group_order == []


def _offloading(model, release: bool):
    """Recompute with 3 blocks offloaded into plain host buffers (force: CPU tensors are copied too)."""
    apply_plan(model, RECOMPUTE)
    policy = RecomputePolicy(offload_layers=3, force_offload=True, pin_memory=False, keep_pinned=not release)
    policy.offloader.min_bytes = 0
    model.block_fn = policy
    return policy, policy.offloader


@pytest.mark.parametrize("release", [True, False])
def test_offload_keeps_its_buffers_across_steps_with_keep_pinned(release):
    """keep_pinned: the second step packs into the very buffers of the first (no new
    page-locking, host memory flat), and its gradients are still the plain step's; on (the default),
    nothing is kept between steps."""
    cfg = _cfg()
    model = _model(cfg)
    ids, labels = _batch(cfg)
    ref = _step(model, ids, labels, PLAIN)
    policy, off = _offloading(model, release)
    ptrs = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=labels, return_logits=False)
        ptrs.append(sorted(h.host.data_ptr() for h in off.handles))
        out.loss.backward()
        got = (out.loss.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None})
        _assert_same(ref, got)
        policy.end_step()
    model.block_fn = None
    kept = sum(b.numel() for bufs in off._pool.values() for b in bufs)
    if release:
        assert kept == 0 and off.kept_bytes == 0
    else:
        assert ptrs[0] == ptrs[1] and kept == off.kept_bytes == off.bytes_offloaded // 2 > 0
    policy.close()
    assert off._pool == {} and off.kept_bytes == 0


def test_kept_buffers_never_exceed_one_steps_worth():
    """keep_pinned with step sizes that change (another sequence length): buffers the step did
    not take are handed back at its end, so the pool is at most the last step's offload, not a union."""
    cfg = _cfg()
    model = _model(cfg)
    policy, off = _offloading(model, release=False)
    per_step = []
    for s in (S, S // 2, S // 2):
        ids, labels = _batch(cfg, s=s)
        before = off.bytes_offloaded
        model.zero_grad(set_to_none=True)
        model(ids, labels=labels, return_logits=False).loss.backward()
        policy.end_step()
        per_step.append(off.bytes_offloaded - before)
        kept = sum(b.numel() for bufs in off._pool.values() for b in bufs)
        assert kept == off.kept_bytes == per_step[-1], (s, kept, off.kept_bytes, per_step)
    model.block_fn = None
    assert per_step[0] > per_step[1] == per_step[2]
    policy.close()


def test_offload_refuses_a_second_backward():
    cfg = _cfg()
    model = _model(cfg)
    ids, labels = _batch(cfg)
    apply_plan(model, RECOMPUTE)
    policy = RecomputePolicy(offload_layers=4, force_offload=True, pin_memory=False)
    policy.offloader.min_bytes = 0
    model.block_fn = policy
    loss = model(ids, labels=labels, return_logits=False).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="unpacked twice"):
        loss.backward()
    policy.end_step()
    model.block_fn = None


# ------------------------------------------------------------------ the other switches
def test_rms_norm_keeps_its_input_and_one_rstd_per_row():
    """norms._RMSNormFn: the plain-autograd arithmetic op for op in forward (bit-identical outputs), but
    only x (its own dtype) and an fp32 rstd per row kept for backward (plain autograd: 6 bytes per
    element of a bf16 x, here 2); gradients as plain autograd's in fp32, and nearer fp64's in bf16
    (plain autograd rounds the normalised rows' gradient to bf16 on the way)."""
    from longctx.layers.norms import RMSNorm, rms_norm_plain

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
    """mlp._ClampedSwiGLU: plain autograd's ops forward and backward (outputs and gradients
    bit-identical, values on the clamp bounds included), but only gate and up kept for backward (one
    storage where they are views of the experts' [2I] projection: 2 rows of the width, plain autograd 5)."""
    from longctx.layers.mlp import clamped_swiglu, clamped_swiglu_packed, clamped_swiglu_plain

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


def test_mhc_cast_recompute_keeps_no_fp32_copy():
    cfg = _cfg(layer_pattern="KKKK", mlp_pattern="d")
    model = _model(cfg).to(torch.bfloat16)  # bf16 streams: the projection's .float() is a real copy
    ids, labels = _batch(cfg)
    fp32_copy = (B, S, cfg.hc_streams * cfg.hidden_size)
    for on in (True, False):
        apply_plan(model, MemoryPlan.from_dict({"recompute": "off", "offload": "off", "mhc_cast_recompute": on}))
        m = meter_model_step(model, ids, labels)
        for i in range(cfg.num_layers):
            copies = [s for s, dt in m.shapes[f"layer{i}"] if dt == "float32" and s == fp32_copy]
            assert len(copies) == (0 if on else 2), (on, i, copies)  # two mHC connections per block
        if on:
            fp32_on = sum(m.by_dtype[f"layer{i}"]["float32"] for i in range(cfg.num_layers))
        else:
            fp32_off = sum(m.by_dtype[f"layer{i}"]["float32"] for i in range(cfg.num_layers))
    assert fp32_off - fp32_on >= 2 * cfg.num_layers * B * S * cfg.hc_streams * cfg.hidden_size * 4


def _module_tensors(mod):
    """Tensors held in a module's plain attributes (not parameters, buffers or submodules)."""
    found = []

    def walk(v, name):
        if isinstance(v, torch.Tensor):
            found.append((name, v))
        elif isinstance(v, (list, tuple)):
            for j, x in enumerate(v):
                walk(x, f"{name}[{j}]")
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{name}.{k}")

    for k, v in vars(mod).items():
        if k not in ("_parameters", "_buffers", "_modules"):
            walk(v, k)
    return found


@pytest.mark.parametrize("recompute", ["off", "on"])
def test_router_release(recompute):
    cfg = _cfg()
    model = _model(cfg).train()
    ids, labels = _batch(cfg)
    for release in (True, False):
        apply_plan(model, MemoryPlan.from_dict({"recompute": recompute, "offload": "off", "router_release": release}))
        loss = model(ids, labels=labels, return_logits=False).loss
        moes = [m for m in model.modules() if isinstance(m, MoE)]
        assert moes
        for m in moes:
            big = [(n, tuple(t.shape)) for sub in m.modules() for n, t in _module_tensors(sub)
                   if t.numel() > cfg.n_routed_experts]
            if release:  # only per-expert statistics (load, pending bias) survive the forward
                assert big == [], big
            else:
                assert any(n.startswith("router_state") and B * S in shape for n, shape in big), big
        loss.backward()
        model.block_fn = None


def test_plan_from_dict_errors_name_the_setting():
    bad = [({"recompute": "full"}, "memory.recompute"), ({"offload": "some"}, "memory.offload"),
           ({"offload": True}, "memory.offload"), ({"indexer_chunk": 0}, "memory.indexer_chunk"),
           ({"attn_chunk": -3}, "memory.attn_chunk"), ({"moe_chunk": -1}, "memory.moe_chunk"),
           ({"mhc_chunk": -1}, "memory.mhc_chunk"),
           ({"pin_memory": "yes"}, "memory.pin_memory"), ({"loss_chunk": 1.5}, "memory.loss_chunk"),
           ({"recompte": "on"}, "memory.recompte")]
    for d, name in bad:
        with pytest.raises(ConfigError) as e:
            MemoryPlan.from_dict(d)
        msg = str(e.value)
        assert name in msg and "\n" not in msg, (d, msg)
    assert "did you mean recompute" in _err({"recompte": "on"})
    assert MemoryPlan.from_dict({"offload": 3}).offload_blocks() == 3
    assert MemoryPlan.from_dict({"baseline": True, "sparse_kernel": True}).sparse_kernel is True


def _err(d):
    try:
        MemoryPlan.from_dict(d)
    except ConfigError as e:
        return str(e)
    return ""


def test_baseline_is_all_off_and_apply_plan_sets_the_modules():
    b = MemoryPlan.baseline()
    assert MemoryPlan.from_dict({"baseline": True}) == b
    d = b.to_dict()
    assert [k for k, v in d.items() if v is True] == []
    assert (b.recompute, b.offload, b.moe_chunk, b.loss_chunk, b.mhc_chunk) == ("off", "off", 0, 0, 0)
    assert all(v is True for v in MemoryPlan().to_dict().values() if isinstance(v, bool))  # every switch on by default

    model = _model(_cfg())
    assert apply_plan(model, b) is None and model.block_fn is None
    dsa = [m for m in model.modules() if isinstance(m, SparseMLA)]
    assert [m.attn_impl for m in dsa] == ["dense"] * 3
    assert [m.indexer.chunk for m in dsa if m.indexer is not None] == [None, None]
    for m in model.modules():
        if isinstance(m, MoE):
            assert (m.chunk_tokens, m.combine_dtype, m.release_router_state) == (None, torch.float32, False)
        if isinstance(m, MHC):
            assert m.recompute_cast is False and m.liger_chunk == 0
    assert model.loss_chunk is None

    full = MemoryPlan.from_dict({"recompute": "on", "offload": "2", "indexer_chunk": 64, "moe_chunk": 32, "loss_chunk": 16})
    policy = apply_plan(model, full)
    assert model.block_fn is policy and policy.offload_layers == 2 and policy.reuse_selection
    assert [m.attn_impl for m in dsa] == ["sparse"] * 3
    assert [m.indexer.chunk for m in dsa if m.indexer is not None] == [64, 64]
    assert {m.chunk_tokens for m in model.modules() if isinstance(m, MoE)} == {32}
    assert {m.liger_chunk for m in model.modules() if isinstance(m, MHC)} == {MemoryPlan().mhc_chunk} == {16384}
    assert model.loss_chunk == 16
    with pytest.raises(ValueError, match="resolved plan"):
        apply_plan(model, MemoryPlan())


# ------------------------------------------------------------------ chunked indexer: O(S) not O(S^2)
def test_chunked_indexer_peak_is_linear_unchunked_quadratic():
    cfg = preset("tiny")
    torch.manual_seed(0)
    ix = KPoolIndexer(cfg, 3)
    peaks = {128: [], None: []}
    for s in (512, 1024, 2048):
        x, q = torch.randn(1, s, cfg.hidden_size), torch.randn(1, s, cfg.q_lora_rank)
        sels = []
        for chunk, got in peaks.items():
            with LiveBytes() as lb:
                sels.append(ix.select(x, q, chunk=chunk))
            got.append(lb.peak)
        assert torch.equal(sels[0], sels[1])
        del sels
    lin = [b / a for a, b in itertools.pairwise(peaks[128])]
    quad = [b / a for a, b in itertools.pairwise(peaks[None])]
    assert all(1.6 < r < 2.4 for r in lin), (peaks, lin)
    assert all(3.3 < r < 4.6 for r in quad), (peaks, quad)
    assert peaks[None][-1] > 5 * peaks[128][-1]


def test_live_bytes_counts_storages_and_frees():
    with LiveBytes() as lb:
        a = torch.ones(1000)  # 4000 bytes
        v = a[:10] + 0  # a new 40-byte storage
        w = a.view(10, 100)  # a view: nothing new
        del a, w
        b = torch.zeros(500)  # the next op sees a's storage gone
        assert lb.current == 40 + 2000
    assert lb.peak == 4040
    with pytest.raises(torch.OutOfMemoryError), LiveBytes(limit=1000):
        torch.ones(1000)
    del v, b


# ------------------------------------------------------------------ the estimator and its CLI
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
    tensors back on the device plus the previous block's, prefetched: the H200 at 256k (call 51) measured
    the D blocks' backward 9 GiB over an estimate that counted one block input for both."""
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
    # host buffers of their exact size, pageable or page-locked (memory/host_buffers.py; GPU test: test_gpu_host_buffers.py)
    assert e["host_bytes"] == sum(moved.values()) == off.kept_bytes
    assert estimate(cfg, S, dataclasses.replace(plan, pin_memory=True), act_bytes=4)["host_bytes"] == e["host_bytes"]
    out.loss.backward()
    policy.end_step()
    # the peak phase is a block's backward; its working set names both of those terms
    assert e["peak_phase"].startswith("the backward of layer "), e["peak_phase"]
    i = int(e["peak_phase"].split("layer ")[1].split()[0])
    assert e["working"]["offloaded block's saved tensors (back on the GPU)"] == moved[i]
    assert e["working"].get("prefetched offload block", 0) == (moved[i - 1] if i > 0 else 0)


def test_estimate_monotone_and_baseline_far_below_full_plan():
    cfg = preset("h200-ref")
    lens = [2**k for k in range(12, 22)]
    for plan in (MemoryPlan.baseline(), MemoryPlan.from_dict({"recompute": "on", "offload": "0"}),
                 MemoryPlan.from_dict({"recompute": "off", "offload": "off"})):
        gb = [estimate(cfg, s, plan)["gpu_bytes"] for s in lens]
        assert all(b > a for a, b in itertools.pairwise(gb)), (plan.describe(), gb)

    def max_len(fits):
        best, s = 0, 4096
        while s <= 2**24 and fits(s):
            best, s = s, 2 * s
        return best

    base = max_len(lambda s: estimate(cfg, s, MemoryPlan.baseline())["fits"])
    full = max_len(lambda s: auto_plan(cfg, s, MemoryPlan())[1]["fits"])
    assert 4096 <= base and full >= 8 * base, (base, full)
    # auto picks the cheapest plan that fits: no recompute at 8k, recompute (+ offload) when needed
    assert auto_plan(cfg, 8192, MemoryPlan())[0].recompute == "off"
    p, e = auto_plan(cfg, full, MemoryPlan())
    assert p.recompute == "on" and e["fits"] and e["gpu_reserved_bytes"] <= GPU_FIT * e["gpu_capacity"]
    # the estimate is of the allocated peak; the fit rule adds the allocator's slack on top
    assert abs(e["gpu_reserved_bytes"] - ALLOCATOR_SLACK * e["gpu_bytes"]) <= 1
    big = estimate(cfg, 2 * full, p)
    assert not big["fits"] and big["gpu_reserved_bytes"] > GPU_FIT * big["gpu_capacity"]


def test_plan_choices_give_up_reuse_attention_after_offload_and_before_chunking():
    """The auto plan's order for the one switch that trades memory for speed: every whole-sequence choice
    keeping the attention output (no recompute, recompute, + offload of 1, 2, ... blocks), then the same
    without it, then the chunk lengths, each with it and then without. Forced off, it stays off."""
    cfg = preset("h200-ref")
    got = [(c.recompute, c.offload, c.seq_chunk, c.reuse_attention) for c in plan_choices(cfg, 131072, MemoryPlan())]
    blocks = [("on", str(i), "off") for i in range(cfg.num_layers + 1)]
    chunks = [("on", "0", str(c)) for c in (65536, 32768, 16384, 8192, 4096, 2048, 1024)]
    assert got == ([("off", "0", "off", True)] + [(*b, True) for b in blocks] + [(*b, False) for b in blocks]
                   + [(*c, r) for c in chunks for r in (True, False)])
    off = plan_choices(cfg, 131072, MemoryPlan.from_dict({"reuse_attention": False}))
    assert not any(c.reuse_attention for c in off) and len(off) == 1 + len(blocks) + len(chunks)
    p = auto_plan(cfg, 131072, MemoryPlan())[0]
    assert (p.recompute, p.offload_blocks(), p.reuse_attention) == ("on", 0, True)


def test_auto_plan_keeps_whole_sequence_tensors_within_int32_elements():
    """Past 2^31 elements in its widest activation the whole-sequence step is not a choice (calls 41-42: the
    524,288-token step of h200-ref stopped with an illegal memory access); the chunked step is, with chunks
    within the same bound. h200-ref's widest: a dense MLP's [gate | up] and a DSA layer's absorbed queries,
    8,192 elements a token, so 262,144 tokens (measured to run) is the last whole-sequence length."""
    cfg = preset("h200-ref")
    assert widest_activation(cfg) == 8192 and whole_sequence_max(cfg) == 262144
    assert all(not c.seq_chunk_tokens() or c.seq_chunk_tokens() <= 131072 for c in plan_choices(cfg, 262144, MemoryPlan()))
    assert any(not c.seq_chunk_tokens() for c in plan_choices(cfg, 262144, MemoryPlan()))
    for S in (262145, 327680, 524288):
        choices = plan_choices(cfg, S, MemoryPlan())
        assert choices and all(0 < c.seq_chunk_tokens() <= 131072 for c in choices), S
        assert auto_plan(cfg, S, MemoryPlan())[1]["fits"]
    # split over 2 GPUs the local length is what counts; a forced whole-sequence plan is the user's
    assert any(not c.seq_chunk_tokens() for c in plan_choices(cfg, 524288, MemoryPlan(), cp=2))
    forced = plan_choices(cfg, 524288, MemoryPlan.from_dict({"seq_chunk": "off"}))
    assert forced and all(c.seq_chunk == "off" for c in forced)
    # ... and the trainer tells them (on CUDA)
    assert "memory.seq_chunk=auto" in whole_sequence_warning(cfg, 524288, forced[0])
    assert whole_sequence_warning(cfg, 262144, forced[0]) is None
    assert whole_sequence_warning(cfg, 524288, auto_plan(cfg, 524288, MemoryPlan())[0]) is None


def test_estimate_cli():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "longctx", "estimate", "--preset", "h200-ref", "--seq-len", "1048576"],
                       check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode in (0, 1), r.stderr
    for word in ("static", "kept for backward", "working set", "GPU peak", "verdict:"):
        assert word in r.stdout, r.stdout
    verdict = r.stdout.strip().splitlines()[-1]
    assert r.returncode == (0 if verdict == "verdict: fits" else 1), (r.returncode, verdict)


@pytest.mark.parametrize("argv,needle", [
    (["--seq-len", "0"], "--seq-len"),
    (["--set", "recompte=on"], "memory.recompte"), (["--set", "offload"], "--set"),
    (["--gpu", "tpu"], "--gpu"), (["--cp", "0"], "--cp"), (["--preset", "huge"], "preset"),
    (["--set", "mhc_chunk=-3"], "memory.mhc_chunk")])
def test_estimate_cli_bad_input(argv, needle, capsys):
    from longctx.cli import main

    assert main(["estimate", "--seq-len", "4096", *argv]) == 2  # what `python -m longctx` exits with
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err


def test_estimate_cli_json(capsys):
    from longctx.cli import main

    rc = main(["estimate", "--preset", "tiny", "--seq-len", "4096", "--json", "--set", "recompute=on"])
    e = json.loads(capsys.readouterr().out)
    assert rc == 0 and e["fits"] and e["plan"]["recompute"] == "on" and e["seq_len"] == 4096
    # --phases: every phase of the step with its total, the peak marked on the largest (the GPU peak)
    assert main(["estimate", "--preset", "h200-ref", "--seq-len", "1048576", "--phases"]) == 0
    text = capsys.readouterr().out
    marked = [ln for ln in text.splitlines() if ln.endswith("<- peak")]
    gpu_peak = next(ln for ln in text.splitlines() if ln.startswith("GPU peak, allocated")).split()[-1]
    assert len(marked) == 1 and marked[0].split()[-3] == gpu_peak, (marked, gpu_peak)
    assert "last chunk: the backward of layer 11 (D)" in text and "the forward sweep" in text

    def peak(*argv):
        assert main(["estimate", "--seq-len", "262144", "--json", "--set", "recompute=on", "--set", "offload=0", *argv]) == 0
        return json.loads(capsys.readouterr().out)["gpu_bytes"]

    # liger's whole-sequence mHC Functions only cost where liger runs: --residual-impl follows the training setting
    assert peak("--set", "mhc_chunk=0", "--residual-impl", "liger") > peak("--set", "mhc_chunk=0", "--residual-impl", "torch") \
        == peak("--residual-impl", "torch")


# ------------------------------------------------------------------ the GPU benchmark, smoke-run on the CPU
def test_bench_memory_cpu_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "bench" / "memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # the flag's own lengths (256, 1024) with one switch off: every part and code path in a dozen steps
    argv = ["--cpu-smoke", "--out", str(tmp_path), "--quiet", "--configs", "recompute_off",
            "--host-steps", "2"]
    assert bench.main(argv) == 0
    res = json.loads((tmp_path / "memory.json").read_text())
    assert (tmp_path / "memory.png").stat().st_size > 1000
    assert res["device"] == "cpu" and res["preset"] == "tiny" and res["command"] and res["date"]
    runs = res["runs"]
    names = {r["config"] for r in runs}
    assert names == {"all_on", "recompute_off"}
    assert {r["seq_len"] for r in runs} == {256, 1024}
    ok = [r for r in runs if r["status"] == "ok"]
    assert ok and all(r["peak_allocated_gib"] > 0 and r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["mfu"] > 0
                      and r["estimate_gib"] > 0 for r in ok)
    assert any(r["status"] == "oom" for r in runs)  # the smoke capacity makes the plain configs run out
    assert any(r["status"] == "same_as_all_on" for r in runs)  # 256 tokens fit without recompute
    assert all(r["status"] in ("ok", "oom", "same_as_all_on", "skipped_after_oom") for r in runs)
    bl = res["baseline_max_context"]
    assert bl["max_ok"] is not None and bl["attempts"][-1]["status"] == "oom"
    off = res["offload_pinned_vs_pageable"]
    assert off["pinned"]["status"] == "ok" and off["pageable"]["status"] == "ok"
    assert off["pinned"]["offloaded_gib"] > 0  # the smoke forces the offloader to copy CPU tensors
    assert set(off["step_over_no_offload"]) == {"pinned", "pinned_kept", "pageable"}
    host = res["host_memory_with_offload"]
    assert len(host["rss_gib"]) == host["steps"] == 2 and host["status"] == "ok"
    # a second invocation with --resume keeps what is there and measures nothing again
    before = json.loads((tmp_path / "memory.json").read_text())
    assert bench.main([*argv, "--resume", "--parts", "runs"]) == 0
    after = json.loads((tmp_path / "memory.json").read_text())
    assert after["runs"] == before["runs"] and after["baseline_max_context"] == bl
    # the peak timeline of one offloaded step: where its maximum was reached, counted by LiveBytes here
    assert bench.main([*argv, "--resume", "--parts", "none", "--no-warmup", "--peak", "1024:offload_all"]) == 0
    pk = json.loads((tmp_path / "memory.json").read_text())["peaks"]["1024:offload_all"]
    labels = [m[0] for m in pk["marks"]]
    assert "fwd start layers.0" in labels and "recompute start layers.0.mixer" in labels and "bwd end layers.0" in labels
    assert pk["peak_between"][1] in labels and abs(max(m[2] for m in pk["marks"]) - pk["peak_allocated_gib"]) < 1e-3
    assert "reached after" in (tmp_path / "peak_1024_offload_all.txt").read_text()
    # each phase's own peak (the counter restarts at every mark), beside the estimate's phase of that name
    ph = pk["phases_gib"]
    assert abs(max(ph.values()) - pk["peak_allocated_gib"]) < 1e-6 and "the backward of layer 0 (K)" in ph
    assert "the backward of layer 0 (K)" in (tmp_path / "peak_1024_offload_all.txt").read_text().split("phase")[-1]
    # --plan fixes settings before the automatic plan resolves the rest (the 512k crash's plan, calls 41-42)
    fixed = tmp_path / "fixed"
    assert bench.main(["--cpu-smoke", "--out", str(fixed), "--quiet", "--parts", "runs", "--seqlens", "256",
                       "--no-warmup", "--plan", "recompute=on", "offload=1", "reuse_attention=false"]) == 0
    plan = json.loads((fixed / "memory.json").read_text())["runs"][0]["plan"]
    assert (plan["recompute"], plan["offload"], plan["reuse_attention"]) == ("on", "1", False)
    assert bench.main(["--cpu-smoke", "--out", str(fixed), "--plan", "recompte=on"]) == 2
    assert bench.main(["--cpu-smoke", "--out", str(fixed), "--plan", "offload"]) == 2


def test_bench_memory_records_a_cuda_error_and_stops(tmp_path, monkeypatch):
    """A kernel fault (calls 41-42: an illegal memory access at 512k) is a recorded run, "cuda_error" with its
    message, and the invocation stops there (the CUDA context is unusable), not a traceback that loses it."""
    spec = importlib.util.spec_from_file_location("bench_memory_err", ROOT / "bench" / "memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    real = bench.Bench._one_step

    def faulting(self, policy, ids, labels):
        if ids.shape[-1] >= 1024:
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        return real(self, policy, ids, labels)

    monkeypatch.setattr(bench.Bench, "_one_step", faulting)
    argv = ["--cpu-smoke", "--out", str(tmp_path), "--quiet", "--parts", "runs", "--configs", "all_on,loss_chunk_off",
            "--no-warmup"]
    with pytest.raises(SystemExit, match="illegal memory access"):
        bench.main(argv)
    runs = json.loads((tmp_path / "memory.json").read_text())["runs"]
    assert [(r["config"], r["seq_len"], r["status"]) for r in runs][-1] == ("all_on", 1024, "cuda_error")
    assert "illegal memory access" in runs[-1]["error"] and all(r["status"] != "cuda_error" for r in runs[:-1])


def test_release_pinned_names_its_successor():
    """The old switch (pinned blocks handed back every step) is keep_pinned's inverse now: a config that
    still sets it hears the new name and the value that means the same."""
    with pytest.raises(ConfigError, match=r"memory.release_pinned is now memory.keep_pinned .*keep_pinned = false"):
        MemoryPlan.from_dict({"release_pinned": True})
    assert MemoryPlan().keep_pinned and not MemoryPlan.baseline().keep_pinned


def test_estimate_counts_liger_mhc_post_res_backward():
    """liger's whole-sequence post-res Function (mhc_chunk 0) makes S x (nD x 8 + D x 6) bytes of fp32
    copies at the start of a block's backward (measured 17.27 GiB at 256k, h200-ref: the estimate's
    excess before it knew them); in chunks only one chunk's buffers. Only where liger runs."""
    from longctx.memory.estimate import _mhc_stream_workspace

    cfg, S, G = preset("h200-ref"), 262144, 2**30
    n, D = cfg.hc_streams, cfg.hidden_size
    on = MemoryPlan.from_dict({"recompute": "on", "offload": "0", "seq_chunk": "off"})
    off = MemoryPlan.from_dict({"recompute": "on", "offload": "0", "seq_chunk": "off", "mhc_chunk": 0})
    assert _mhc_stream_workspace(cfg, S, off, "h200", "auto") == S * (n * D * 8 + D * 6)  # 14.25 GiB
    assert _mhc_stream_workspace(cfg, S, on, "h200", "auto") < 1.5 * G
    for gpu, impl in (("cpu", "auto"), ("h200", "torch")):
        assert _mhc_stream_workspace(cfg, S, off, gpu, impl) == 0
        assert estimate(cfg, S, on, 1, gpu, residual_impl=impl)["gpu_bytes"] == \
            estimate(cfg, S, off, 1, gpu, residual_impl=impl)["gpu_bytes"]
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
    assert every_weight > 1.3 * cached  # the count it replaced (all parameters) is far off


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
