"""Sequence-chunked training step: exact backprop through S tokens with O(chunk) activations.

Why. Whole-block recompute keeps each block's input, n_streams x hidden bf16 per token per layer
(12 GiB a layer at 1M tokens for h200-ref, 144 GiB for twelve), and recomputes one block over the
whole sequence (~180 GiB of activations at 1M). Both grow with S, so no switch that works block by
block can fit 1M tokens on one H200. But in this model only two things cross token positions:

    KDA   its recurrent state [B, H, K, V] (fp32) and the conv window [B, 3*H*K, conv-1];
    DSA   the latent rows c of earlier tokens ([B, t, kv_lora]: keys and values of the absorbed
          MLA) and the indexer's pooled keys (which get no LM gradient; the selection is kept);

mHC, norms, MLP/MoE and the head + loss are per token. So the sequence can be cut into chunks and
backpropagated like an RNN with checkpoints at the chunk boundaries:

1. forward sweep (no graph): chunk by chunk through all layers, as a prefill with the decoding
   caches; record each KDA layer's carry at each chunk start; the DSA caches collect every token's
   latent row (one [B, S, kv_lora] buffer per DSA layer) and pooled indexer keys; keep each full
   DSA layer's int32 selection of each chunk (in pinned host memory on CUDA).
2. backward sweep, last chunk first: rebuild chunk c from its embeddings and the recorded carries
   with a graph (each block under per-block checkpointing, so one block's activations live at a
   time), take its tokens' loss, and backpropagate it together with what the later chunks sent
   back: the gradient of the chunk's final KDA carries and of its own latent rows. The gradients of
   its initial carries go to chunk c-1; those of the earlier latent rows are added to an fp32
   buffer that chunk c-1 reads.

The result is the whole-sequence gradient (tests compare in fp64), for one extra forward, as
with full recompute. What stays O(S): the latent rows and their fp32 gradient (6 bytes x kv_lora
per token per DSA layer, 3 GiB at 1M), the selections (host), pooled keys, and the KDA carries
(768 KiB per layer per chunk for h200-ref).

Limits (raised as ConfigError by `check_supported`): MoE's aux-loss balancer and the indexer KL
loss are sums over the whole sequence of non-separable terms; packed documents (cu_seqlens) are not
passed to chunked steps. Quantile/sign balancing sees each chunk as a micro-batch (the pending
bias is averaged over the chunks, as over micro-batches).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError
from ..layers.dsa import LatentPrefix
from ..layers.kda import KDAState
from ..layers.moe import replaying


def check_supported(model) -> None:
    cfg = model.cfg
    if "m" in cfg.mlp_kinds() and cfg.balancer == "aux":
        raise ConfigError("memory.seq_chunk cannot train with model.balancer = aux (its loss couples all tokens of "
                          "the sequence); use model.balancer = quantile or sign, or set memory.seq_chunk = off.")
    if cfg.indexer_loss and "D" in cfg.layer_kinds():
        raise ConfigError("memory.seq_chunk does not compute the indexer KL loss (model.indexer_loss = true); train the "
                          "indexer in a shorter stage and set model.indexer_loss = false here, or memory.seq_chunk = off.")


class SequenceChunker:
    """The trainer's memory policy for a sequence-chunked stage: `forward_backward` replaces
    `model(x, labels=y).loss.backward()`. `chunk`: tokens per chunk; `checkpoint_blocks`: per-block
    recompute inside a chunk; `selection_to_host`: keep selections in pinned host memory (CUDA)."""

    def __init__(self, chunk: int, checkpoint_blocks: bool = True, selection_to_host: bool = True,
                 pin_memory: bool = True):
        if chunk < 1:
            raise ConfigError(f"memory.seq_chunk must be >= 1 tokens (got {chunk}).")
        self.chunk, self.checkpoint_blocks = chunk, checkpoint_blocks
        self.selection_to_host, self.pin_memory = selection_to_host, pin_memory
        self.last_stats: dict = {}
        self._host: dict = {}  # (layer, chunk) -> pinned selection buffer, reused step after step
        self.progress = None  # optional callable(str): one line per chunk of each sweep (benchmarks)

    # ------------------------------------------------------------------ step
    def forward_backward(self, model, input_ids: torch.Tensor, labels: torch.Tensor):
        """Forward + backward of the LM loss over [B, S] tokens; gradients accumulate into .grad.
        Returns a ModelOutput with the (detached) loss and per-token losses."""
        from ..model import ModelOutput

        check_supported(model)
        S = input_ids.shape[1]
        C = min(self.chunk, S)
        bounds = [(s, min(S, s + C)) for s in range(0, S, C)]
        n_tokens = (labels != -100).sum().clamp(min=1)
        carries, selections, caches = self._forward_sweep(model, input_ids, bounds)

        kinds = [b.kind for b in model.layers]
        d_carry = [None] * len(kinds)  # per KDA layer: (d recurrent, d conv) of the next chunk's start
        latent = {i: caches[i].latent.view() for i, k in enumerate(kinds) if k == "D"}
        acc = torch.promote_types(model.embed.weight.dtype, torch.float32)  # fp32, or fp64 for an fp64 model
        d_latent = {i: torch.zeros(v.shape, dtype=acc, device=v.device) for i, v in latent.items()}
        losses = []
        total = torch.zeros((), dtype=acc, device=input_ids.device)
        for ci in range(len(bounds) - 1, -1, -1):
            s0, s1 = bounds[ci]
            leaves, outs, grads = {}, [], []
            with replaying():
                tl, ends = self._chunk_graph(model, input_ids[:, s0:s1], labels[:, s0:s1], s0, ci, carries,
                                             selections, latent, leaves)
            loss = tl.sum() / n_tokens
            outs.append(loss)
            grads.append(torch.ones_like(loss))
            for i, end in ends.items():
                if kinds[i] == "K" and d_carry[i] is not None:
                    for t, g in zip(end, d_carry[i]):
                        if t.requires_grad and g is not None:
                            outs.append(t)
                            grads.append(g.to(t.dtype))
                elif kinds[i] == "D" and end.requires_grad:
                    outs.append(end)
                    grads.append(d_latent[i][:, s0:s1].to(end.dtype))
            with torch.autocast(input_ids.device.type, enabled=False):  # backward as outside the step's autocast
                torch.autograd.backward(outs, grads)
            for i, lv in leaves.items():
                if kinds[i] == "K":
                    d_carry[i] = tuple(t.grad for t in lv)
                elif lv is not None and lv.grad is not None:
                    d_latent[i][:, :s0] += lv.grad
            losses.append(tl.detach())
            total += loss.detach()
            self._report(f"backward sweep: chunk {ci + 1}/{len(bounds)} done", input_ids)
        token_losses = torch.cat(losses[::-1], 1)
        self.last_stats = {"chunks": len(bounds), "chunk": C}
        return ModelOutput(loss=total, lm_loss=total, token_losses=token_losses, aux={})

    @torch.no_grad()
    def token_losses(self, model, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token losses [B, S] of a forward over the sequence in chunks, no graph (evaluation at
        a length whose training step is chunked): the forward sweep alone, the head on each chunk."""
        S = input_ids.shape[1]
        C = min(self.chunk, S)
        bounds = [(s, min(S, s + C)) for s in range(0, S, C)]
        losses = []
        self._forward_sweep(model, input_ids, bounds, labels=labels, losses=losses)
        return torch.cat(losses, 1)

    # ------------------------------------------------------------------ the two sweeps
    @torch.no_grad()
    def _forward_sweep(self, model, input_ids, bounds, labels=None, losses=None):
        """Run every chunk through every layer once; record the carries each chunk starts from.
        With `losses` (a list): append each chunk's token losses and record nothing else."""
        record = losses is None
        B = input_ids.shape[0]
        caches = model.init_caches(B, device=input_ids.device, dtype=self._act_dtype(model, input_ids))
        carries = [[None] * len(bounds) for _ in model.layers]
        selections = [[None] * len(bounds) for _ in model.layers]
        host = self.selection_to_host and input_ids.is_cuda
        for ci, (s0, s1) in enumerate(bounds):
            state = model.embed_state(input_ids[:, s0:s1])
            sel = None
            for i, block in enumerate(model.layers):
                if block.kind == "K" and record:
                    carries[i][ci] = (caches[i].recurrent.clone(), caches[i].conv.clone())
                state, sel = block(state, sel, cache=caches[i])
                if block.kind == "D" and block.mixer.indexer is not None and record:
                    selections[i][ci] = self._keep(sel, host, (i, ci))
            if not record:
                losses.append(model.chunked_token_losses(model.norm(model.stream.final(state)), labels[:, s0:s1]))
            self._report(f"forward sweep: chunk {ci + 1}/{len(bounds)} done", input_ids)
        return carries, selections, caches

    def _report(self, what: str, x: torch.Tensor) -> None:
        if self.progress is None:
            return
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
            what += f", peak {torch.cuda.max_memory_allocated(x.device) / 2**30:.2f} GiB"
        self.progress(what)

    def _keep(self, sel: torch.Tensor, host: bool, key) -> torch.Tensor:
        """The selection, or its copy in a host buffer. Pinned buffers are allocated once and reused
        (pinning 8 GiB per DSA layer at 1M each step would cost seconds); the copies are ordered on
        the current stream with the later reads, so reuse is safe."""
        if not host:
            return sel
        buf = self._host.get(key)
        if buf is None or buf.shape != sel.shape or buf.dtype != sel.dtype:
            buf = self._host[key] = torch.empty(sel.shape, dtype=sel.dtype, pin_memory=self.pin_memory)
        buf.copy_(sel, non_blocking=self.pin_memory)
        return buf

    def end_step(self):
        if not self.pin_memory:
            self._host.clear()

    @staticmethod
    def _act_dtype(model, x) -> torch.dtype:
        dev = x.device.type
        return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else model.embed.weight.dtype

    def _chunk_graph(self, model, ids, labels, s0, ci, carries, selections, latent, leaves):
        """Chunk ci with a graph. Fills `leaves` (the carry inputs whose .grad goes to the previous
        chunk) and returns (token losses [B, T], {layer: what this chunk hands on})."""
        state = model.embed_state(ids)
        sel, ends = None, {}
        for i, block in enumerate(model.layers):
            if block.kind == "K":
                rec, conv = carries[i][ci]
                rec, conv = rec.detach().requires_grad_(ci > 0), conv.detach().requires_grad_(ci > 0)
                leaves[i] = (rec, conv)
                state, rec1, conv1 = self._run(_kda_block, block, state, sel, rec, conv)
                ends[i] = (rec1, conv1)
            else:
                rows = None
                if s0 > 0:
                    rows = latent[i][:, :s0].detach().requires_grad_(True)
                leaves[i] = rows
                forced = selections[i][ci]
                if forced is not None:
                    forced = forced.to(ids.device, non_blocking=True)
                state, sel, new_rows = self._run(_dsa_block, block, state, sel, rows, forced)
                ends[i] = new_rows
        h = model.norm(model.stream.final(state))
        return model.chunked_token_losses(h, labels), ends

    def _run(self, fn, block, state, sel, a, b):
        if self.checkpoint_blocks:
            return checkpoint(fn, block, state, sel, a, b, use_reentrant=False)
        return fn(block, state, sel, a, b)


def _kda_block(block, state, sel, rec, conv):
    """A KDA block over one chunk from a given carry; returns (state, final recurrent, final conv)."""
    carry = KDAState(conv=conv, recurrent=rec)
    state, _ = block(state, sel, cache=carry)
    return state, carry.recurrent, carry.conv


def _dsa_block(block, state, sel, rows, forced):
    """A DSA block over one chunk given the earlier latent rows; returns (state, selection, own rows)."""
    prefix = LatentPrefix(rows)
    state, sel = block(state, sel, cache=prefix, forced_selection=forced)
    return state, sel, prefix.new_rows
