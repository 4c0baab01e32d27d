"""DeepSeek Sparse Attention layer: NoPE multi-head latent attention in the absorbed form.

Without rotary dims every head's key is k_h = W_k,h c and its value v_h = W_v,h c, with c the
shared kv_lora-wide latent. Folding W_k,h into the query (q_abs = W_k,h^T q_h) lets all heads
attend to the latent itself: one shared KV "head" (MQA) of width kv_lora, which is what the sparse
kernel gathers. W_v,h is applied after attention, per head. Scale = qk_nope_head_dim^-1/2, as in
the unabsorbed reference.

The token set per query comes from this layer's k-pool indexer ('f' layers) or from the previous
full layer ('s' layers). attn_impl "sparse" (the memory plan's sparse_kernel switch) gathers only the
selected latents, through the sparse_attention op (`longctx.ops.sparse_attention`, the setting
kernels.sparse_attention); "dense" is the O(S^2) masked baseline.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..errors import ConfigError
from ..ops import sparse_attention as sparse_ops
from .kpool_indexer import GrowBuffer, IndexerCache, KPoolIndexer
from .norms import RMSNorm

ATTN_IMPLS = ("sparse", "dense")


class DSACache:
    """Decoding state of one DSA layer: latent rows c of every past token, and the indexer's state."""

    def __init__(self):
        self.latent = GrowBuffer()
        self.indexer = IndexerCache()

    @property
    def length(self) -> int:
        return self.latent.n


class LatentPrefix:
    """Training over sequence chunks (`longctx.memory.sequence_chunks`): the latent rows of the
    tokens before this chunk (`rows`, a leaf that collects their gradient; None for the first
    chunk). The forward records the chunk's own rows in `new_rows`; the selection is passed in, or,
    for a chunk the forward sweep skipped, `select` = {"cache": the sweep's indexer cache}: the first
    pass selects through it (no graph) and leaves the result under "selection", which a recompute of
    the block (the same dict) takes instead of selecting again."""

    def __init__(self, rows: torch.Tensor | None, want_kl: bool = False, select: dict | None = None):
        self.rows = rows
        self.new_rows: torch.Tensor | None = None
        self.want_kl = want_kl  # keep the indexer KL's (detached) inputs for the caller
        self.kl_inputs: tuple | None = None
        self.select = select


