"""`longctx estimate`: an analytic memory model of one training step, and the automatic plan.

The model counts bytes, it does not run anything. For a config, tokens per step S (per GPU, after
context parallelism) and a memory plan it adds up:

  static      parameters (fp32 master) and AdamW moments (2 x fp32), always; the fp32 gradients that
              exist at the peak and autocast's bf16 weight copies if they are alive then;
  kept        what survives from forward to backward: with full recompute each block's input
              (the residual state: n_streams x hidden for mHC) plus, with selection reuse, the
              int32 selection of each indexer layer; without recompute every activation a block's
              backward needs (per-token constants below); split into GPU and host by offload;
  working     the transient set of the peak phase (a block's recomputed activations, state
              gradients, the KDA/DSA/MoE/indexer/loss workspaces, each bounded by its chunk size
              when chunking is on), and the kept inputs already freed by then (negative).

The peak is the largest of the step's phases: the end of the forward (all kept tensors, the bf16
weight copies, the loss), and the backward of each block, last to first (the inputs of that block
and the ones before it, the gradients created so far). On the H200 this lands within -7..+7% of
the measured peak (bench/results/memory_table.md), hence GPU_FIT.

Per-token byte counts are written out per sub-layer in `_block_activation_bytes`; they follow the
code in longctx/layers (bf16 activations, fp32 where the layer computes in fp32). Quadratic terms
appear only when a switch is off: dense masked DSA (S x S scores) and the unchunked indexer
(S x S/P scores). The figures the estimate prints next to measurements come from
bench/memory.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys

from ..config import ModelConfig, preset
from ..errors import ConfigError
from ..ops import int32_rows
from .plan import MemoryPlan

GIB = 2**30
GPUS = {"h200": {"memory": 139.8 * GIB, "host": 125 * GIB}, "b200": {"memory": 178 * GIB, "host": 1000 * GIB},
        "cpu": {"memory": 24 * GIB, "host": 24 * GIB}}
# The estimate is of the peak *allocated* bytes (what the tables compare it with). What the allocator
# reserves is more: reserved over allocated at the peak on the H200 (bench/results/memory_table.md's two
# peak columns) is 1.01-1.04 for the all-on runs with expandable segments (calls 20-36), up to 1.16 where a
# large transient fragments the pool (loss_chunk_off at 128k, call 10). The fit rule counts this slack on
# top of the estimate (`gpu_reserved_bytes`). Until call 34 the slack was part of the estimate itself,
# which then over-estimated today's runs by +5..+10.5%.
ALLOCATOR_SLACK = 1.05
# "fits" = the reserved estimate at most this share of the GPU: the allocated estimate has been within
# -8..+6% of the H200's peaks (bench/results/memory_table.md), so a plan estimated at 93% has room.
GPU_FIT = 0.93
HOST_FIT = 0.8  # pinned host memory beside the process, the data loader and the OS


def _params(cfg: ModelConfig) -> int:
    return _params_of(cfg.to_json())


@functools.lru_cache(maxsize=16)
def _params_of(cfg_json: str) -> int:
    """Parameters of the model (built on the meta device, once per config)."""
    import torch

    from ..model import LongCtxModel

    with torch.device("meta"):
        m = LongCtxModel(ModelConfig.from_dict(json.loads(cfg_json)))
    return sum(p.numel() for p in m.parameters())


def _block_activation_bytes(cfg: ModelConfig, kind: str, mlp: str, S: int, plan: MemoryPlan, a: int = 2,
                            fla: bool = False, fla_norm: bool = False, plain_ops: bool = False) -> dict:
    """Bytes a block saves for its backward when it runs *without* recompute, by component (the bytes
    one block's recompute re-creates). `fla`: KDA through fla-core (a GPU) rather than the torch twin;
    `fla_norm`: its gated output norm through fla's kernel too (the default there) rather than ours;
    `plain_ops`: the RMSNorms and the clamped SwiGLUs as plain autograd (runs recorded before call 28),
    not `norms._RMSNormFn` and `mlp._ClampedSwiGLU`.
    Checked on the H200 against each sub-layer's recompute (allocated after minus before, call 22,
    256k): fla KDA mixer 56.1 KB/token measured vs 55.9 counted (+ its output) with our gated norm, 37.5
    counted with fla's (the default since call 23; 37.7 measured at 128k, call 27); MoE 89.7 measured vs
    77.2 counted: the gap was the plain combine's index_add_ keeping its source, 12.3 KB/token, gone
    with `moe._WeightedCombine` (call 28: the 128k peak 67.44 -> 61.29 GiB with it, the norms and the SwiGLU)."""
    D, n = cfg.hidden_size, cfg.hc_streams
    out = {}
    # residual connections: collapse input, norms, the expand (2 per block); mHC keeps its fp32
    # normalised copy unless the cast is recomputed. Each RMSNorm (norms._RMSNormFn) keeps its input and
    # one fp32 rstd per row: 4 bytes per element less than plain autograd's fp32 copy (runs before call
    # 28; the saved-tensor meter checks both forms in tests/memory/test_memory.py). The final norm and the DSA's
    # two latent norms (not counted here) keep 4 bytes per element less the same way.
    res = 2 * (D * a * 3 - (0 if plain_ops else 4 * D - 4))
    if cfg.residual == "mhc":
        res += 2 * (n * D * a + (0 if plan.mhc_cast_recompute else n * D * 4) + 40 * n * n * 4)
    out["residual+norms"] = S * res
    if kind == "K":
        H, K = cfg.kda_heads, cfg.kda_head_dim
        HK = H * K
        if fla:
            # input x; the q/k/v projections (the conv's input) and the conv's output (fla's chunk_kda
            # keeps q, k, v in bf16 with fp32 rstd per head); the gate's low-rank and raw output, beta;
            # chunk_kda's two [T, H, chunk] bf16 matrices; fla's gated norm (the auto norm where KDA runs
            # fla): its bf16 input and gate and one fp32 rstd per head (6,192 B/token measured at h200-ref's
            # width, call 23; ours kept four fp32 rows, 24,624), its bf16 output (o_proj's input); the
            # output gate's low rank
            per = D * a + 3 * HK * a * 2 + 2 * H * 4 + K * a + HK * a + H * a + 2 * H * cfg.kda_chunk_size * a
            # ours (kda_norm torch): its fp32 input, normalised input, weighted product and sigmoid(gate)
            per += (2 * HK * a + H * 4 if fla_norm else 4 * HK * 4) + HK * a + K * a
        else:
            # the torch twin: projections in, conv in/out (+ SiLU), L2-norm fp32 q/k, fp32 gate (+ pre-
            # activation), the core op's saved q/k/v/g/beta and chunk states, gated norm (fp32), o_proj input
            per = D * a + 3 * HK * a * 3 + 2 * HK * 4 + 2 * HK * 4 + K * a + 4 * HK * a + HK * 4
            per += HK * 4 + HK * a * 2
        out["kda"] = S * per
    else:
        H, L, R = cfg.attn_heads, cfg.kv_lora_rank, cfg.q_lora_rank
        per = D * a + R * a * 2 + H * cfg.qk_nope_head_dim * a + L * a * 2 + H * L * a * 2 + H * 4
        per += H * cfg.v_head_dim * a * 2
        out["dsa"] = S * per
        if not plan.sparse_kernel:
            # the softmax output and its NaN-cleaned copy, both fp32 [H, S, S] (ops/sparse_attention/naive.py)
            out["dsa dense scores"] = 2 * S * S * H * 4
    # the clamped SwiGLU (mlp._ClampedSwiGLU) keeps the gate and up projections (one [2I] tensor for the
    # experts) and the down projection its input, the product: 3 rows of the width per token and expert.
    # Plain autograd (runs before call 28) kept the clamped gate, its SiLU and the clamped up too: 6.
    sw = 6 if plain_ops else 3
    if mlp == "d":
        out["mlp"] = S * (D * a + sw * cfg.intermediate_size * a)
    else:
        k, I = cfg.experts_per_token, cfg.moe_intermediate_size
        # input, the gathered rows, the SwiGLU, the expert outputs (kept by the combine; the fp32
        # combine's index_add_ keeps its fp32 products as well)
        per = D * a + D * a * k + k * sw * I * a + k * D * (a if plan.moe_bf16_combine else a + 4)
        per += cfg.n_shared_experts * sw * I * a + (0 if plan.router_release else cfg.n_routed_experts * 4 * 2)
        out["moe"] = S * per
        # the experts' bf16 copies (cast per call, layers/moe.py), saved by the grouped matmuls: one set
        # per MoE chunk of tokens
        chunks = -(-S // plan.moe_chunk) if plan.moe_chunk else 1
        out["moe bf16 expert weights"] = chunks * cfg.n_routed_experts * 3 * D * I * a
    return out


def _stream_width(cfg: ModelConfig) -> int:
    """Rows of hidden per token in the residual state a block takes and returns."""
    return {"mhc": cfg.hc_streams, "plain": 1, "attnres": cfg.attnres_blocks + 1}[cfg.residual]


TWO_PHASE_CHUNK = 1024  # queries per score buffer of the two-phase indexer (ops/indexer/two_phase.py)


def _fused_indexer(gpu: str, plan: MemoryPlan) -> bool:
    """On a GPU the indexer runs our Triton path (backend auto; the two-phase kernels by default); on the
    CPU, or with the chunked-indexer switch off (the plain unchunked scoring), the torch twin."""
    return gpu not in ("cpu", "smoke") and plan.chunked_indexer


def _indexer_workspace(cfg: ModelConfig, S: int, plan: MemoryPlan, fused: bool = False, queries: int | None = None) -> int:
    """Transient bytes of one indexer run: `queries` (default S) queries against the S/P pools."""
    P = cfg.index_pool
    pools = S // P
    Q = S if queries is None else queries
    W = cfg.index_width()
    out = Q * W * 4 + pools * cfg.index_head_dim * 4  # the int32 selection, the pooled keys
    if fused:  # the kernel's int32 pool ids, then token expansion in blocks of 8192 rows (int64 + mask),
        # and the two-phase path's fp32 score buffer of one block of queries against the pools they see
        # plus torch.topk's values and int64 indices (the fused kernel needs neither: this over-counts it)
        c, k = min(Q, TWO_PHASE_CHUNK), cfg.index_topk // P
        return out + Q * k * 4 + min(Q, 8192) * W * 8 * 2 + c * pools * 4 + c * k * (4 + 8)
    rows = min(Q, plan.indexer_chunk) if plan.chunked_indexer else Q
    # fp32 scores per head for a block of queries, the head-summed score, top-k values/indices
    return out + rows * pools * 4 * (cfg.index_heads + 2)


def _moe_workspace(cfg: ModelConfig, S: int, plan: MemoryPlan, skew: float = 1.0) -> int:
    rows = min(S, plan.moe_chunk) if plan.moe_chunk else S
    k, I, D = cfg.experts_per_token, cfg.moe_intermediate_size, cfg.hidden_size
    return int(rows * k * skew * (D * 2 + 3 * I * 2 + D * 4) + S * cfg.n_routed_experts * 4)


def _uses_liger_mhc(cfg: ModelConfig, plan: MemoryPlan, gpu: str, residual_impl: str) -> bool:
    """Whether the mHC residuals run liger's kernels: residual_impl liger, or auto on a GPU by the rule
    of `MHC.pick_impl` (layers/residual.py: `auto_takes_liger`), liger assumed installed."""
    from ..layers import residual

    if cfg.residual != "mhc":
        return False
    if residual_impl == "auto":
        return gpu not in ("cpu", "smoke") and residual.auto_takes_liger(cfg.hc_streams, plan.mhc_cast_recompute)
    return residual_impl == "liger"


def _mhc_stream_workspace(cfg: ModelConfig, S: int, plan: MemoryPlan, gpu: str, residual_impl: str) -> int:
    """Transient bytes of the backward of liger's post-res op, at the start of a block's backward
    (beyond the incoming and outgoing stream gradients, which `state gradients` counts). liger's own
    Function: an fp32 copy of the incoming gradient and an fp32 grad of the streams ([S, n, D] each),
    the branch output's gradient in fp32 and bf16 ([S, D]); measured 17.27 GiB at 256k for h200-ref
    against these 17.25 (bench/results/memory_runs/16_peak_262144_*.txt). In `mhc_chunk` tokens
    (ops/mhc_liger.py): the bf16 branch gradient and the fp32 coefficient gradients; the kernels store
    into the bf16 tensors (runs up to call 30 also held one chunk's fp32 buffers, 0.47 GiB for h200-ref
    at 16,384 tokens, not counted here: within the estimate's error)."""
    if not _uses_liger_mhc(cfg, plan, gpu, residual_impl):
        return 0
    n, D = cfg.hc_streams, cfg.hidden_size
    if plan.mhc_chunk:
        return S * (D * 2 + (n + n * n) * 4)
    return S * (n * D * 8 + D * 6)


def _loss_workspace(cfg: ModelConfig, S: int, plan: MemoryPlan) -> int:
    rows = min(S, plan.loss_chunk) if plan.loss_chunk else S
    return rows * cfg.vocab_size * (2 + 4 + 4) + S * cfg.hidden_size * 2 * 2


def _indexer_kl_kept(cfg: ModelConfig, S: int, a: int) -> int:
    """With `indexer_loss`, each full DSA layer's KL graph (built in the first forward, recompute or
    not) keeps its detached inputs to backward: x, q_latent, the absorbed queries [S, H, kv_lora],
    the latent, and the indexer's key and gate rows."""
    if not cfg.indexer_loss:
        return 0
    per = (cfg.hidden_size + cfg.q_lora_rank + cfg.attn_heads * cfg.kv_lora_rank + cfg.kv_lora_rank) * a
    return S * (per + 2 * cfg.index_head_dim * 4)


def _kept_selections(cfg: ModelConfig, plan: MemoryPlan) -> list[bool]:
    """Per layer: does recompute keep an int32 selection there? A full ('f') DSA layer keeps its own
    with `reuse_selection`; without it, the first shared ('s') layer after it keeps it as input."""
    kinds, idx = cfg.layer_kinds(), cfg.indexer_kinds()
    out, owner_kept = [], False
    for k, f in zip(kinds, idx):
        keep = False
        if k == "D" and f == "f":
            keep = owner_kept = plan.reuse_selection
        elif k == "D" and not owner_kept:
            keep = owner_kept = True
        out.append(keep)
    return out


def _estimate_chunked(cfg: ModelConfig, S: int, plan: MemoryPlan, gpu: str, a: int, residual_impl: str,
                      kda_norm: str, plain_ops: bool) -> dict:
    """Sequence-chunked step (memory/sequence_chunks.py): the block-level estimate of one chunk of C
    tokens, plus what stays O(S): per DSA layer the latent rows and their fp32 gradient buffer, the
    pooled indexer keys, the selections (pinned host), and the KDA carries at each chunk start; the
    indexer scores a chunk's queries against all S/P pools; a DSA block's recompute keeps the latent
    rows up to the chunk's end (the earlier rows and the chunk's, concatenated for the kernel) through
    the block's backward. Their gradient and the kernel's fp32 dkv come later, in the mixer's backward,
    after the MLP's activations are freed (10.8 GiB below the block's peak at 1M: memory_runs/22_*).
    The backward sweep takes the last chunk first: its parameter gradients are created as it goes
    (as in an unchunked step) while its prefix is the whole sequence; in every earlier chunk all
    gradients exist and the prefix is at most S - C rows. Both are estimated; the larger is the peak
    (on the H200 at 1M the earlier chunks peaked 6.4 GiB over the last one: memory_runs/21_*)."""
    C = plan.seq_chunk_tokens()
    n_chunks = -(-S // C)
    inner = dataclasses.replace(plan, seq_chunk="off", offload="0", recompute="on" if plan.recompute == "on" else "off")
    kinds, idx = cfg.layer_kinds(), cfg.indexer_kinds()
    L = cfg.kv_lora_rank
    per_row = L * a if "D" in kinds else 0  # the concatenated latent rows the kernel reads
    impl = {"residual_impl": residual_impl, "kda_norm": kda_norm, "plain_ops": plain_ops}
    cases = [("last chunk", estimate(cfg, min(C, S), inner, 1, gpu, a, **impl, _chunk="last", _dsa_prefix=S * per_row))]
    if n_chunks > 1:
        cases.append(("earlier chunks", estimate(cfg, C, inner, 1, gpu, a, **impl, _chunk="earlier",
                                                 _dsa_prefix=(S - C) * per_row)))
    kept = {}
    for i, k in enumerate(kinds):
        if k == "D":
            b = S * L * (a + 4)  # latent rows + fp32 gradient buffer
            if idx[i] == "f":
                b += S // cfg.index_pool * cfg.index_head_dim * a
            kept[f"layer {i} (D) latents + grad"] = b
        else:
            kept[f"layer {i} (K) carries"] = 2 * n_chunks * cfg.kda_heads * cfg.kda_head_dim**2 * 4
    n_moe = cfg.mlp_kinds().count("m")
    if n_moe:  # the forward sweep's expert choices, replayed by the backward sweep (moe.RoutingTape)
        kept["MoE routing tape (int16)"] = n_moe * S * cfg.experts_per_token * (2 if cfg.n_routed_experts <= 32767 else 4)
    o_s = sum(kept.values())
    phases = {f"{case}: {name}": b + o_s for case, e in cases for name, b in e["phases_gpu_bytes"].items()}
    case, e = max(cases, key=lambda ce: ce[1]["gpu_bytes"])
    e = dict(e, peak_phase=f"{e['peak_phase']}, {case}")
    for name, b in e["kept_gpu"].items():
        kept[f"{name}, one chunk"] = b
    host = {f"layer {i} selection": S * cfg.index_width() * 4 for i, k in enumerate(kinds) if k == "D" and idx[i] == "f"}
    work = dict(e["working"])
    backward = sum(e["static"].values()) + sum(kept.values()) + sum(work.values())
    # the forward sweep: no gradients yet (nor the latents' fp32 gradient buffers: the backward sweep
    # makes them), the O(S) rows, a chunk's state in and out, and its largest transient: its queries
    # scored against all S/P pools, or the MoE workspace
    idx_ws = _indexer_workspace(cfg, S, plan, _fused_indexer(gpu, plan), queries=C) if "D" in kinds else 0
    moe_ws = _moe_workspace(cfg, C, plan) if n_moe else 0
    state = C * _stream_width(cfg) * cfg.hidden_size * a
    sweep = (e["static"]["parameters (fp32)"] + e["static"]["AdamW moments (fp32)"] + e["static"]["bf16 weight copies"]
             + o_s - kinds.count("D") * S * L * 4 + 2 * state + max(idx_ws, moe_ws))
    phases["the forward sweep"] = int(sweep)
    if sweep > backward:
        e["peak_phase"] = "the forward sweep"
        work = {"a chunk's state in and out": 2 * state, **({"indexer workspace (forward sweep)": idx_ws}
                if idx_ws >= moe_ws else {"MoE workspace (forward sweep)": moe_ws}),
                "latents' gradient buffers (not yet made)": -kinds.count("D") * S * L * 4}
        kept = {k: v for k, v in kept.items() if "one chunk" not in k}
        e["static"] = dict(e["static"], **{"gradients alive at the peak (fp32)": 0})
    gpu_bytes = max(backward, sweep)
    host_bytes = sum(host.values())
    cap = GPUS[gpu]
    return dict(e, seq_len=S, plan=plan.to_dict(), kept_gpu=kept, kept_host=host, working=work, gpu_bytes=int(gpu_bytes),
                gpu_reserved_bytes=int(gpu_bytes * ALLOCATOR_SLACK), host_bytes=int(host_bytes), phases_gpu_bytes=phases,
                fits=gpu_bytes * ALLOCATOR_SLACK <= cap["memory"] * GPU_FIT and host_bytes <= cap["host"] * HOST_FIT)


def estimate(cfg: ModelConfig, S: int, plan: MemoryPlan, cp: int = 1, gpu: str = "h200", act_bytes: int = 2,
             residual_impl: str = "auto", kda_norm: str = "auto", plain_ops: bool = False, _chunk: str = "",
             _dsa_prefix: int = 0) -> dict:
    """The breakdown (bytes) for one step of S tokens per sequence split over `cp` GPUs.
    `act_bytes`: bytes per activation element (2 under bf16 autocast; 4 for an fp32 model).
    `residual_impl`: the training setting (auto | torch | liger); liger's mHC adds a backward transient.
    `kda_norm`: the training setting (auto | torch | fla); auto is fla's norm where KDA runs fla (a GPU).
    `plain_ops`: estimate a run recorded before `norms._RMSNormFn` and `mlp._ClampedSwiGLU` (call 28 on),
    which kept more.

    The peak is the largest of the step's phases: the end of the forward (every kept tensor, the
    autocast's bf16 weight copies, the loss), and the backward of each block, last to first (the
    kept inputs of that block and the blocks before it; the gradients of the blocks after it and its
    own, since they are created as backward reaches them; the block's working set). `_chunk`: one
    chunk of a sequence-chunked step, where the bf16 copies live through the whole step (it runs
    inside one autocast region), "last" (the backward sweep's first: gradients created as it goes)
    or "earlier" (every gradient already exists);
    `_dsa_prefix`: the bytes a DSA block's backward holds for the sequence up to the chunk's end."""
    if gpu not in GPUS:
        raise ConfigError(f"--gpu {gpu!r} is unknown; choose one of {', '.join(GPUS)}.")
    S_local = -(-S // cp)
    if plan.seq_chunk_tokens() and plan.seq_chunk_tokens() < S_local:
        return dict(_estimate_chunked(cfg, S_local, plan, gpu, act_bytes, residual_impl, kda_norm, plain_ops),
                    seq_len=S, cp=cp)
    n_params = _params(cfg)
    kinds, mlps = cfg.layer_kinds(), cfg.mlp_kinds()
    L = len(kinds)
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    per_block_params = (n_params - cfg.vocab_size * cfg.hidden_size - head) / L
    width = _stream_width(cfg)
    a = act_bytes
    state = S_local * width * cfg.hidden_size * a
    recompute = plan.recompute == "on"
    n_off = plan.offload_blocks()
    kept_gpu, kept_host = {}, {}
    fla = gpu not in ("cpu", "smoke")  # KDA through fla-core on a GPU (the layer's `auto`)
    fla_norm = kda_norm == "fla" or (kda_norm == "auto" and fla)
    per_block = [_block_activation_bytes(cfg, k, m, S_local, plan, a, fla, fla_norm, plain_ops)
                 for k, m in zip(kinds, mlps)]
    sel = S_local * cfg.index_width() * 4
    keeps_sel = _kept_selections(cfg, plan)
    kl = _indexer_kl_kept(cfg, S_local, a)
    # reuse_attention: a DSA block under recompute keeps its attention output and fp32 lse (which its
    # recompute then reuses rather than re-creating: not counted twice in its backward)
    keeps_attn = [recompute and plan.reuse_attention and k == "D" for k in kinds]
    attn_parts = [S_local * cfg.attn_heads * cfg.kv_lora_rank * a, S_local * cfg.attn_heads * 4]  # output, fp32 lse
    attn_kept = [sum(attn_parts) if keep else 0 for keep in keeps_attn]
    kept, saved, host = [], [], 0  # per block: what stays on the GPU to backward; what it saves, wherever
    for i, (k, blk) in enumerate(zip(kinds, per_block)):
        parts = [state] + ([sel] if recompute and keeps_sel[i] else []) + (attn_parts if keeps_attn[i] else [])
        if not recompute:
            parts.append(sum(blk.values()))
        if k == "D" and cfg.indexer_kinds()[i] == "f" and kl:
            parts.append(kl)
        b = sum(parts)
        (kept_host if i < n_off else kept_gpu)[f"layer {i} ({k})"] = b
        kept.append(0 if i < n_off else b)
        saved.append(b)
        if i < n_off:
            # at their exact size: the offloader page-locks its own buffers (memory/host_buffers.py), where torch's
            # pinned allocator would round each to a power of two (72 GiB for these 54 at 256k, H200 call 50)
            host += sum(parts)
    idx_ws = _indexer_workspace(cfg, S_local, plan, _fused_indexer(gpu, plan)) if "D" in kinds else 0
    moe_ws = _moe_workspace(cfg, S_local, plan) if "m" in mlps else 0
    mhc_ws = _mhc_stream_workspace(cfg, S_local, plan, gpu, residual_impl)
    loss_ws = _loss_workspace(cfg, S_local, plan)
    base = {"parameters (fp32)": n_params * 4, "AdamW moments (fp32)": n_params * 8}
    # autocast's cached bf16 copies: the weights that go through its casts (linear layers); the
    # embedding is indexed in fp32 and the experts are cast per call by the MoE (layers/moe.py): their
    # copies are a block's saved activations (_block_activation_bytes), not cached
    n_experts = mlps.count("m") * cfg.n_routed_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    bf16 = (n_params - n_experts - cfg.vocab_size * cfg.hidden_size) * 2

    # phase 1, the end of the forward: everything kept, the weight copies, the loss (the largest
    # transient of the forward: loss, indexer or MoE workspace)
    all_grads, in_chunks = _chunk == "earlier", bool(_chunk)
    grads = (n_params if all_grads else head) * 4
    fwd = {"LM head + loss": loss_ws, "indexer workspace": idx_ws, "MoE workspace": moe_ws}
    top = max(fwd, key=fwd.get)
    phases = [("the end of the forward (loss)", grads, bf16, L, {top: fwd[top]})]
    # phase 2.., the backward of block i: recomputed activations, state gradients, workspaces
    for i in reversed(range(L)):
        moe_i = moe_ws if mlps[i] == "m" else 0
        grads = (n_params if all_grads else head + per_block_params * (L - i)) * 4
        work = {"recomputed block activations": sum(per_block[i].values()) - attn_kept[i] if recompute else 0,
                "state gradients (in flight)": 2 * state,
                # the post-res backward opens the block's backward, the MoE's comes after: the larger counts
                "MoE workspace": moe_i if moe_i >= mhc_ws else 0,
                "mHC stream-op workspace (backward)": mhc_ws if mhc_ws > moe_i else 0,
                "indexer workspace": idx_ws if kinds[i] == "D" and recompute and not keeps_sel[i] else 0,
                # an offloaded block's backward holds what it saved, copied back (its input, selection and
                # kept attention output), and what the block before it saved, prefetched while it recomputes
                # (`Offloader.unpack`); the H200 measured both (call 51: the D blocks' backward and the K
                # blocks' after them were 9 GiB over an estimate that counted one block input instead)
                "offloaded block's saved tensors (back on the GPU)": saved[i] if i < n_off else 0,
                "prefetched offload block": saved[i - 1] if 0 < i < n_off else 0,
                "DSA latent rows to the chunk's end": _dsa_prefix if kinds[i] == "D" else 0}
        phases.append((f"the backward of layer {i} ({kinds[i]})", grads, bf16 if in_chunks else 0, i + 1, work))
    best, by_phase = None, {}
    for name, g, w16, n_kept, work in phases:
        total = sum(base.values()) + g + w16 + sum(kept[:n_kept]) + sum(work.values())
        by_phase[name] = int(total)
        if best is None or total > best[0]:
            best = (total, name, g, w16, n_kept, work)
    total, phase, g, w16, n_kept, work = best
    static = dict(base, **{"gradients alive at the peak (fp32)": int(g), "bf16 weight copies": w16})
    released = {f"kept by layers {n_kept}..{L - 1}, freed by then": -sum(kept[n_kept:])} if n_kept < L else {}
    total_gpu = total
    cap = GPUS[gpu]
    return {"seq_len": S, "cp": cp, "gpu": gpu, "plan": plan.to_dict(), "params": n_params, "peak_phase": phase,
            "phases_gpu_bytes": by_phase,
            "static": static, "kept_gpu": kept_gpu, "kept_host": kept_host,
            "working": dict(released, **{k: v for k, v in work.items() if v}),
            "gpu_bytes": int(total_gpu), "gpu_reserved_bytes": int(total_gpu * ALLOCATOR_SLACK), "host_bytes": int(host),
            "gpu_capacity": cap["memory"], "host_capacity": cap["host"],
            "fits": total_gpu * ALLOCATOR_SLACK <= cap["memory"] * GPU_FIT and host <= cap["host"] * HOST_FIT}


# The longest chunk the automatic plan takes. Past 128k tokens a chunk's time per token is flat: the 1M step
# of h200-ref took 55.8 s with chunks of 262,144 and 56.5 s with 131,072, peaks 115.0 vs 74.8 GiB (H200,
# bench/results/memory_runs/30_*). Longer chunks would buy ~1% for 40 GiB of headroom.
AUTO_CHUNK_MAX = 131072


# Kernels that address a tensor's elements with int32 offsets read and write out of bounds past 2^31
# elements: liger's mHC kernels do (longctx/ops/mhc/liger.py now splits their launches), and after that
# fix the 524,288-token whole-sequence step of h200-ref, whose widest tensors hold 4.3 G elements, still
# stopped with an illegal memory access in its first forward on the H200 (calls 41-42; the culprit is not
# located), while 262,144 tokens (2^31 elements exactly) ran. So the automatic plan takes a whole-sequence
# step only while every activation tensor stays within 2^31 elements; past that the sequence-chunked step,
# whose kernels see one chunk, runs (it ran 1,048,576 tokens in chunks of 131,072).


def widest_activation(cfg: ModelConfig) -> int:
    """Elements per token of the step's widest whole-sequence activation: the residual state (streams x
    hidden), KDA's conv input (3 x heads x head dim), a dense MLP's [gate | up] (2 x intermediate), a DSA
    layer's absorbed queries and output (heads x kv_lora)."""
    widths = [_stream_width(cfg) * cfg.hidden_size]
    kinds, mlps = cfg.layer_kinds(), cfg.mlp_kinds()
    if "K" in kinds:
        widths.append(3 * cfg.kda_heads * cfg.kda_head_dim)
    if "d" in mlps:
        widths.append(2 * cfg.intermediate_size)
    if "D" in kinds:
        widths.append(cfg.attn_heads * cfg.kv_lora_rank)
    return max(widths)


def whole_sequence_max(cfg: ModelConfig) -> int:
    """The most tokens per GPU a whole-sequence step takes under the automatic plan (every activation within
    2^31 elements, `ops.int32_rows`): 262,144 for h200-ref, the longest whole-sequence step the H200 has run.
    The 512k step's fault (calls 41-46) was our sparse kernel's int32 head offsets, fixed after call 46; the
    bound stays until the H200 has run that step with the fix (bench/NOTES.md, "Next GPU calls")."""
    return int32_rows(widest_activation(cfg))


def whole_sequence_warning(cfg: ModelConfig, tokens: int, plan: MemoryPlan) -> str | None:
    """What to tell a user whose plan runs a whole-sequence step past `whole_sequence_max` (a forced
    seq_chunk=off), or None."""
    limit = whole_sequence_max(cfg)
    if plan.seq_chunk_tokens() or tokens <= limit:
        return None
    return (f"a whole-sequence step of {tokens:,} tokens holds activations of {tokens * widest_activation(cfg) / 1e9:.1f} G "
            f"elements, past 2^31, and no whole-sequence step that large has run correctly on the H200 yet (h200-ref at "
            f"524,288 tokens stopped with an illegal memory access, since fixed but not re-run); memory.seq_chunk=auto "
            f"chunks every sequence above {limit:,} tokens.")


def plan_choices(cfg: ModelConfig, S: int, plan: MemoryPlan, cp: int = 1) -> list[MemoryPlan]:
    """The candidates `auto_plan` tries, cheapest first: no recompute, recompute, recompute + offload of 1, 2, ...
    blocks, then the sequence in chunks (the largest power-of-two chunk up to AUTO_CHUNK_MAX first, recompute
    on inside a chunk). With seq_chunk "auto", sequences past `whole_sequence_max` go to chunks directly.
    `reuse_attention` (when on) is a speed-for-memory trade (0.21 s for 4 GiB at 128k, H200): it is kept
    while offloading blocks can make room (offload measured free of step time at 256k), given up before
    the sequence is chunked, and within a chunk length given up before the chunk is halved."""
    choices = []
    S_local = -(-S // cp)
    limit = whole_sequence_max(cfg)
    rc = ["off", "on"] if plan.recompute == "auto" else [plan.recompute]
    whole = "off" if plan.seq_chunk == "auto" else plan.seq_chunk
    if plan.seq_chunk == "auto" and S_local > limit:
        rc = []  # no whole-sequence choice
    for r in rc:
        offs = (["0"] + [str(i) for i in range(1, cfg.num_layers + 1)]) if plan.offload == "auto" else [plan.offload]
        for o in offs:
            if r == "off" and o not in ("0", "off"):
                continue
            if whole != "off" and o not in ("0", "off"):
                continue
            choices.append(dataclasses.replace(plan, recompute=r, offload=o, seq_chunk=whole))
    if plan.seq_chunk == "auto":
        c = min(AUTO_CHUNK_MAX, 1 << max(0, (S_local - 1).bit_length() - 1))  # largest power of two below S_local
        c = min(c, 1 << max(0, limit.bit_length() - 1))
        while c >= 1024:
            choices.append(dataclasses.replace(plan, recompute="on" if plan.recompute == "auto" else plan.recompute,
                                               offload="0", seq_chunk=str(c)))
            c //= 2
    if plan.reuse_attention:
        kept = lambda c: c.recompute == "on" or c.seq_chunk_tokens() > 0  # noqa: E731  (where the switch acts)
        drop = lambda c: dataclasses.replace(c, reuse_attention=False)  # noqa: E731
        blockwise = [c for c in choices if not c.seq_chunk_tokens()]
        chunked = [c for c in choices if c.seq_chunk_tokens()]
        choices = (blockwise + [drop(c) for c in blockwise if kept(c)]
                   + [v for c in chunked for v in (c, drop(c))])
    return choices


def auto_plan(cfg: ModelConfig, S: int, plan: MemoryPlan, cp: int = 1, gpu: str = "h200",
              act_bytes: int = 2, residual_impl: str = "auto", kda_norm: str = "auto") -> tuple[MemoryPlan, dict]:
    """Resolve recompute/offload/seq_chunk "auto": the first of `plan_choices` whose estimate fits (else the
    last, with its estimate saying it does not)."""
    last = None
    for c in plan_choices(cfg, S, plan, cp):
        e = estimate(cfg, S, c, cp, gpu, act_bytes, residual_impl=residual_impl, kda_norm=kda_norm)
        last = (c, e)
        if e["fits"]:
            return c, e
    if last is None:
        raise ConfigError(f"no memory plan to try for {S:,} tokens: the widest activation ({widest_activation(cfg):,} "
                          f"elements a token) leaves no chunk of >= 1024 tokens within 2^31 elements; set memory.seq_chunk.")
    return last


def device_gpu_key(device) -> str:
    """The GPUS key of `device`: a CUDA device's own capacity, registered as "this"; else "cpu"."""
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        total = torch.cuda.get_device_properties(device).total_memory
        GPUS["this"] = {"memory": total, "host": GPUS["h200"]["host"]}
        return "this"
    return "cpu"


def resolve_auto(plan: MemoryPlan, cfg: ModelConfig, tokens: int, device,
                 act_bytes: int = 2, residual_impl: str = "auto", kda_norm: str = "auto") -> tuple[MemoryPlan, dict | None]:
    """Resolve "auto" switches for this device; returns (plan, its estimate or None)."""
    if "auto" not in (plan.recompute, plan.offload, plan.seq_chunk):
        return plan, None
    return auto_plan(cfg, tokens, plan, 1, device_gpu_key(device), act_bytes, residual_impl, kda_norm)


def format_report(e: dict, phases: bool = False) -> str:
    g = lambda b: f"{b / GIB:9.2f}"  # noqa: E731
    lines = [f"estimate: {e['seq_len']:,} tokens/sequence, CP {e['cp']}, {e['gpu']}, {e['params'] / 1e9:.3f}B parameters",
             f"plan: recompute={e['plan']['recompute']} offload={e['plan']['offload']} seq_chunk={e['plan']['seq_chunk']} "
             f"sparse_kernel={e['plan']['sparse_kernel']} chunked_indexer={e['plan']['chunked_indexer']}"]
    c = int(e["plan"]["seq_chunk"]) if str(e["plan"]["seq_chunk"]).isdigit() else 0
    S_local = -(-e["seq_len"] // e["cp"])
    if 0 < c < S_local:
        lines.append(f"sequence-chunked step: {-(-S_local // c)} chunks of {c:,} tokens, carries between them "
                     f"(longctx/memory/sequence_chunks.py); 'one chunk' rows are per chunk")
    lines += ["", f"{'component':<40}{'GiB':>9}"]
    for title, part in (("static", e["static"]), ("kept for backward (GPU)", e["kept_gpu"]),
                        ("kept for backward (host, offloaded)", e["kept_host"]), ("working set at the peak (and what is freed by then)", e["working"])):
        if not part:
            continue
        lines.append(f"-- {title}: {sum(part.values()) / GIB:.2f} GiB")
        for k, v in part.items():
            lines.append(f"   {k:<37}{g(v)}")
    if e.get("peak_phase"):
        lines.append(f"peak during {e['peak_phase']}")
    lines.append("")
    lines.append(f"{'GPU peak, allocated':<40}{g(e['gpu_bytes'])}")
    lines.append(f"{'GPU reserved (x' + str(ALLOCATOR_SLACK) + ' allocator slack)':<40}{g(e['gpu_reserved_bytes'])}  of "
                 f"{e['gpu_capacity'] / GIB:.1f} (fits: <= {GPU_FIT:.0%})")
    lines.append(f"{'host (offloaded inputs)':<40}{g(e['host_bytes'])}  of {e['host_capacity'] / GIB:.1f}")
    lines.append(f"verdict: {'fits' if e['fits'] else 'DOES NOT FIT'}")
    if phases and e.get("phases_gpu_bytes"):
        lines += ["", f"{'phase (GPU allocated)':<58}{'GiB':>9}"]
        top = max(e["phases_gpu_bytes"].values())
        lines += [f"{k:<58}{g(v)}{'  <- peak' if v == top else ''}" for k, v in e["phases_gpu_bytes"].items()]
    return "\n".join(lines)


def parse_switches(items, flag: str = "--set") -> dict:
    """["offload=0", "reuse_attention=false", "mhc_chunk=8192"] -> the memory settings they name (values as
    MemoryPlan.from_dict takes them; it checks names and values)."""
    forced = {}
    for s in items:
        if "=" not in s:
            raise ConfigError(f"{flag} {s!r} must look like SWITCH=VALUE, e.g. offload=0.")
        k, v = s.split("=", 1)
        is_int = v.lstrip("-").isdigit() and k not in ("offload",)
        forced[k] = {"true": True, "false": False}.get(v.lower(), int(v) if is_int else v)
    return forced


def main(a) -> int:
    cfg = preset(a.preset) if a.preset != "h200-curriculum" else preset("h200-ref")
    if a.seq_len < 1:
        raise ConfigError(f"--seq-len must be >= 1 (got {a.seq_len}).")
    if a.cp < 1:
        raise ConfigError(f"--cp must be >= 1 (got {a.cp}).")
    plan = MemoryPlan.from_dict(parse_switches(a.set or []))
    plan, e = auto_plan(cfg, a.seq_len, plan, a.cp, a.gpu, residual_impl=a.residual_impl,
                        kda_norm=getattr(a, "kda_norm", "auto"))
    if a.json:
        print(json.dumps(e, indent=2))
    else:
        print(format_report(e, phases=getattr(a, "phases", False)))
        warning = whole_sequence_warning(cfg, -(-a.seq_len // a.cp), plan)
        if warning:
            print(f"warning: {warning}")
    return 0 if e["fits"] else 1


if __name__ == "__main__":
    from ..cli import main as cli_main

    sys.exit(cli_main(["estimate", *sys.argv[1:]]))
