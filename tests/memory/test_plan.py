"""The memory plan (longctx.memory.plan): `MemoryPlan.from_dict` names the setting in every mistake, the
baseline turns every switch off, and `apply_plan` sets each module's switch so that it does what it
says (the mHC cast, the router's tensors, the chunked indexer's O(S) peak)."""

from __future__ import annotations

import itertools

import pytest
import torch

from longctx.config import preset
from longctx.errors import ConfigError
from longctx.layers.dsa import SparseMLA
from longctx.layers.kpool_indexer import KPoolIndexer
from longctx.layers.moe import MoE
from longctx.layers.residual import MHC
from longctx.measure.meter import LiveBytes, meter_model_step
from longctx.memory.plan import MemoryPlan, apply_plan
from memory_steps import B, S, _batch, _cfg, _model

pytestmark = pytest.mark.usefixtures("one_thread")


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
    assert MemoryPlan().keep_pinned and not b.keep_pinned

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
