"""The sequence-chunked step (longctx/memory/sequence_chunks.py): the same loss and gradients as
the whole-sequence step, activations that do not grow with S, and the plan/estimator/trainer wiring."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from longctx.config import preset
from longctx.errors import ConfigError
from longctx.layers.moe import MoE
from longctx.memory.planner import auto_plan
from longctx.measure.meter import LiveBytes
from longctx.memory.plan import MemoryPlan, apply_plan
from longctx.memory.sequence_chunks import SequenceChunker
from longctx.model import LongCtxModel

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(residual="mhc", dtype=torch.float64, **kw):
    # 16 indexer heads: an all-zero (tied) pool score is then practically impossible, so the
    # decoding-path selection of the forward sweep equals the whole-sequence one exactly.
    cfg = dataclasses.replace(preset("tiny"), index_heads=16, residual=residual, **kw)
    torch.manual_seed(0)
    return LongCtxModel(cfg).to(dtype).train()


def _batch(cfg, S=70, B=2):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    y = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    y[0, 5] = y[-1, 40:44] = -100
    return x, y


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("residual", ["mhc", "plain"])
@pytest.mark.parametrize("chunk,ckpt", [(16, True), (23, False), (8, True), (70, True), (16, 2)])
def test_same_loss_and_grads_as_the_whole_sequence(residual, chunk, ckpt):
    m = _model(residual)
    x, y = _batch(m.cfg)
    out = m(x, labels=y)
    out.loss.backward()
    ref, ref_loss = _grads(m), out.lm_loss.item()
    m.zero_grad(set_to_none=True)
    got = SequenceChunker(chunk, checkpoint_blocks=ckpt).forward_backward(m, x, y)
    g = _grads(m)
    assert g.keys() == ref.keys()
    assert abs(got.lm_loss.item() - ref_loss) <= 1e-6 * abs(ref_loss)
    # fp64 model; mHC coefficients, the router and the loss compute in fp32 by design, and the
    # chunks sum their contributions in another order: ~1e-7 relative, not 1e-15.
    for n in ref:
        err = (g[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30)
        assert err < 1e-5, (n, err.item())
    assert torch.allclose(got.token_losses, m(x, labels=y, token_losses=True).token_losses, atol=1e-6)


@pytest.mark.parametrize("indexer_loss", [False, True])
def test_reuse_attention_in_the_chunked_step(indexer_loss):
    """memory.reuse_attention in the chunked step: each DSA block's checkpoint records the attention
    output and lse in its first pass and its recompute replays them (torch checkpoint's context_fn).
    The loss and every gradient equal the chunked step without it (fp64; the indexer KL too), and the
    sparse attention forward runs once per DSA block and chunk of the backward sweep instead of twice."""
    import longctx.ops.sparse_attention as sa

    m = _model(indexer_loss=indexer_loss)
    x, y = _batch(m.cfg)
    calls = []
    orig = sa.sparse_attention_torch
    sa.sparse_attention_torch = lambda *a, **k: calls.append(1) or orig(*a, **k)
    res = {}
    try:
        for reuse in (False, True):
            m.zero_grad(set_to_none=True)
            m.clear_aux()
            calls.clear()
            got = SequenceChunker(16, checkpoint_blocks=True, reuse_attention=reuse).forward_backward(m, x, y)
            res[reuse] = (got.loss.item(), _grads(m), len(calls), m.impl_report())
    finally:
        sa.sparse_attention_torch = orig
    (l0, g0, n0, _), (l1, g1, n1, report) = res[False], res[True]
    assert l1 == pytest.approx(l0, rel=1e-12) and g0.keys() == g1.keys()
    for n in g0:
        err = (g1[n] - g0[n]).abs().max() / g0[n].abs().max().clamp_min(1e-30)
        assert err < 1e-9, (n, err.item())
    n_dsa, n_chunks = m.cfg.layer_kinds().count("D"), -(-x.shape[1] // 16)
    assert n0 - n1 == n_dsa * n_chunks, (n0, n1)  # one recompute forward saved per DSA block and chunk
    assert "dsa:torch-sparse+kept" in report


@pytest.mark.parametrize("dense_below,chunk,ckpt", [(0, 16, True), (1000, 16, True), (0, 8, False)])
def test_indexer_kl_is_carried_across_chunks(dense_below, chunk, ckpt):
    """The indexer KL (sparse, and the dense warm-up): earlier chunks' pooled keys are a leaf whose
    gradient returns to the chunk that built them, so the indexer gets the whole-sequence gradient."""
    m = _model(indexer_loss=True, indexer_loss_dense_below=dense_below)
    x, y = _batch(m.cfg)
    out = m(x, labels=y)
    out.loss.backward()
    ref, kl_ref = _grads(m), out.aux["indexer_kl"].item()
    m.zero_grad(set_to_none=True)
    m.clear_aux()
    got = SequenceChunker(chunk, checkpoint_blocks=ckpt).forward_backward(m, x, y)
    g = _grads(m)
    assert g.keys() == ref.keys() and any("indexer" in n for n in g)
    assert got.aux["indexer_kl"].item() == pytest.approx(kl_ref, rel=1e-3)  # the indexer scores in fp32
    assert got.loss.item() == pytest.approx(out.loss.item(), rel=1e-6)
    for n in ref:
        err = (g[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30)
        assert err < 1e-4, (n, err.item())


def test_attention_residuals_and_a_one_token_last_chunk():
    """Block attention residuals carry a tuple state; 33 tokens in chunks of 16 end with a one-token
    chunk, which KDA runs through its single-step form."""
    m = _model("attnres")
    x, y = _batch(m.cfg, S=33)
    out = m(x, labels=y)
    out.loss.backward()
    ref = _grads(m)
    m.zero_grad(set_to_none=True)
    got = SequenceChunker(16).forward_backward(m, x, y)
    g = _grads(m)
    assert g.keys() == ref.keys() and abs(got.lm_loss.item() - out.lm_loss.item()) <= 1e-6 * out.lm_loss.item()
    assert max(((g[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30)).item() for n in ref) < 1e-5


def _max_err(g, ref):
    return max(((g[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30)).item() for n in ref)


class _RerouteAfterForwardSweep(SequenceChunker):
    """Moves the bias of every router that the forward sweep ran (all but the last block's, which the
    backward sweep's first passes route) after the sweep: a stand-in for a backward-sweep recompute
    that is not bit-identical to the forward sweep (bf16, other kernels) and so routes differently."""

    def _forward_sweep(self, model, *a, **kw):
        out = super()._forward_sweep(model, *a, **kw)
        if kw.get("tape") is not None:
            with torch.no_grad():
                for mod in model.layers[:-1].modules():
                    if isinstance(mod, MoE):
                        mod.router.bias.add_(torch.randn_like(mod.router.bias) * 10)
        return out


def test_backward_sweep_replays_the_forward_sweeps_routing(monkeypatch):
    """The backward sweep routes from the tape, not afresh: with the routers moved after the forward
    sweep (the bias only chooses experts; the weights come from the scores), the gradient is still the
    whole sequence's, and select_experts runs once per chunk and MoE layer: in the forward sweep, or
    for the last block (whose MoE the sweep skips) in the backward sweep's first pass over the chunk."""
    import longctx.layers.moe as moe_mod

    m = _model()
    x, y = _batch(m.cfg)
    bias = {n: b.clone() for n, b in m.named_buffers() if n.endswith("router.bias")}
    assert bias and any(k.startswith("layers.") for k in bias)
    m(x, labels=y).loss.backward()
    ref = _grads(m)
    m.zero_grad(set_to_none=True)
    calls, orig = [], moe_mod.select_experts
    monkeypatch.setattr(moe_mod, "select_experts", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    # the sweep runs every chunk here (seq_skip_last off): the perturbation then reaches every chunk
    chunker = _RerouteAfterForwardSweep(16, skip_last_chunk=False)
    chunker.forward_backward(m, x, y)
    n_moe = sum(isinstance(mod, MoE) for mod in m.modules())
    assert len(calls) == 5 * n_moe  # 5 chunks of <= 16 tokens, one call each per MoE layer
    assert chunker.last_stats["routing_bytes"] == n_moe * x.numel() * m.cfg.experts_per_token * 2  # int16
    assert _max_err(_grads(m), ref) < 1e-5
    # the same perturbation without the tape changes the gradient: the test can fail
    for n, b in m.named_buffers():
        if n in bias:
            b.copy_(bias[n])
    m.zero_grad(set_to_none=True)
    import longctx.memory.sequence_chunks as sc

    class _NoReplay(moe_mod.RoutingTape):
        replay = property(lambda self: False, lambda self, v: None)

    monkeypatch.setattr(sc, "RoutingTape", _NoReplay)
    _RerouteAfterForwardSweep(16, skip_last_chunk=False).forward_backward(m, x, y)
    assert _max_err(_grads(m), ref) > 1e-3


def test_the_skipped_last_chunk_selects_and_routes_once_and_its_recompute_replays(monkeypatch):
    """memory.seq_skip_last (on by default): the forward sweep stops before the last chunk; the backward
    sweep's first pass over it routes (records into the tape) and selects through the sweep's indexer
    caches, and its block recompute replays both: the router and the indexer run once per chunk, and
    the gradient is the whole sequence's (fp64)."""
    import longctx.layers.kpool_indexer as idx_mod
    import longctx.layers.moe as moe_mod

    m = _model()
    x, y = _batch(m.cfg)
    out = m(x, labels=y)
    out.loss.backward()
    ref = _grads(m)
    m.zero_grad(set_to_none=True)
    routed, selected = [], []
    orig_route, orig_select = moe_mod.select_experts, idx_mod.KPoolIndexer.select
    monkeypatch.setattr(moe_mod, "select_experts", lambda *a, **kw: routed.append(1) or orig_route(*a, **kw))
    monkeypatch.setattr(idx_mod.KPoolIndexer, "select", lambda self, *a, **kw: selected.append(1) or orig_select(self, *a, **kw))
    lines = []
    chunker = SequenceChunker(16)
    chunker.progress = lines.append
    got = chunker.forward_backward(m, x, y)
    n_moe = sum(isinstance(mod, MoE) for mod in m.modules())
    n_idx = sum(isinstance(mod, idx_mod.KPoolIndexer) for mod in m.modules())
    assert n_moe and n_idx
    assert len(routed) == 5 * n_moe and len(selected) == 5 * n_idx  # 4 chunks in the sweep, the last once
    assert [ln for ln in lines if ln.startswith("forward sweep")][-1] == "forward sweep: chunk 4/5 done"
    assert abs(got.lm_loss.item() - out.lm_loss.item()) <= 1e-6 * out.lm_loss.item()
    assert _max_err(_grads(m), ref) < 1e-5


def test_the_forward_sweep_runs_only_the_last_blocks_mixer():
    """Nothing reads the last block's output in the forward sweep, so it runs that block's mixer for the
    caches and selection only: no attention output, no MoE (the backward sweep routes it); the gradient
    stays the whole sequence's (the tests above). Evaluation's sweep (token losses) runs it whole."""
    m = _model()
    x, y = _batch(m.cfg)
    last = m.layers[-1]
    assert last.kind == "D" and isinstance(last.mlp, MoE)
    seen = {"mlp": 0, "attend": 0}
    last.mlp.register_forward_hook(lambda *a: seen.__setitem__("mlp", seen["mlp"] + 1))
    orig = last.mixer._attend
    last.mixer._attend = lambda *a, **kw: seen.__setitem__("attend", seen["attend"] + 1) or orig(*a, **kw)
    chunker = SequenceChunker(16, skip_last_chunk=False)
    with torch.no_grad():
        chunker._forward_sweep(m, x, chunker._bounds(x.shape[1]), tape=None)
    assert seen == {"mlp": 0, "attend": 0}
    chunker.token_losses(m, x, y)
    assert seen == {"mlp": 5, "attend": 5}


def test_a_recorded_tape_replays_in_both_sweeps():
    """A tape recorded by a whole-sequence forward drives the chunked step's routing (how the GPU test
    compares the chunked step with the whole sequence under bf16, where rounding flips near-tied
    choices at initialisation): the chunked step then calls select_experts not at all."""
    import longctx.layers.moe as moe_mod

    m = _model()
    x, y = _batch(m.cfg)
    tape = moe_mod.RoutingTape()
    with moe_mod.routing_tape(tape):
        m(x, labels=y).loss.backward()
    ref = _grads(m)
    m.zero_grad(set_to_none=True)
    tape.replay, calls, orig = True, [], moe_mod.select_experts
    moe_mod.select_experts = lambda *a, **kw: calls.append(1) or orig(*a, **kw)
    try:
        SequenceChunker(16).forward_backward(m, x, y, routing=tape)
    finally:
        moe_mod.select_experts = orig
    assert not calls and _max_err(_grads(m), ref) < 1e-5
    tape.offset = 60
    with pytest.raises(RuntimeError, match="no recorded routing for 2 x 16 tokens at position 60"):
        tape.lookup(next(mod for mod in m.modules() if isinstance(mod, MoE)), 2, 16)


def test_chunks_record_the_balance_once_each():
    m = _model()
    x, y = _batch(m.cfg)
    SequenceChunker(16).forward_backward(m, x, y)
    moes = [mod for mod in m.modules() if isinstance(mod, MoE)]
    assert moes and all(mod._pending_count == 5 for mod in moes)  # 70 tokens in chunks of 16: 5 forwards
    assert all(mod.apply_balance_update() for mod in moes)


def test_activation_peak_does_not_grow_with_the_sequence():
    """Whole-sequence recompute: the live set grows with S. Chunked: only the O(S) carries (latent
    rows, their gradient, kept selections) grow, a small fraction of it."""
    m = _model(dtype=torch.float32)

    def peak(S, chunked):
        x, y = _batch(m.cfg, S=S, B=1)
        m.zero_grad(set_to_none=True)
        with LiveBytes() as lb:
            if chunked:
                SequenceChunker(64).forward_backward(m, x, y)
            else:
                m(x, labels=y).loss.backward()
        m.zero_grad(set_to_none=True)
        return lb.peak

    apply_plan(m, MemoryPlan.from_dict({"recompute": "on", "offload": "off"}))
    whole = peak(512, False) - peak(128, False)
    apply_plan(m, MemoryPlan.from_dict({"recompute": "off", "offload": "off"}))
    chunked = peak(512, True) - peak(128, True)
    assert chunked < 0.25 * whole, (chunked, whole)


def test_unsupported_settings_are_refused():
    m = _model(balancer="aux")
    x, y = _batch(m.cfg)
    with pytest.raises(ConfigError, match="balancer"):
        SequenceChunker(16).forward_backward(m, x, y)
    with pytest.raises(ConfigError, match="balancer"):
        apply_plan(m, MemoryPlan.from_dict({"recompute": "on", "offload": "off", "seq_chunk": 16}))
    m = _model(indexer_loss=True)
    with pytest.raises(ConfigError, match="multiple of model.index_pool"):
        SequenceChunker(18).forward_backward(m, x, y)
    with pytest.raises(ConfigError, match="multiple of model.index_pool"):
        apply_plan(m, MemoryPlan.from_dict({"recompute": "on", "offload": "off", "seq_chunk": 18}))
    with pytest.raises(ConfigError, match="seq_chunk"):
        MemoryPlan.from_dict({"seq_chunk": "lots"})
    with pytest.raises(ConfigError, match="offload"):
        apply_plan(_model(), MemoryPlan.from_dict({"recompute": "on", "offload": "2", "seq_chunk": 16}))


def test_apply_plan_returns_the_chunker():
    m = _model()
    pol = apply_plan(m, MemoryPlan.from_dict({"recompute": "on", "offload": "off", "seq_chunk": 32}))
    assert isinstance(pol, SequenceChunker) and pol.chunk == 32 and pol.checkpoint_blocks and m.block_fn is None
    assert apply_plan(m, MemoryPlan.from_dict({"recompute": "off", "offload": "off"})) is None


def test_auto_plan_chunks_only_when_blocks_cannot_fit():
    cfg = preset("h200-ref")
    plan, e = auto_plan(cfg, 131072, MemoryPlan())
    assert plan.seq_chunk == "off" and e["fits"]
    plan, e = auto_plan(cfg, 1 << 20, MemoryPlan())
    assert plan.seq_chunk_tokens() > 0 and e["fits"] and e["gpu_bytes"] <= 135 * 2**30
    plan, e = auto_plan(cfg, 1 << 20, MemoryPlan.from_dict({"seq_chunk": "off"}))
    assert not e["fits"]  # whole-sequence blocks cannot hold 1M tokens: the reason chunking exists


def test_trainer_runs_a_chunked_stage(tmp_path):
    from longctx.config.loading import load_train_config
    from longctx.train.trainer import Trainer

    # sign balancing sums the chunks' loads, so the router bias follows the whole-sequence run exactly
    # (quantile balancing averages per-chunk biases: same fixed point, not the same numbers).
    sets = ["preset=tiny", "model.vocab_size=256", "model.index_heads=16", "model.balancer=sign", "stages.0.seq_len=128", "stages.0.steps=3",
            "stages.0.warmup=1", "stages.0.batch_size=1", "stages.1.seq_len=256", "stages.1.steps=2", "stages.1.warmup=1",
            "data.eval_windows=2", "memory.seq_chunk=64", "memory.recompute=on", "memory.offload=off"]
    cfg = load_train_config(None, None, sets)
    t = Trainer(cfg, out_dir=str(tmp_path / "chunked"), quiet=True)
    t.run()
    ref = Trainer(load_train_config(None, None, sets[:-3] + ["memory.seq_chunk=off", "memory.recompute=on",
                                                             "memory.offload=off"]),
                  out_dir=str(tmp_path / "whole"), quiet=True)
    ref.run()
    a = [r["loss"] for r in t.history if "loss" in r]
    b = [r["loss"] for r in ref.history if "loss" in r]
    assert len(a) == 5 and a == pytest.approx(b, rel=1e-4, abs=1e-4)
    # evaluation at a length trained in chunks runs the chunked forward, with the same result
    assert t._eval_forward() is not None and ref._eval_forward() is None
    assert t.before["loss"] == pytest.approx(ref.before["loss"], rel=1e-5)


def test_chunked_forward_losses_equal_the_whole_forward():
    m = _model().eval()
    x, y = _batch(m.cfg)
    whole = m(x, labels=y, token_losses=True).token_losses
    for chunk in (16, 23, 70):
        got = SequenceChunker(chunk).token_losses(m, x, y)
        assert got.shape == whole.shape and torch.allclose(got, whole, atol=1e-6), chunk
    assert all(mod._pending_count == 0 for mod in m.modules() if isinstance(mod, MoE))  # eval records no balance


def _triton_chunked_vs_torch_whole() -> dict:
    """(Runs under TRITON_INTERPRET=1, see __main__.) The chunked step with our Triton sparse
    attention (over a latent prefix, dkv into the prefix leaf) and the fused indexer (through the
    decode cache): gradients against the whole-sequence torch path, fp32."""
    from longctx.layers.dsa import SparseMLA

    cfg = dataclasses.replace(preset("tiny"), index_heads=16, kv_lora_rank=16, index_head_dim=16)
    torch.manual_seed(0)
    m = LongCtxModel(cfg).train()
    x, y = torch.randint(0, 97, (1, 48)), torch.randint(0, 97, (1, 48))
    dsa = [mod for mod in m.modules() if isinstance(mod, SparseMLA)]
    out = m(x, labels=y)
    out.loss.backward()
    ref = _grads(m)
    m.zero_grad(set_to_none=True)
    for mod in dsa:
        mod.kernels["sparse_attention"] = mod.indexer.kernels["indexer"] = "triton"
    got = SequenceChunker(16).forward_backward(m, x, y)
    g = _grads(m)
    err = max(((g[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30)).item() for n in ref)
    return {"name": "triton_chunked", "loss_diff": abs(got.lm_loss.item() - out.lm_loss.item()), "grad_err": err,
            "same_keys": g.keys() == ref.keys(), "impl": m.impl_report()}


def test_triton_kernels_in_the_chunked_step():
    from triton_interpreter import run_interpreted

    r = run_interpreted(__file__)["triton_chunked"]
    assert "dsa:triton-sparse" in r["impl"] and "indexer:triton-two-phase" in r["impl"], r
    assert r["same_keys"] and r["loss_diff"] < 1e-5 and r["grad_err"] < 1e-4, r


if __name__ == "__main__":  # under TRITON_INTERPRET=1 (tests/triton_interpreter.py)
    import json

    print("RESULT " + json.dumps(_triton_chunked_vs_torch_whole()))


def test_compact_selection_changes_nothing_but_what_is_kept():
    """memory.compact_selection: the chunks rebuilt from compacted selections give bit-identical
    losses and gradients, and what is kept per chunk is a quarter (pool 4) of the full selection."""
    x, y = _batch(_model().cfg)
    out = {}
    for compact in (False, True):
        m = _model()
        ch = SequenceChunker(16, compact_selection=compact)
        kept = []
        orig = ch._keep
        ch._keep = lambda sel, host, key: kept.append(sel.numel()) or orig(sel, host, key)
        loss = ch.forward_backward(m, x, y).lm_loss
        out[compact] = (loss, _grads(m), sum(kept))
    assert torch.equal(out[True][0], out[False][0])
    for n, g in out[False][1].items():
        assert torch.equal(out[True][1][n], g), n
    cfg = _model().cfg
    assert out[True][2] * cfg.index_width() == out[False][2] * -(-cfg.index_width() // cfg.index_pool)
