"""The byte model of one training step: what each tensor costs, added up per phase of the step.

It counts bytes, it runs nothing. For a config, tokens per step S (per GPU, after context
parallelism) and a memory plan it adds up:

  static      parameters (fp32 master) and AdamW moments (2 x fp32), always; the fp32 gradients that
              exist at the peak and autocast's bf16 weight copies if they are alive then;
  kept        what survives from forward to backward: for a block under recompute its input
              (the residual state: n_streams x hidden for mHC) plus, with selection reuse, the
              int32 selection of each indexer layer; for a block without it (every block with
              recompute off, the later ones with recompute = N) every activation its backward
              needs (per-token constants below); split into GPU and host by offload;
  working     the transient set of the peak phase (a block's recomputed activations, state
              gradients, the KDA/DSA/MoE/indexer/loss workspaces, each bounded by its chunk size
              when chunking is on), and the kept inputs already freed by then (negative).

The peak is the largest of the step's phases: the end of the forward (all kept tensors, the bf16
weight copies, the loss), and the backward of each block, last to first (the inputs of that block
and the ones before it, the gradients created so far). On the H200 this lands within -7..+7% of
the measured peak (`python bench/memory.py`, bench/results/memory.json), hence GPU_FIT.

Per-token byte counts are written out per sub-layer in `_block_activation_bytes`; they follow the
code in longctx/layers (bf16 activations, fp32 where the layer computes in fp32). Quadratic terms
appear only when a switch is off: dense masked DSA (S x S scores) and the unchunked indexer
(S x S/P scores). `longctx.memory.planner` picks a plan with it; docs/design/memory_model.md
explains both.

Many GPUs (`Cluster`: G ranks of a (dp, cp) mesh, each holding 1/ep of the routed experts) add terms
to the same model rather than a second one: FSDP2 shards every parameter byte over all G ranks
(routed experts 1/ep per rank, then over the G/ep ranks holding the same experts: again 1/G), so the
fp32 parameters, AdamW moments and parameter gradients are 1/G; the activations are this rank's S/cp
tokens, as with `cp` alone; and what the distributed step holds besides: FSDP's gathered parameters
(the root whole for the step, a block and its prefetched neighbour at a time, a block's unsharded
gradient before its reduce-scatter), what each CP mode gathers (`_cp_block_bytes`: the whole
sequence's rows each mode reads, counted from longctx/distributed/kda_cp.py and dsa_cp.py) and EP's
all-to-all buffers. These terms are counted from the tensors the code allocates; the per-rank peaks a
many-GPU run records (metrics.jsonl's peak_gib_ranks) are what check them.
"""

from __future__ import annotations

import dataclasses
import functools
import json

from ..config import ModelConfig
from ..errors import ConfigError
from ..ops.indexer import auto_method, compact_group
from .plan import MemoryPlan

GIB = 2**30
# A GPU's memory as torch reports it (`total_memory`); host memory per GPU as on the machines measured here
# (the lent H100 and H200 have 128 GiB; a B200 node's share is larger).
GPUS = {"h200": {"memory": 139.8 * GIB, "host": 125 * GIB}, "h100": {"memory": 79.18 * GIB, "host": 125 * GIB},
        "b200": {"memory": 178 * GIB, "host": 1000 * GIB}, "cpu": {"memory": 24 * GIB, "host": 24 * GIB}}
# The estimate is of the peak *allocated* bytes (what bench/memory.py compares it with). What the allocator
# reserves is more: reserved over allocated at the peak on the H200 (bench/results/memory.json's two peak
# columns) is 1.01-1.04 for the all-on runs with expandable segments, up to 1.16 where a large transient
# fragments the pool (loss_chunk_off at 128k). The fit rule counts this slack on top of the estimate
# (`gpu_reserved_bytes`), so the estimate itself stays comparable with the allocated peak.
ALLOCATOR_SLACK = 1.05
# "fits" = the reserved estimate at most this share of the GPU: the allocated estimate has been within
# -8..+6% of the H200's peaks (bench/results/memory.json), so a plan estimated at 93% has room.
GPU_FIT = 0.93
HOST_FIT = 0.8  # pinned host memory beside the process, the data loader and the OS


FSDP_ROOT = "FSDP gathered root (embedding, head, norms)"
CHUNKED_CP_ERROR = ("memory.seq_chunk = {chunk} runs over data-parallel ranks only, not with parallel.cp = {cp} (a cp "
                    "rank's chunk would need the other ranks' carries chunk by chunk); set memory.seq_chunk = off or "
                    "auto, or parallel.cp = 1.")