class SparseMLA(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.cfg = cfg
        self.n_heads = cfg.attn_heads
        self.nope, self.v_dim, self.kv_lora = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.scale = self.nope**-0.5
        hidden = cfg.hidden_size
        self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, eps=cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.n_heads * self.nope, bias=False)
        self.kv_a_proj = nn.Linear(hidden, self.kv_lora, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_lora, eps=cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, hidden, bias=False)
        self.indexer = KPoolIndexer(cfg, layer_idx) if cfg.indexer_kinds()[layer_idx] == "f" else None
        self.kernels = {"sparse_attention": "auto"}  # set by longctx.kernels.apply_kernels
        # Context parallel: a longctx.distributed CPContext (handed down by the trainer) when x holds only
        # this rank's tokens of each sequence; its `dsa` runs the layer's CP form. None: x is whole.
        self.cp = None
        # Switches set by the memory plan.
        self.attn_impl = "sparse"
        self.attn_chunk = 256  # queries per pass of the torch twin (the indexer has its own `chunk`)
        self.last_impl: str | None = None
        self.indexer_loss_value: torch.Tensor | None = None
        # memory.reuse_attention: set by `keeping_attention` around a recompute's two passes
        self.attention_keep: dict | None = None

    def init_cache(self, batch: int = 1, device=None, dtype=None) -> DSACache:
        """An empty decoding cache (its buffers take the shape, device and dtype of the first tokens)."""
        return DSACache()

    def forward(self, x: torch.Tensor, prev_selection: torch.Tensor | None = None, cache: DSACache | None = None,
                forced_selection: torch.Tensor | None = None, caches_only: bool = False,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> (y [B, T, hidden], selection int32 [B, T, width]).

        prev_selection: the previous full layer's selection (required on shared layers).
        forced_selection: this layer's selection kept from the first forward (recompute with
        selection reuse): the indexer is not run again, and neither is its KL (the first pass has it).
        cache: decoding state; x is then the T newest tokens and the selection holds absolute positions.
        caches_only (with a DSACache): append the latent rows and pooled keys and select, skip the
        attention; returns (None, selection) (the sequence-chunked sweep's last block).
        cu_seqlens (packed documents, the varlen offsets of KDA): the indexer (and its KL) runs on each
        document by itself, so every query selects only tokens of its own document, through the pools
        and the top-k the document would have alone; the attention then gathers those tokens from the
        row. A packed document is attended to exactly as a separate one.
        """
        if caches_only and not isinstance(cache, DSACache):
            raise ValueError(f"DSA layer {self.layer_idx}: caches_only needs a DSACache.")
        docs = None
        if cu_seqlens is not None:
            if cache is not None or self.cp is not None:
                raise ValueError(f"DSA layer {self.layer_idx}: packed documents (cu_seqlens) run whole rows in one "
                                 "process; decoding caches, sequence chunks and context parallelism take unpacked rows.")
            docs = document_spans(cu_seqlens, x.shape[0], x.shape[1])
        if self.cp is not None and cache is None:
            return self.cp.dsa(self, x, prev_selection, forced_selection)
        B, T, _ = x.shape
        H = self.n_heads
        q_latent = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_latent).view(B, T, H, self.nope)
        c = self.kv_a_norm(self.kv_a_proj(x))  # [B, T, kv_lora]
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.kv_lora)
        q_abs = torch.einsum("bthn,hnl->bthl", q, w[:, : self.nope])
        c = c.to(q_abs.dtype)  # under autocast the norm's fp32 weight promotes c; keys/values live in the compute dtype
        chunked, select = isinstance(cache, LatentPrefix), None
        if chunked:
            select = cache.select
            if forced_selection is None and select is not None and "selection" in select:
                forced_selection = select["selection"]  # a recompute: the first pass's selection
            if forced_selection is None and prev_selection is None and (select is None or self.indexer is None):
                raise ValueError(f"DSA layer {self.layer_idx}: a LatentPrefix chunk needs its selection passed in.")
            cache.new_rows = c
            kv = c if cache.rows is None else torch.cat([cache.rows.to(c.dtype), c], 1)
            if cache.want_kl:
                cache.kl_inputs = (x.detach(), q_latent.detach(), q_abs.detach(), kv.detach())
            cache = None
        else:
            kv = c if cache is None else cache.latent.append(c)

        selection = forced_selection
        if selection is None:
            if self.indexer is not None and select is not None:
                with torch.no_grad():  # extends the sweep's pooled keys by this chunk's, once
                    selection = select["selection"] = self.indexer.select(x, q_latent, cache=select["cache"])
            elif self.indexer is not None and docs is not None:
                selection = self._select_per_document(x, q_latent, docs)
            elif self.indexer is not None:
                selection = self.indexer.select(x, q_latent, cache=None if cache is None else cache.indexer)
            elif prev_selection is None:
                raise ValueError(
                    f"DSA layer {self.layer_idx} shares the previous full layer's selection (indexer_pattern 's') "
                    "but no prev_selection was passed."
                )
            else:
                selection = prev_selection
        if selection.shape[:2] != (B, T):
            raise ValueError(f"DSA layer {self.layer_idx}: selection has shape {tuple(selection.shape)}, "
                             f"expected [{B}, {T}, width].")
        if caches_only:
            return None, selection

        o_lat = self._attend(q_abs, kv, selection)
        o = torch.einsum("bthl,hvl->bthv", o_lat, w[:, self.nope :])
        y = self.o_proj(o.reshape(B, T, H * self.v_dim))

        in_backward = torch._C._current_graph_task_id() != -1  # a block recompute: the first pass's KL counts
        if not in_backward:
            self.indexer_loss_value = None
        if (self.indexer is not None and self.cfg.indexer_loss and self.training and cache is None and not chunked
                and forced_selection is None and not in_backward):
            # Unscaled KL (the model applies indexer_loss_coef). Built with its own graph even under
            # no_grad (a recompute's first pass), from detached inputs: only the indexer learns from it.
            dense = T <= self.cfg.indexer_loss_dense_below
            if docs is None:
                self.indexer_loss_value = self.indexer.kl_loss(x, q_latent, q_abs, c, self.scale, selection=selection,
                                                               dense=dense)
            else:  # each document's KL as if alone (dense or not by its own length), the mean over all their queries
                total, count = 0.0, 0.0
                for r, a, b in docs:
                    alone = b - a <= self.cfg.indexer_loss_dense_below
                    kl, n = self.indexer.kl_loss(x[r:r + 1, a:b], q_latent[r:r + 1, a:b], q_abs[r:r + 1, a:b],
                                                 c[r:r + 1, a:b], self.scale, dense=alone, reduce=False,
                                                 selection=None if alone else _shift(selection[r:r + 1, a:b], -a))
                    total, count = total + kl, count + n
                self.indexer_loss_value = total / torch.as_tensor(count).clamp(min=1)
        return y, selection

    def _select_per_document(self, x, q_latent, docs) -> torch.Tensor:
        """The indexer's selection of each document run alone, its indices moved to the document's place
        in the row."""
        B, T = x.shape[:2]
        out = torch.full((B, T, self.indexer.width), -1, dtype=torch.int32, device=x.device)
        for r, a, b in docs:
            out[r:r + 1, a:b] = _shift(self.indexer.select(x[r:r + 1, a:b], q_latent[r:r + 1, a:b]), a)
        return out

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if self.attn_impl == "dense":
            self.last_impl = "dsa:dense-masked"
            return sparse_ops.dense_masked_attention(q, kv, idx, self.scale)
        if self.attn_impl != "sparse":
            raise ConfigError(f"DSA attn_impl must be one of {', '.join(ATTN_IMPLS)} (got {self.attn_impl!r}).")
        impl = sparse_ops.pick(self.kernels["sparse_attention"], q.device, heads=q.shape[2], width=q.shape[3],
                               dtype=q.dtype)
        if impl == "flashmla":
            from ..ops.sparse_attention import flashmla as fm
            from ..ops.sparse_attention import triton as tk

            self.last_impl = "dsa:flashmla-fwd+triton-bwd"
            run = lambda: fm.sparse_attention_flashmla(q, kv, idx, self.scale)  # noqa: E731
            fwd = lambda: fm.sparse_attention_fwd_flashmla(q, kv, idx, self.scale)  # noqa: E731
            kept = lambda o, lse: tk.kept_sparse_attention_triton(q, kv, idx, o, lse, self.scale, group=1)  # noqa: E731
        elif impl == "triton":
            from ..ops.sparse_attention import triton as tk

            # each raises (naming the shape) on what the kernel cannot take
            self.last_impl = "dsa:triton-sparse"
            run = lambda: tk.sparse_attention_triton(q, kv, idx, self.scale)  # noqa: E731
            fwd = lambda: tk.sparse_attention_fwd(q, kv, idx, self.scale)  # noqa: E731
            kept = lambda o, lse: tk.kept_sparse_attention_triton(q, kv, idx, o, lse, self.scale)  # noqa: E731
        else:
            self.last_impl = "dsa:torch-sparse"
            run = lambda: sparse_ops.sparse_attention_torch(q, kv, idx, self.scale, chunk=self.attn_chunk)  # noqa: E731
            fwd = lambda: sparse_ops.sparse_attention_torch(q, kv, idx, self.scale, chunk=self.attn_chunk,  # noqa: E731
                                                            return_lse=True)
            kept = lambda o, lse: sparse_ops.kept_sparse_attention_torch(q, kv, idx, o, lse, self.scale,  # noqa: E731
                                                                         chunk=self.attn_chunk)
        keep = self.attention_keep
        if keep is None:
            return run()
        if "replay" in keep:  # a recompute: the first pass's output, only the backward runs
            self.last_impl += "+kept"
            return kept(*keep["replay"])
        with torch.no_grad():  # a recompute's first pass: keep the output and lse
            o, lse = fwd()
        keep.update(o=o, lse=lse)
        return kept(o, lse) if torch.is_grad_enabled() else o


def document_spans(cu_seqlens, B: int, T: int) -> list[tuple[int, int, int]]:
    """(row, start, end) of every packed document. cu_seqlens are offsets into the flattened [B * T]
    tokens (`data.packing.Batch.cu_seqlens`); a row's start is a document start whether or not they
    list it."""
    cuts = sorted({int(v) for v in torch.as_tensor(cu_seqlens).reshape(-1).tolist() if 0 <= int(v) <= B * T}
                  | {r * T for r in range(B + 1)})
    return [(a // T, a - a // T * T, b - a // T * T) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def _shift(sel: torch.Tensor, by: int) -> torch.Tensor:
    """Selected positions moved by `by`, the -1 of unused slots kept."""
    return torch.where(sel >= 0, sel + by, sel)


@contextlib.contextmanager
def keeping_attention(mixer: SparseMLA, kept: dict, replay: bool = False):
    """memory.reuse_attention around one of a recompute's two passes over a DSA block. First pass: the
    mixer leaves its attention output and log-sum-exp in `kept` (with grad, as under torch checkpoint, it
    returns them through the kept-output Function, so both passes save the same tensors). Replay (the
    recompute): the mixer takes them from `kept` and runs only the attention's backward; `kept` is
    emptied after, the recompute's graph holding what it needs. Used by longctx/memory/recompute.py and
    sequence_chunks.py."""
    if replay and "o" not in kept:
        raise RuntimeError("memory.reuse_attention: the recompute found no kept attention (the first pass did not "
                           "run the sparse attention)")
    mixer.attention_keep = {"replay": (kept["o"], kept["lse"])} if replay else kept
    try:
        yield kept
    finally:
        mixer.attention_keep = None
        if replay:
            kept.clear()
