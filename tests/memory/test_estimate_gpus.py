"""The byte model over several GPUs (`model_bytes.Cluster`) and the plan that picks the CP: one GPU is the
single-process estimate exactly; FSDP divides parameter, gradient and optimizer bytes by G and gathers
the root and a block at a time; each CP mode adds what it gathers over the whole sequence, here computed
from the model's shapes; EP casts and sends only its experts' share; `parallel.cp = "auto"` takes the
smallest CP that fits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from longctx.config import preset
from longctx.config.parallel import ParallelConfig
from longctx.errors import ConfigError
from longctx.memory.model_bytes import Cluster, _stacked_weights, estimate
from longctx.memory.plan import MemoryPlan
from longctx.memory.planner import auto_plan, cp_candidates, pick_cp, plan_choices, widest_elements
from longctx.model import LongCtxModel

KEPT_ALL = MemoryPlan.from_dict({"recompute": "off", "offload": "0", "seq_chunk": "off"})
RECOMPUTE = MemoryPlan.from_dict({"recompute": "on", "offload": "0", "seq_chunk": "off"})


def _counts(cfg):
    """(all parameters, the root's, per block (all, routed experts)) from a meta-device model."""
    with torch.device("meta"):
        m = LongCtxModel(cfg)
    blocks = [(sum(p.numel() for p in b.parameters()),
               sum(p.numel() for n, p in b.named_parameters() if ".experts." in f".{n}")) for b in m.layers]
    root = sum(p.numel() for n, p in m.named_parameters() if not n.startswith("layers."))
    return sum(p.numel() for p in m.parameters()), root, blocks


@pytest.mark.parametrize("name,S,plan", [("tiny", 4096, MemoryPlan()), ("h200-ref", 131072, MemoryPlan()),
                                         ("h200-ref", 1048576, MemoryPlan()), ("h200-ref", 32768, KEPT_ALL)])
def test_one_gpu_is_the_single_process_estimate(name, S, plan):
    cfg = preset(name)
    p, e = auto_plan(cfg, S, plan)
    p1, e1 = auto_plan(cfg, S, plan, cluster=Cluster())
    assert p1 == p and e1.pop("cluster") == dataclasses.asdict(Cluster()) and e1 == e


def test_parameter_gradient_and_optimizer_bytes_scale_1_over_g():
    cfg = preset("h200-ref")
    n, root, blocks = _counts(cfg)
    head = cfg.vocab_size * cfg.hidden_size
    L = cfg.num_layers
    for G, ep in ((2, 1), (4, 2), (8, 8), (16, 4)):
        e = estimate(cfg, 131072, RECOMPUTE, cluster=Cluster(gpus=G, ep=ep))
        st = e["static"]
        assert st["parameters (fp32)"] == -(-4 * n // G) and st["AdamW moments (fp32)"] == -(-8 * n // G), G
        # the root stays gathered (fp32 as the trainer shards); a block and its prefetched neighbour are whole,
        # with the routed experts at 1/ep, and the block's gradient unsharded before its reduce-scatter
        assert st["FSDP gathered root (embedding, head, norms)"] == 4 * root
        phase = e["peak_phase"]
        assert phase.startswith("the backward of layer "), phase
        i = int(phase.split("layer ")[1].split(" ")[0])
        local = [b - x + x // ep for b, x in blocks]
        assert e["working"]["FSDP gathered block parameters (this + prefetched)"] == 4 * (local[i] + (local[i - 1] if i else 0))
        assert e["working"]["FSDP unsharded block gradient"] == 4 * local[i]
        # the blocks' gradients made so far are 1/G shards; the root's (LM head) is unsharded to the end
        per_block = (n - 2 * head) / L
        assert abs(st["gradients alive at the peak (fp32)"] - (4 * head + 4 * per_block * (L - i) / G)) <= 1
    # autocast caches a whole bf16 copy of every fp32 weight FSDP gathers that it casts (all but the embedding,
    # the routed experts and the stacked projections) for the forward; bf16 gathers leave it nothing to cast, and halve the root's
    fwd = "the end of the forward (loss)"
    f32 = estimate(cfg, 8192, RECOMPUTE, cluster=Cluster(gpus=4))["phases_gpu_bytes"][fwd]
    f16 = estimate(cfg, 8192, RECOMPUTE, cluster=Cluster(gpus=4, param_bytes=2))["phases_gpu_bytes"][fwd]
    stacked = sum(_stacked_weights(cfg, k, m) for k, m in zip(cfg.layer_kinds(), cfg.mlp_kinds()))  # cast per call
    cast = n - sum(x for _, x in blocks) - cfg.vocab_size * cfg.hidden_size - stacked
    assert f32 - f16 == 2 * cast + 2 * root + 2 * head  # and the LM head's unsharded gradient, in the gathered dtype
    off = estimate(cfg, 8192, RECOMPUTE, cluster=Cluster(gpus=4, opt_offload=True))
    on = estimate(cfg, 8192, RECOMPUTE, cluster=Cluster(gpus=4))
    assert on["gpu_bytes"] - off["gpu_bytes"] == off["host_bytes"] - on["host_bytes"] == -(-8 * n // 4)


@pytest.mark.parametrize("mode", ["hidden_gather", "qkv_a2a", "chunk_state"])
def test_cp2_at_2n_is_cp1_at_n_plus_what_the_mode_gathers(mode):
    """Without recompute each block keeps every activation: at cp 2 and 2N tokens a rank's own N tokens
    cost what one rank's N tokens cost at cp 1, and each layer keeps besides what its mode gathers over
    the whole sequence (computed here from the shapes)."""
    cfg = preset("h200-ref")
    N, a = 4096, 2
    D, H, K, C, L = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim, cfg.kda_chunk_size, cfg.kv_lora_rank
    one = estimate(cfg, N, KEPT_ALL, cluster=Cluster(gpus=2, cp=1, kda_cp=mode))
    two = estimate(cfg, 2 * N, KEPT_ALL, cluster=Cluster(gpus=2, cp=2, kda_cp=mode))
    gathered = {
        "hidden_gather": 2 * N * D * a + N * 2 * K * a,  # hidden [2N, D]; f_a and g_a rows of the other rank's N tokens
        "qkv_a2a": 2 * N * (H // 2) * 3 * K * a,  # received q/k/v of this rank's H/2 heads over 2N tokens
        # v and the output K columns wider over the rank's N tokens, one more K x K fp32 state per chunk,
        # and the 2 ranks x 2 zigzag spans of [H, K, 2K] fp32 summaries
        "chunk_state": 2 * N * H * K * a + -(-N // C) * H * K * K * 4 + 2 * 2 * H * K * 2 * K * 4,
    }[mode]
    for name, b in two["kept_gpu"].items():
        extra = b - one["kept_gpu"][name]
        assert extra == (gathered if "(K)" in name else 2 * N * L * a), (name, extra)  # DSA: the latents [2N, kv_lora]
    # the sharded indexer scores this rank's N queries against the whole sequence's pools
    assert two["static"]["parameters (fp32)"] == one["static"]["parameters (fp32)"]
    assert two["gpu_bytes"] > one["gpu_bytes"]


def test_expert_parallel_casts_and_sends_its_share():
    cfg = preset("h200-ref")
    S, a = 131072, 2
    D, I, E, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.experts_per_token
    e1 = estimate(cfg, S, RECOMPUTE, cluster=Cluster(gpus=4, ep=1))
    e4 = estimate(cfg, S, RECOMPUTE, cluster=Cluster(gpus=4, ep=4))
    assert "EP all-to-all buffers" not in e1["working"]
    assert e4["working"]["EP all-to-all buffers"] == 2 * min(S, RECOMPUTE.moe_chunk) * k * D * a  # in and out
    # a recomputed MoE block's bf16 expert copies, one set per MoE chunk: its E/ep experts
    r1, r4 = e1["working"]["recomputed block activations"], e4["working"]["recomputed block activations"]
    chunks = -(-S // RECOMPUTE.moe_chunk)
    assert e1["peak_phase"] == e4["peak_phase"] and r1 - r4 == chunks * (E - E // 4) * 3 * D * I * a


def test_the_chunked_step_over_dp_ranks_only_and_the_int32_bound_under_cp():
    cfg = preset("h200-ref")
    cl = Cluster(gpus=4, cp=2)
    assert all(not c.seq_chunk_tokens() for c in plan_choices(cfg, 262144, MemoryPlan(), cluster=cl))
    chunked = dataclasses.replace(RECOMPUTE, seq_chunk="65536")
    with pytest.raises(ConfigError, match="runs over data-parallel ranks only, not with parallel.cp = 2"):
        estimate(cfg, 262144, chunked, cluster=cl)
    # over dp ranks: parameters and moments 1/G, the gradients whole (reduced once, after the last chunk)
    one, two = estimate(cfg, 262144, chunked), estimate(cfg, 262144, chunked, cluster=Cluster(gpus=2))
    s1, s2 = one["static"], two["static"]
    assert s2["parameters (fp32)"] * 2 == pytest.approx(s1["parameters (fp32)"], rel=1e-6)
    assert s2["AdamW moments (fp32)"] * 2 == pytest.approx(s1["AdamW moments (fp32)"], rel=1e-6)
    assert s2["gradients alive at the peak (fp32)"] == pytest.approx(s1["gradients alive at the peak (fp32)"], rel=1e-3)
    assert two["gpu_bytes"] < one["gpu_bytes"]
    # hidden_gather holds the whole sequence's hidden state: [S, hidden] elements on each rank
    assert widest_elements(cfg, 2**21, Cluster(gpus=8, cp=8)) == 2**21 * cfg.hidden_size
    assert widest_elements(cfg, 2**21, Cluster(gpus=8, cp=8, kda_cp="chunk_state")) == 2**18 * 8192
    with pytest.raises(ConfigError, match="2\\^31"):
        auto_plan(cfg, 2**21, MemoryPlan(), cluster=Cluster(gpus=8, cp=8))


def test_cp_auto_takes_the_smallest_that_fits():
    tiny = preset("tiny")
    cl, p, e = pick_cp(tiny, 4096, MemoryPlan(), 2, gpu="cpu")
    assert cl.cp == 1 and e["fits"]
    cfg = preset("h200-ref")
    assert cp_candidates(cfg, 65536, 8) == [1, 2, 4]  # 12 KDA heads: cp 8 gives no equal share
    assert cp_candidates(cfg, 65536, 8, "chunk_state") == [1, 2, 4, 8]
    # over data-parallel ranks alone the sequence-chunked step is a choice, as on one GPU: it fits at cp 1
    p, e = auto_plan(cfg, 65536, MemoryPlan(), cluster=Cluster(gpus=4, cp=1), gpu="cpu")
    assert p.seq_chunk_tokens() and e["fits"] and e["static"]["gradients alive at the peak (fp32)"] > 0
    whole = MemoryPlan(seq_chunk="off")  # without it cp 1 does not fit, and auto takes cp 2
    assert not auto_plan(cfg, 65536, whole, cluster=Cluster(gpus=4, cp=1), gpu="cpu")[1]["fits"]
    cl, p, e = pick_cp(cfg, 65536, whole, 4, gpu="cpu")
    assert cl.cp == 2 and cl.dp == 2 and e["fits"] and e["cp"] == 2
    assert (p, e) == auto_plan(cfg, 65536, whole, cluster=cl, gpu="cpu")


def test_parallel_cp_auto_is_a_setting():
    assert ParallelConfig.from_dict({"cp": "auto"}).cp == "auto"
    assert ParallelConfig().cp == 1
    ParallelConfig.from_dict({"cp": "auto"}).check_model(preset("h200-ref"))
    with pytest.raises(ConfigError, match="parallel.cp must be a positive integer .* or to auto"):
        ParallelConfig.from_dict({"cp": "automatic"})


def test_resolve_parallel_for_a_training_config():
    from longctx.config.loading import load_train_config
    from longctx.memory.planner import plan_for_stage, resolve_parallel

    cfg = load_train_config(None, "tiny", ["parallel.cp=auto", "stages=[{seq_len = 64, steps = 1, lr = 1e-3, batch_size = 2}]"])
    assert cfg.parallel.cp == "auto"
    assert resolve_parallel(cfg, 1, "cpu").cp == 1 and resolve_parallel(cfg, 2, "cpu").cp == 1
    cfg.parallel = resolve_parallel(cfg, 2, "cpu")
    plan = plan_for_stage(cfg, cfg.stages[0], "cpu", 0, world=2)
    assert not plan.seq_chunk_tokens() and plan.recompute in ("on", "off")