def _params(cfg: ModelConfig) -> int:
    return _params_of(cfg.to_json())


def _params_of(cfg_json: str) -> int:
    """Parameters of the model (built on the meta device, once per config)."""
    return _counts_of(cfg_json)["total"]


@functools.lru_cache(maxsize=16)
def _counts_of(cfg_json: str) -> dict:
    """Parameter counts of the model built on the meta device: the total, the root's (everything outside
    `model.layers`: embedding, LM head, final norm, the residual stream's own) and per block (params,
    of which routed experts), which are FSDP's units (`longctx.distributed.fsdp.parallelize`)."""
    import torch

    from ..model import LongCtxModel

    with torch.device("meta"):
        m = LongCtxModel(ModelConfig.from_dict(json.loads(cfg_json)))
    total = sum(p.numel() for p in m.parameters())
    blocks = [(sum(p.numel() for p in b.parameters()),
               sum(p.numel() for n, p in b.named_parameters() if n.startswith("mlp.experts."))) for b in m.layers]
    return {"total": total, "root": total - sum(b for b, _ in blocks), "blocks": blocks}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """One training step spread over `gpus` ranks: a (dp, cp) mesh, dp = gpus // cp, each rank holding
    1/ep of every MoE layer's routed experts; FSDP2 shards every parameter over all the ranks.
    `param_bytes`: what FSDP's all-gather delivers to the compute: 4 (fp32, the trainer's
    `parallelize(param_dtype=None)`; autocast then caches a bf16 copy of every weight it casts, whole,
    for the forward) or 2 (bf16 gathers: no autocast copies). `opt_offload`: the AdamW moments live in
    host memory (the step streams them through the GPU one block's shard at a time, after the backward,
    so they are not at the peak). `host`: host bytes per GPU (None: the GPU entry's)."""

    gpus: int = 1
    cp: int = 1
    ep: int = 1
    kda_cp: str = "hidden_gather"
    param_bytes: int = 4
    opt_offload: bool = False
    host: float | None = None

    @property
    def dp(self) -> int:
        return self.gpus // self.cp

    def describe(self) -> str:
        return (f"{self.gpus} GPUs = dp {self.dp} x cp {self.cp}, ep {self.ep}"
                + (f", kda_cp {self.kda_cp}" if self.cp > 1 else "")
                + f", FSDP gathers in {'fp32' if self.param_bytes == 4 else 'bf16'}"
                + (", AdamW moments on the host" if self.opt_offload else ""))


