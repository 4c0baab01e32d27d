"""The memory plan: every memory technique as a named switch, and how to apply it to a model.

    switch              on (default)                              off (`baseline`)
    sparse_kernel       DSA gathers only the selected latents     dense attention under the top-k mask, O(S^2)
    chunked_indexer     score/select `indexer_chunk` queries/pass  all queries at once in torch, O(S^2/P)
                        (on CUDA the Triton path, O(1024 x S/P))  (also on CUDA)
    recompute           per-block recompute ("auto": as few        every activation kept for backward
                        blocks as the estimate needs; N: the
                        first N blocks, the later ones keep their
                        activations)
    offload             inputs of N blocks to pinned host memory  all on the GPU
                        ("auto": as few blocks as needed to fit)
    pin_memory          pinned host buffers, async copies          pageable buffers
    keep_pinned         the offloader keeps one step's pinned      pinned blocks back to the OS every step
                        buffers for the next (flat: the same       (re-pinning GiBs each step: 51.2 s
                        buffers every step; no re-pinning)         vs 18.3 s at 256k, H200)
    reuse_selection     recompute keeps the int32 selection        recompute re-runs the indexer
    reuse_attention     block recompute keeps each DSA layer's     recompute re-runs the sparse attention
                        attention output and log-sum-exp from the  forward (the kept output costs
                        forward and runs only its backward (block  S x heads x kv_lora x 2 bytes per DSA
                        recompute and the sequence-chunked step's  layer: 2 GiB at 128k for h200-ref,
                        checkpoints; the auto plan keeps it while  per chunk in the chunked step;
                        offload makes room, drops it before the    H200: 3.50 vs 3.71 s at 128k, +4 GiB)
                        sequence is chunked)
    router_release      no router tensors outlive the forward      probabilities/indices kept on the module
    mhc_cast_recompute  mHC's fp32 input cast redone in backward  the fp32 copy saved
    mhc_chunk           liger's mHC stream ops over `mhc_chunk`   liger's own Functions: fp32 copies of
                        tokens at a time (one chunk's fp32        [S, n, D] in forward and backward
                        buffers; liger's results to 1.2e-5)       (17.25 GiB at 256k, h200-ref)
    moe_bf16_combine    expert outputs combined in bf16            combined in fp32
    moe_chunk           MoE over `moe_chunk` tokens at a time      all tokens at once (peak follows skew)
    loss_chunk          LM head + loss over `loss_chunk` rows      [S, vocab] logits materialised
    seq_chunk           the step runs over the sequence in chunks  the whole sequence at once
                        of N tokens, backprop carried between them
    compact_selection   the chunked step keeps each chunk's        the int32 token indices (2,051 a token
                        selection as one int32 per selected pool   per DSA layer for h200-ref: 96 GiB of
                        (expanded exactly when its chunk is        host memory at 4M tokens against 24)
                        rebuilt)
    seq_skip_last       the chunked step's forward sweep stops     the sweep runs every chunk (the last
                        before the last chunk (its backward sweep  one's carries are never read)
                        builds that chunk first, selecting and
                        routing by itself)
                        ("auto": only when block recompute and
                        offload cannot fit; see sequence_chunks)

`MemoryPlan.from_dict({...})` validates names and values (one sentence per mistake);
`apply_plan(model, plan)` sets the module switches and returns the block policy the trainer calls
`end_step()` on; `longctx.memory.planner` resolves the "auto" switches first.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..config.model import _check_types
from ..config.train import check_recompute_count
from ..errors import ConfigError, did_you_mean
from ..ops.mhc.liger import DEFAULT_CHUNK as DEFAULT_MHC_CHUNK


@dataclass
class MemoryPlan:
    sparse_kernel: bool = True
    chunked_indexer: bool = True
    indexer_chunk: int = 1024
    recompute: str = "auto"  # "auto" | "on" | "off" | a number of blocks, e.g. "9" (the first 9)
    offload: str = "auto"  # "auto" | "off" | a number of blocks, e.g. "6"
    pin_memory: bool = True
    keep_pinned: bool = True
    reuse_selection: bool = True
    reuse_attention: bool = True
    router_release: bool = True
    mhc_cast_recompute: bool = True
    mhc_chunk: int = DEFAULT_MHC_CHUNK  # tokens per call of liger's mHC stream kernels (0 = liger's whole-sequence Functions)
    moe_bf16_combine: bool = True
    moe_chunk: int = 65536
    loss_chunk: int = 8192
    attn_chunk: int = 1024  # queries per pass of the torch sparse-attention twin
    seq_chunk: str = "auto"  # "auto" | "off" | tokens per chunk, e.g. "65536"
    seq_skip_last: bool = True
    compact_selection: bool = True

    @classmethod
    def baseline(cls) -> "MemoryPlan":
        """What a plain implementation does: every technique off."""
        return cls(sparse_kernel=False, chunked_indexer=False, recompute="off", offload="off", pin_memory=False,
                   keep_pinned=False, reuse_selection=False, reuse_attention=False, router_release=False, mhc_cast_recompute=False, moe_bf16_combine=False,
                   mhc_chunk=0, moe_chunk=0, loss_chunk=0, seq_chunk="off", seq_skip_last=False,
                   compact_selection=False)

    @classmethod
    def from_dict(cls, d: dict | None, base: "MemoryPlan | None" = None) -> "MemoryPlan":
        d = dict(d or {})
        if d.pop("baseline", False):
            base = cls.baseline()
        known = {f.name for f in dataclasses.fields(cls)}
        for k in d:
            if k not in known:
                raise ConfigError(f"unknown setting memory.{k}{did_you_mean(k, known) or '; the switches are ' + ', '.join(sorted(known))}")
        for k in ("recompute", "offload", "seq_chunk"):
            if k in d and isinstance(d[k], int) and not isinstance(d[k], bool):
                d[k] = str(d[k])
        plan = dataclasses.replace(base or cls(), **d)
        _check_types(plan, "memory")
        if plan.recompute not in ("auto", "on", "off") and not plan.recompute.isdigit():
            raise ConfigError(f"memory.recompute must be auto, on, off or a number of blocks (got {plan.recompute!r}).")
        if plan.offload not in ("auto", "off") and not plan.offload.isdigit():
            raise ConfigError(f"memory.offload must be auto, off or a number of blocks (got {plan.offload!r}).")
        if plan.seq_chunk not in ("auto", "off") and not (plan.seq_chunk.isdigit() and int(plan.seq_chunk) > 0):
            raise ConfigError(f"memory.seq_chunk must be auto, off or a number of tokens such as 65536 (got {plan.seq_chunk!r}).")
        for k in ("indexer_chunk", "attn_chunk"):
            if getattr(plan, k) < 1:
                raise ConfigError(f"memory.{k} must be >= 1 (got {getattr(plan, k)}).")
        for k in ("moe_chunk", "loss_chunk", "mhc_chunk"):
            if getattr(plan, k) < 0:
                raise ConfigError(f"memory.{k} must be >= 0 (0 = off), got {getattr(plan, k)}.")
        return plan

    def recompute_blocks(self, num_layers: int) -> int:
        """How many blocks recompute, the first ones: all for "on", N for "N" (at most the model's), none for
        "off" unless blocks are offloaded (an offloaded input is read back only by a recompute, so offload
        implies it). "auto" must be resolved first."""
        if self.recompute == "auto":
            raise ValueError("memory.recompute = auto is resolved by longctx.memory.planner first")
        check_recompute_count(self.recompute, num_layers)
        if self.recompute == "off":
            return num_layers if self.offload_blocks() else 0
        return num_layers if self.recompute == "on" else int(self.recompute)

    def offload_blocks(self) -> int:
        return int(self.offload) if self.offload.isdigit() else 0

    def seq_chunk_tokens(self) -> int:
        return int(self.seq_chunk) if self.seq_chunk.isdigit() else 0

    def describe(self) -> str:
        on = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is True]
        off = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is False]
        return (f"recompute={self.recompute} offload={self.offload} seq_chunk={self.seq_chunk} moe_chunk={self.moe_chunk} mhc_chunk={self.mhc_chunk} "
                f"loss_chunk={self.loss_chunk} indexer_chunk={self.indexer_chunk if self.chunked_indexer else 'off'} "
                f"| on: {', '.join(on) or '-'} | off: {', '.join(off) or '-'}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def apply_plan(model, plan: MemoryPlan):
    """Set every module's switches from `plan`; install the block policy. Returns it (or None).
    recompute/offload "auto" must be resolved first (`planner.plan_for_stage`, `planner.auto_plan`)."""
    from ..layers.dsa import SparseMLA
    from ..layers.moe import MoE
    from ..layers.residual import MHC
    from .recompute import RecomputePolicy

    if "auto" in (plan.recompute, plan.offload):
        raise ValueError(f"apply_plan needs a resolved plan (recompute={plan.recompute!r}, offload={plan.offload!r}); "
                         "resolve 'auto' with longctx.memory.planner.auto_plan or plan_for_stage first.")
    # an unresolved seq_chunk "auto" means the whole sequence: only the estimator turns chunking on
    chunked = plan.seq_chunk_tokens() > 0
    if chunked:
        from .sequence_chunks import check_chunk, check_supported

        check_supported(model)
        check_chunk(model, plan.seq_chunk_tokens())
        if plan.offload_blocks():
            raise ConfigError(f"memory.offload={plan.offload} does not combine with memory.seq_chunk={plan.seq_chunk} "
                              "(a chunk's block inputs are small); set memory.offload = off.")
    n_rec = plan.recompute_blocks(len(model.layers))
    if plan.recompute.isdigit() and plan.offload_blocks() > n_rec:
        raise ConfigError(f"memory.offload = {plan.offload} offloads the inputs of blocks that memory.recompute = "
                          f"{plan.recompute} does not recompute (only the first {n_rec}); offload at most {n_rec} blocks, "
                          "or recompute more.")
    blocks = not chunked and n_rec > 0
    if blocks and getattr(model.cfg, "balancer", None) == "aux" and "m" in model.cfg.mlp_kinds():
        raise ConfigError(
            f"memory.recompute={plan.recompute} / memory.offload={plan.offload} would drop the MoE auxiliary loss "
            "(model.balancer = aux: block recompute runs the forward without a graph); use model.balancer = quantile "
            "or sign, or set memory.recompute = off and memory.offload = off.")

    for m in model.modules():
        if isinstance(m, SparseMLA):
            m.attn_impl = "sparse" if plan.sparse_kernel else "dense"
            m.attn_chunk = plan.attn_chunk
            if m.indexer is not None:
                m.indexer.chunk = plan.indexer_chunk if plan.chunked_indexer else None
        elif isinstance(m, MoE):
            m.chunk_tokens = plan.moe_chunk or None
            m.combine_dtype = None if plan.moe_bf16_combine else torch.float32
            m.release_router_state = plan.router_release
        elif isinstance(m, MHC):
            m.recompute_cast = plan.mhc_cast_recompute
            m.liger_chunk = plan.mhc_chunk
    model.loss_chunk = plan.loss_chunk or None
    if chunked:
        from .sequence_chunks import SequenceChunker

        model.block_fn = None
        return SequenceChunker(plan.seq_chunk_tokens(), checkpoint_blocks=n_rec,
                               pin_memory=plan.pin_memory, skip_last_chunk=plan.seq_skip_last,
                               reuse_attention=plan.reuse_attention, compact_selection=plan.compact_selection)
    if blocks:
        model.block_fn = RecomputePolicy(recompute=n_rec, offload_layers=plan.offload_blocks(),
                                         reuse_selection=plan.reuse_selection, reuse_attention=plan.reuse_attention,
                                         pin_memory=plan.pin_memory,
                                         keep_pinned=plan.keep_pinned)
    else:
        model.block_fn = None
    return model.block_fn
