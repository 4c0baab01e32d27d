"""Block recompute (longctx.memory.recompute) on the CPU: the same loss and gradients as the plain step,
and each block keeps only its input (plus the selection or attention output the plan says it reuses).

What a block keeps is measured with `SavedTensorMeter` (saved_tensors_hooks); the expectations are
computed independently, from the tensors each block received."""

from __future__ import annotations

import pytest
import torch

from longctx.errors import ConfigError
from longctx.measure.meter import meter_model_step
from longctx.memory.plan import MemoryPlan, apply_plan
from longctx.memory.model_bytes import estimate
from longctx.memory.recompute import _flatten
from memory_steps import PLAIN, RECOMPUTE, B, S, _assert_same, _batch, _cfg, _model, _nbytes, _step

pytestmark = pytest.mark.usefixtures("one_thread")


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


@pytest.mark.parametrize("reuse_attention", [True, False])
def test_recompute_of_the_first_n_blocks(reuse_attention):
    """memory.recompute = N: the first N blocks recompute, the later ones keep every activation as without
    recompute. The loss and gradients are the plain step's for every N (a shared-selection DSA layer reading
    a recomputed layer's selection and the other way round among them); what each block keeps, from the meter,
    is the full-recompute step's for the first N blocks and the plain step's for the rest, and the estimate
    composes the same way."""
    cfg = _cfg()  # K, D (full), D (shared), D (full)
    model = _model(cfg)
    ids, labels = _batch(cfg)
    ref = _step(model, ids, labels, PLAIN)
    flags = {"offload": "off", "reuse_attention": reuse_attention}
    plans = {n: MemoryPlan.from_dict({"recompute": n, **flags}) for n in ("off", "on", 1, 2, 3)}
    kept = {}
    for n, plan in plans.items():
        if n not in ("off", "on"):
            _assert_same(ref, _step(model, ids, labels, plan))
        apply_plan(model, plan)
        kept[n] = [meter_model_step(model, ids, labels).bytes[f"layer{i}"] for i in range(cfg.num_layers)]
    est = {n: list(estimate(cfg, S * B, plan, act_bytes=4)["kept_gpu"].values()) for n, plan in plans.items()}
    for n in (1, 2, 3):
        assert plans[n].recompute_blocks(cfg.num_layers) == n
        assert kept[n] == kept["on"][:n] + kept["off"][n:], (n, kept)
        assert est[n] == est["on"][:n] + est["off"][n:], (n, est)
    assert all(a < b for a, b in zip(kept["on"], kept["off"]))
    apply_plan(model, PLAIN)


def test_recompute_counts_beyond_the_model_or_its_offload_are_refused():
    model = _model(_cfg())
    with pytest.raises(ConfigError, match=r"memory.recompute = 5 names more blocks than the model's 4"):
        apply_plan(model, MemoryPlan.from_dict({"recompute": 5, "offload": "off"}))
    with pytest.raises(ConfigError, match=r"memory.offload = 3 .*only the first 2"):
        apply_plan(model, MemoryPlan.from_dict({"recompute": 2, "offload": 3}))
    with pytest.raises(ConfigError, match="auto, on, off or a number of blocks"):
        MemoryPlan.from_dict({"recompute": "most"})
    policy = apply_plan(model, MemoryPlan.from_dict({"recompute": 2, "offload": 2, "pin_memory": False}))
    assert policy.recompute == 2 and policy.offload_layers == 2
    apply_plan(model, PLAIN)