def _cp_block_bytes(cfg: ModelConfig, kind: str, S: int, cluster: Cluster, a: int, full_indexer: bool,
                    plan: MemoryPlan, recomputed: bool) -> tuple[dict, int]:
    """What context parallelism adds to one block of `kind` for S tokens per sequence split over cp ranks
    (T = S/cp each): (the tensors the block saves for backward beyond the per-token model's T tokens, by
    name; the transient buffers of its exchanges in its backward). Counted from the code:

    KDA hidden_gather: the gathered hidden state [S, hidden] (the head projections save it) and the two
      low-rank gate projections over the S - T tokens beyond the rank's own; the H/cp heads' q/k/v/gates
      over S are S*H/cp = T*H values per channel, what the per-token model already counts. Backward:
      the gathered hidden's gradient and its copy into the reduce-scatter's layout ([S, hidden] each),
      and the return all-to-all's send and receive buffers ([T, H*K] each).
    KDA qkv_a2a: the received q/k/v columns [S, H/cp, 3K] (kept alive by the gate and beta views of the
      same buffer, which the recurrence saves). Backward: the received buffer's gradient and its copy
      ([S, H/cp, 4K+1] each) and the return all-to-all's buffers.
    KDA chunk_state: the recurrence runs K value columns wider (the zero columns of v and the read-out
      columns of the output, [T, H, K] each, and each chunk's state [T/C, H, K, K] fp32 more) and the
      all-gathered span summaries [cp, 2, H, K, 2K] fp32; their gradient in backward.
    DSA: the gathered latents [S, kv_lora] the sparse attention reads; backward: the kernel's fp32 dkv of
      the gathered rows, the gathered rows' gradient and its copy in the all-gather's dtype ([S, kv_lora]
      and, on a layer that gathers its indexer keys and k-pool gate scores, [S, 2 * index_head_dim] in
      fp32 too). The pooled keys of the whole sequence are the indexer workspace's."""
    cp = cluster.cp
    if cp == 1:
        return {}, 0
    T = -(-S // cp)
    D = cfg.hidden_size
    if kind == "K":
        H, K = cfg.kda_heads, cfg.kda_head_dim
        ret = 2 * T * H * K * a  # the return all-to-all: send and receive
        if cluster.kda_cp == "hidden_gather":
            return ({"kda cp: gathered hidden [S, hidden]": S * D * a,
                     "kda cp: low-rank gates over the other ranks' tokens": (S - T) * 2 * K * a}, 2 * S * D * a + ret)
        if cluster.kda_cp == "qkv_a2a":
            return {"kda cp: received q/k/v [S, H/cp, 3K]": T * H * 3 * K * a}, 2 * T * H * (4 * K + 1) * a + ret
        summaries = cp * 2 * H * K * 2 * K * 4
        wide = 2 * T * H * K * a + -(-T // cfg.kda_chunk_size) * H * K * K * 4
        return {"kda cp: the state pass's K wider values": wide, "kda cp: gathered span summaries": summaries}, summaries
    L = cfg.kv_lora_rank
    keys = full_indexer and not (recomputed and plan.reuse_selection)
    gathered = S * (L + 2 * cfg.index_head_dim) * 4 if keys else S * L * a  # the keys are fp32: the rows widen
    return {"dsa cp: gathered latents [S, kv_lora]": S * L * a}, S * L * 4 + 2 * gathered


def _fsdp_bytes(cfg: ModelConfig, cluster: Cluster) -> tuple[int, list[int]]:
    """(the root's gathered parameters, each block's parameters on this rank when gathered: all of them
    but the routed experts, which are its 1/ep share)."""
    c = _counts_of(cfg.to_json())
    return c["root"] * cluster.param_bytes, [p - e + e // cluster.ep for p, e in c["blocks"]]


def _stacked_weights(cfg: ModelConfig, kind: str, mlp: str, padded: bool = False) -> int:
    """Parameters of one block that run as one matmul over weights stacked by rows (a new tensor each call,
    so autocast casts it per call instead of caching a copy): the KDA mixer's q, k, v, f_a, b and g_a
    (layers/kda.py) and the dense MLP's or shared experts' gate and up (layers/mlp.py). `padded`: with the
    zero rows that pad the KDA gates' product to a multiple of 8 columns (the stacked tensors' size)."""
    D, H, K = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim
    gates = 2 * K + H + (-(2 * K + H) % 8 if padded else 0)
    n = (3 * H * K + gates) * D if kind == "K" else 0
    if mlp == "d":
        n += 2 * cfg.intermediate_size * D
    else:
        n += 2 * cfg.n_shared_experts * cfg.moe_intermediate_size * D
    return n


def _block_activation_bytes(cfg: ModelConfig, kind: str, mlp: str, S: int, plan: MemoryPlan, a: int = 2,
                            fla: bool = False, fla_norm: bool = False, ep: int = 1) -> dict:
    """Bytes a block saves for its backward when it runs *without* recompute, by component (the bytes
    one block's recompute re-creates). `fla`: KDA through fla-core (a GPU) rather than the torch twin;
    `fla_norm`: its gated output norm through fla's kernel too (the default there) rather than ours;
    `ep`: the routed experts are split over that many ranks (a rank casts only its own).
    Checked on the H200 against each sub-layer's recompute (allocated after minus before, 256k): fla KDA
    mixer 56.1 KB/token measured vs 55.9 counted (+ its output) with our gated norm, 37.5 counted with
    fla's (37.7 measured at 128k); the MoE's combine (`moe._WeightedCombine`) keeps no index_add_ source,
    12.3 KB/token less than a plain combine would."""
    D, n = cfg.hidden_size, cfg.hc_streams
    out = {}
    # residual connections: collapse input, norms, the expand (2 per block); mHC keeps its fp32
    # normalised copy unless the cast is recomputed. Each RMSNorm (ops.rms_norm.RMSNormFn) keeps its input and
    # one fp32 rstd per row: 4 bytes per element less than plain autograd's fp32 copy (the saved-tensor
    # meter checks both forms in tests/memory/test_bytes.py). The final norm and the DSA's two latent norms
    # (not counted here) keep 4 bytes per element less the same way.
    res = 2 * (D * a * 3 - (4 * D - 4))
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
            # width; ours keeps four fp32 rows, 24,624), its bf16 output (o_proj's input); the
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
        # (the int32 selection its attention saves is counted per layer, `_kept_selections`: shared layers
        # hold the same tensor)
        out["dsa"] = S * per
        if not plan.sparse_kernel:
            # the softmax output and its NaN-cleaned copy, both fp32 [H, S, S] (ops/sparse_attention/naive.py)
            out["dsa dense scores"] = 2 * S * S * H * 4
    # the clamped SwiGLU (ops.swiglu.ClampedSwiGLU) keeps the gate and up projections (one [2I] tensor for the
    # experts) and the down projection its input, the product: 3 rows of the width per token and expert
    # (plain autograd would keep the clamped gate, its SiLU and the clamped up too: 6).
    sw = 3
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
        out["moe bf16 expert weights"] = chunks * (cfg.n_routed_experts // ep) * 3 * D * I * a
    # the stacked projections' weights (`_stacked_weights`), made each call and saved by their matmuls
    out["stacked projection weights"] = _stacked_weights(cfg, kind, mlp, padded=True) * a
    return out


def _stream_width(cfg: ModelConfig) -> int:
    """Rows of hidden per token in the residual state a block takes and returns."""
    return {"mhc": cfg.hc_streams, "plain": 1, "attnres": cfg.attnres_blocks + 1}[cfg.residual]


TWO_PHASE_CHUNK = 1024  # queries per score buffer of the two-phase indexer (ops/indexer/triton.py)


def _kernels_run(cfg: ModelConfig, plan: MemoryPlan, gpu: str, kernels) -> dict[str, str]:
    """What each op runs on `gpu` under the kernel settings `kernels` (a KernelConfig; None = every op
    auto): `longctx.kernels.planned`, the rule the layers pick by, for this plan's switches."""
    from ..config.kernels import KernelConfig
    from ..kernels import planned

    return planned(kernels or KernelConfig(), "cpu" if gpu in ("cpu", "smoke") else "cuda", cfg, plan)


def _indexer_workspace(cfg: ModelConfig, S: int, plan: MemoryPlan, fused: bool = False, queries: int | None = None) -> int:
    """Transient bytes of one indexer run: `queries` (default S) queries against the S/P pools; `fused`:
    through the Triton path (kernels.indexer "triton")."""
    P = cfg.index_pool
    pools = S // P
    Q = S if queries is None else queries
    W = cfg.index_width()
    out = Q * W * 4 + pools * cfg.index_head_dim * 4  # the int32 selection, the pooled keys
    if fused:  # the kernel's int32 pool ids, then token expansion in blocks of 8192 rows (int64 + mask),
        # and the fp32 score buffer of one block of queries against the pools they see; past ROW_AUTO pools
        # the "compact" selection's group maxima, the ids of the groups it reads (k a row) and its
        # candidates (fp32 score + int32 id, k x group a row)
        c, k = min(Q, TWO_PHASE_CHUNK), cfg.index_topk // P
        group = compact_group(pools, k) if auto_method(pools, k) == "compact" else None
        select = c * (-(-pools // group) * 4 + k * 4 + k * group * 8) if group else 0
        return out + Q * k * 4 + min(Q, 8192) * W * 8 * 2 + c * pools * 4 + select
    rows = min(Q, plan.indexer_chunk) if plan.chunked_indexer else Q
    # fp32 scores per head for a block of queries, the head-summed score, top-k values/indices
    return out + rows * pools * 4 * (cfg.index_heads + 2)


def _moe_workspace(cfg: ModelConfig, S: int, plan: MemoryPlan, skew: float = 1.0) -> int:
    rows = min(S, plan.moe_chunk) if plan.moe_chunk else S
    k, I, D = cfg.experts_per_token, cfg.moe_intermediate_size, cfg.hidden_size
    return int(rows * k * skew * (D * 2 + 3 * I * 2 + D * 4) + S * cfg.n_routed_experts * 4)


def _ep_buffers(cfg: ModelConfig, S: int, plan: MemoryPlan, ep: int, a: int) -> int:
    """EP's all-to-all buffers of one MoE chunk: the rows dispatched to this rank's experts (in) and their
    outputs on the way back (out), tokens x top_k x hidden each, at even routing (the chunk bounds the
    skew, as it bounds the MoE workspace)."""
    if ep == 1:
        return 0
    rows = min(S, plan.moe_chunk) if plan.moe_chunk else S
    return 2 * rows * cfg.experts_per_token * cfg.hidden_size * a


def _mhc_stream_workspace(cfg: ModelConfig, S: int, plan: MemoryPlan, ran: dict[str, str]) -> int:
    """Transient bytes of the backward of liger's post-res op, at the start of a block's backward
    (beyond the incoming and outgoing stream gradients, which `state gradients` counts). liger's own
    Function: an fp32 copy of the incoming gradient and an fp32 grad of the streams ([S, n, D] each),
    the branch output's gradient in fp32 and bf16 ([S, D]); measured 17.27 GiB at 256k for h200-ref
    against these 17.25 (`bench/memory.py --peak`). In `mhc_chunk` tokens (ops/mhc/liger.py): the bf16
    branch gradient and the fp32 coefficient gradients; the kernels store into the bf16 tensors. `ran`:
    what each op runs (`_kernels_run`); 0 unless mHC runs liger's."""
    if ran.get("mhc") != "liger":
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


def _kept_selections(cfg: ModelConfig, plan: MemoryPlan, rec: list[bool] | None = None) -> list[bool]:
    """Per layer: does the block hold an int32 selection to backward? `rec[i]`: block i recomputes (default:
    every block). A recomputed full ('f') DSA layer keeps its own with `reuse_selection`; a full layer without
    recompute keeps it as its sparse attention's saved index. A shared ('s') layer holds one only when no
    layer before it already does (recomputed, it keeps the selection it reads as input; not recomputed, its
    attention saves it), since they all hold the same tensor."""
    kinds, idx = cfg.layer_kinds(), cfg.indexer_kinds()
    rec = [True] * len(kinds) if rec is None else rec
    out, owner_kept = [], False
    for k, f, r in zip(kinds, idx, rec):
        keep = False
        if k == "D" and f == "f":
            keep = owner_kept = plan.reuse_selection if r else True
        elif k == "D" and not owner_kept:
            keep = owner_kept = True
        out.append(keep)
    return out


def _estimate_chunked(cfg: ModelConfig, S: int, plan: MemoryPlan, gpu: str, a: int, kernels,
                      cluster: Cluster | None = None) -> dict:
    """Sequence-chunked step (memory/sequence_chunks.py): the block-level estimate of one chunk of C
    tokens, plus what stays O(S): per DSA layer the latent rows and their fp32 gradient buffer, the
    pooled indexer keys, the selections (pinned host), and the KDA carries at each chunk start; the
    indexer scores a chunk's queries against all S/P pools; a DSA block's recompute keeps the latent
    rows up to the chunk's end (the earlier rows and the chunk's, concatenated for the kernel) through
    the block's backward. Their gradient and the kernel's fp32 dkv come later, in the mixer's backward,
    after the MLP's activations are freed (10.8 GiB below the block's peak at 1M on the H200).
    The backward sweep takes the last chunk first: its parameter gradients are created as it goes
    (as in an unchunked step) while its prefix is the whole sequence; in every earlier chunk all
    gradients exist and the prefix is at most S - C rows. Both are estimated; the larger is the peak
    (on the H200 at 1M the earlier chunks peak 6.4 GiB over the last one). Over data-parallel ranks
    (`cluster`, cp 1) the parameters and moments are 1/G each, and the gradients are held unsharded
    across the chunks (reduced once per step), as in one process."""
    C = plan.seq_chunk_tokens()
    n_chunks = -(-S // C)
    inner = dataclasses.replace(plan, seq_chunk="off", offload="0")
    kinds, idx = cfg.layer_kinds(), cfg.indexer_kinds()
    L = cfg.kv_lora_rank
    per_row = L * a if "D" in kinds else 0  # the concatenated latent rows the kernel reads
    cases = [("last chunk", _estimate(cfg, min(C, S), inner, 1, gpu, a, kernels, "last", S * per_row, cluster))]
    if n_chunks > 1:
        cases.append(("earlier chunks", _estimate(cfg, C, inner, 1, gpu, a, kernels, "earlier", (S - C) * per_row,
                                                  cluster)))
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
    per_query = -(-cfg.index_width() // cfg.index_pool) if plan.compact_selection else cfg.index_width()
    host = {f"layer {i} selection": S * per_query * 4 for i, k in enumerate(kinds) if k == "D" and idx[i] == "f"}
    work = dict(e["working"])
    backward = sum(e["static"].values()) + sum(kept.values()) + sum(work.values())
    # the forward sweep: no gradients yet (nor the latents' fp32 gradient buffers: the backward sweep
    # makes them), the O(S) rows, a chunk's state in and out, and its largest transient: its queries
    # scored against all S/P pools, or the MoE workspace
    fused = _kernels_run(cfg, plan, gpu, kernels).get("indexer") == "triton"
    idx_ws = _indexer_workspace(cfg, S, plan, fused, queries=C) if "D" in kinds else 0
    moe_ws = _moe_workspace(cfg, C, plan) if n_moe else 0
    state = C * _stream_width(cfg) * cfg.hidden_size * a
    sweep = (e["static"]["parameters (fp32)"] + e["static"]["AdamW moments (fp32)"] + e["static"]["bf16 weight copies"]
             + e["static"].get(FSDP_ROOT, 0) + o_s - kinds.count("D") * S * L * 4 + 2 * state + max(idx_ws, moe_ws))
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
             kernels=None, _chunk: str = "", _dsa_prefix: int = 0, cluster: Cluster | None = None) -> dict:
    """The breakdown (bytes) for one step of S tokens per sequence split over `cp` GPUs.
    `act_bytes`: bytes per activation element (2 under bf16 autocast; 4 for an fp32 model).
    `kernels`: the training config's kernel settings (a KernelConfig; None = every op auto); what each op
    runs on `gpu` (`longctx.kernels.planned`) decides the KDA, indexer and mHC bytes.

    The peak is the largest of the step's phases: the end of the forward (every kept tensor, the
    autocast's bf16 weight copies, the loss), and the backward of each block, last to first (the
    kept inputs of that block and the blocks before it; the gradients of the blocks after it and its
    own, since they are created as backward reaches them; the block's working set). `_chunk`: one
    chunk of a sequence-chunked step, where the bf16 copies live through the whole step (it runs
    inside one autocast region), "last" (the backward sweep's first: gradients created as it goes)
    or "earlier" (every gradient already exists);
    `_dsa_prefix`: the bytes a DSA block's backward holds for the sequence up to the chunk's end.
    `cluster`: the per-GPU breakdown of a step over several GPUs (its cp replaces `cp`); None or one GPU:
    the single-process step."""
    if gpu not in GPUS:
        raise ConfigError(f"--gpu {gpu!r} is unknown; choose one of {', '.join(GPUS)}.")
    if cluster is None:
        return _estimate(cfg, S, plan, cp, gpu, act_bytes, kernels, _chunk, _dsa_prefix, None)
    e = _estimate(cfg, S, plan, cluster.cp, gpu, act_bytes, kernels, _chunk, _dsa_prefix, cluster)
    if cluster.opt_offload:  # the same bytes less in every phase of the step, that many more on the host
        m = e["static"]["AdamW moments (fp32)"]
        e = dict(e, static=dict(e["static"], **{"AdamW moments (fp32)": 0}), host_static={"AdamW moments (fp32)": m},
                 phases_gpu_bytes={k: v - m for k, v in e["phases_gpu_bytes"].items()}, gpu_bytes=e["gpu_bytes"] - m,
                 host_bytes=e["host_bytes"] + m)
    if cluster.host is not None:
        e = dict(e, host_capacity=cluster.host)
    if not cluster.opt_offload and cluster.host is None:
        return e
    return dict(e, gpu_reserved_bytes=int(e["gpu_bytes"] * ALLOCATOR_SLACK),
                fits=e["gpu_bytes"] * ALLOCATOR_SLACK <= e["gpu_capacity"] * GPU_FIT
                and e["host_bytes"] <= e["host_capacity"] * HOST_FIT)


def _estimate(cfg, S, plan, cp, gpu, act_bytes, kernels, _chunk, _dsa_prefix, cluster) -> dict:
    S_local = -(-S // cp)
    multi = cluster is not None and cluster.gpus > 1
    if plan.seq_chunk_tokens() and plan.seq_chunk_tokens() < S_local:
        if multi and cluster.cp > 1:
            raise ConfigError(CHUNKED_CP_ERROR.format(chunk=plan.seq_chunk, cp=cluster.cp))
        e = dict(_estimate_chunked(cfg, S_local, plan, gpu, act_bytes, kernels, cluster if multi else None),
                 seq_len=S, cp=cp)
        return e if cluster is None else dict(e, cluster=dataclasses.asdict(cluster))
    n_params = _params(cfg)
    kinds, mlps = cfg.layer_kinds(), cfg.mlp_kinds()
    L = len(kinds)
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    per_block_params = (n_params - cfg.vocab_size * cfg.hidden_size - head) / L
    width = _stream_width(cfg)
    a = act_bytes
    state = S_local * width * cfg.hidden_size * a
    n_off = plan.offload_blocks()
    # the first N blocks recompute (an unresolved "auto" is estimated as no recompute, what the planner tries first)
    n_rec = 0 if plan.recompute == "auto" else plan.recompute_blocks(L)
    rec = [i < n_rec for i in range(L)]
    kept_gpu, kept_host = {}, {}
    ran = _kernels_run(cfg, plan, gpu, kernels)
    fla, fla_norm = ran.get("kda") == "fla", ran.get("kda_norm") == "fla"
    G, ep = (cluster.gpus, cluster.ep) if cluster is not None else (1, 1)
    per_block = [_block_activation_bytes(cfg, k, m, S_local, plan, a, fla, fla_norm, ep)
                 for k, m in zip(kinds, mlps)]
    cp_exchange = [0] * L
    if cluster is not None and cluster.cp > 1:
        for i, k in enumerate(kinds):
            extra, cp_exchange[i] = _cp_block_bytes(cfg, k, S, cluster, a, cfg.indexer_kinds()[i] == "f", plan, rec[i])
            per_block[i].update(extra)
    sel = S_local * cfg.index_width() * 4
    keeps_sel = _kept_selections(cfg, plan, rec)
    kl = _indexer_kl_kept(cfg, S_local, a)
    # reuse_attention: a DSA block under recompute keeps its attention output and fp32 lse (which its
    # recompute then reuses rather than re-creating: not counted twice in its backward)
    keeps_attn = [rec[i] and plan.reuse_attention and k == "D" for i, k in enumerate(kinds)]
    attn_parts = [S_local * cfg.attn_heads * cfg.kv_lora_rank * a, S_local * cfg.attn_heads * 4]  # output, fp32 lse
    attn_kept = [sum(attn_parts) if keep else 0 for keep in keeps_attn]
    kept, saved, host = [], [], 0  # per block: what stays on the GPU to backward; what it saves, wherever
    for i, (k, blk) in enumerate(zip(kinds, per_block)):
        parts = [state] + ([sel] if keeps_sel[i] else []) + (attn_parts if keeps_attn[i] else [])
        if not rec[i]:
            parts.append(sum(blk.values()))
        if k == "D" and cfg.indexer_kinds()[i] == "f" and kl:
            parts.append(kl)
        b = sum(parts)
        (kept_host if i < n_off else kept_gpu)[f"layer {i} ({k})"] = b
        kept.append(0 if i < n_off else b)
        saved.append(b)
        if i < n_off:
            # at their exact size: the offloader page-locks its own buffers (memory/host_buffers.py), where torch's
            # pinned allocator would round each to a power of two (72 GiB for these 54 at 256k on the H200)
            host += sum(parts)
    fused = ran.get("indexer") == "triton"
    if cluster is not None and cluster.cp > 1:  # the sharded indexer: this rank's queries against the whole sequence's pools
        idx_ws = _indexer_workspace(cfg, S, plan, fused, queries=S_local) if "D" in kinds else 0
    else:
        idx_ws = _indexer_workspace(cfg, S_local, plan, fused) if "D" in kinds else 0
    moe_ws = _moe_workspace(cfg, S_local, plan) if "m" in mlps else 0
    ep_ws = _ep_buffers(cfg, S_local, plan, ep, a) if "m" in mlps else 0
    mhc_ws = _mhc_stream_workspace(cfg, S_local, plan, ran)
    loss_ws = _loss_workspace(cfg, S_local, plan)
    # FSDP shards every parameter byte over the G ranks (the routed experts 1/ep each, then over the G/ep
    # ranks holding the same ones); one GPU runs no FSDP
    base = {"parameters (fp32)": -(-n_params * 4 // G), "AdamW moments (fp32)": -(-n_params * 8 // G)}
    root_g, block_g = _fsdp_bytes(cfg, cluster) if multi else (0, [0] * L)
    c_root = root_g // cluster.param_bytes if multi else 0
    if multi:
        # the root is gathered for the whole step (parallelize: reshard_after_forward=False)
        base[FSDP_ROOT] = root_g
    # autocast's cached bf16 copies: the weights that go through its casts (linear layers); the
    # embedding is indexed in fp32, the experts are cast per call by the MoE (layers/moe.py) and the stacked
    # projections' weights are new tensors each call: their copies are a block's saved activations
    # (_block_activation_bytes), not cached
    n_experts = mlps.count("m") * cfg.n_routed_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    n_stacked = sum(_stacked_weights(cfg, k, m) for k, m in zip(kinds, mlps))
    bf16 = (n_params - n_experts - n_stacked - cfg.vocab_size * cfg.hidden_size) * 2
    if multi and cluster.param_bytes < 4:  # the gathered weights are bf16 already: autocast casts nothing
        bf16 = 0

    # phase 1, the end of the forward: everything kept, the weight copies, the loss (the largest
    # transient of the forward: loss, indexer or MoE workspace)
    all_grads, in_chunks = _chunk == "earlier", bool(_chunk)

    def grads_after(i: int) -> float:
        """Parameter gradients alive in the backward of block i (L: before the first block's): under FSDP
        the root's unsharded until its reduce-scatter at the end of the backward, the blocks' 1/G shards;
        in a chunk of the sequence-chunked step all unsharded (reduced once, after the last chunk), each
        rank's routed experts its 1/ep."""
        if multi and in_chunks:
            return ((c_root if all_grads else head) + sum(block_g[0 if all_grads else i:])) * 4
        if all_grads:
            return n_params * 4
        if multi:
            return head * cluster.param_bytes + per_block_params * (L - i) * 4 / G
        return (head + per_block_params * (L - i)) * 4

    grads = grads_after(L)
    fwd = {"LM head + loss": loss_ws, "indexer workspace": idx_ws, "MoE workspace": moe_ws}
    if ep_ws:
        del fwd["MoE workspace"]
        fwd["MoE workspace + EP all-to-all buffers"] = moe_ws + ep_ws
    top = max(fwd, key=fwd.get)
    phases = [("the end of the forward (loss)", grads, bf16, L, {top: fwd[top]})]
    # phase 2.., the backward of block i: recomputed activations, state gradients, workspaces
    for i in reversed(range(L)):
        moe_i = moe_ws if mlps[i] == "m" else 0
        grads = grads_after(i)
        work = {"recomputed block activations": sum(per_block[i].values()) - attn_kept[i] if rec[i] else 0,
                "state gradients (in flight)": 2 * state,
                # the post-res backward opens the block's backward, the MoE's comes after: the larger counts
                "MoE workspace": moe_i if moe_i >= mhc_ws else 0,
                "mHC stream-op workspace (backward)": mhc_ws if mhc_ws > moe_i else 0,
                "indexer workspace": idx_ws if kinds[i] == "D" and rec[i] and not keeps_sel[i] else 0,
                # an offloaded block's backward holds what it saved, copied back (its input, selection and
                # kept attention output), and what the block before it saved, prefetched while it recomputes
                # (`Offloader.unpack`); the H200's peaks show both (counting one block input instead leaves
                # the D blocks' backward and the K blocks' after them 9 GiB under the measurement)
                "offloaded block's saved tensors (back on the GPU)": saved[i] if i < n_off else 0,
                "prefetched offload block": saved[i - 1] if 0 < i < n_off else 0,
                "DSA latent rows to the chunk's end": _dsa_prefix if kinds[i] == "D" else 0,
                "CP exchange buffers (backward)": cp_exchange[i],
                "EP all-to-all buffers": ep_ws if mlps[i] == "m" else 0,
                # this block gathered and the one before it prefetched; the block's gradient unsharded
                # (fp32 for the reduce-scatter, after a bf16 one where the gathers are bf16)
                "FSDP gathered block parameters (this + prefetched)":
                    (block_g[i] + (block_g[i - 1] if i else 0)) * (cluster.param_bytes if multi else 0),
                "FSDP unsharded block gradient": block_g[i] * ((4 if cluster.param_bytes == 4 else 6) if multi else 0)}
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
    extra = {} if cluster is None else {"cluster": dataclasses.asdict(cluster)}
    return {**extra, "seq_len": S, "cp": cp, "gpu": gpu, "plan": plan.to_dict(), "params": n_params, "peak_phase": phase,
            "phases_gpu_bytes": by_phase,
            "static": static, "kept_gpu": kept_gpu, "kept_host": kept_host,
            "working": dict(released, **{k: v for k, v in work.items() if v}),
            "gpu_bytes": int(total_gpu), "gpu_reserved_bytes": int(total_gpu * ALLOCATOR_SLACK), "host_bytes": int(host),
            "gpu_capacity": cap["memory"], "host_capacity": cap["host"],
            "fits": total_gpu * ALLOCATOR_SLACK <= cap["memory"] * GPU_FIT and host <= cap["host"] * HOST_FIT}


def device_gpu_key(device) -> str:
    """The GPUS key of `device`: a CUDA device's own capacity, registered as "this"; else "cpu"."""
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        total = torch.cuda.get_device_properties(device).total_memory
        GPUS["this"] = {"memory": total, "host": GPUS["h200"]["host"]}
        return "this"
    return "cpu"
