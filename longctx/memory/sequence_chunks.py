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
   The sweep stops before the last chunk (`memory.seq_skip_last`, on): what it would record there
   is read by no one, so the backward sweep builds that chunk first without forced selections, its
   DSA layers selecting through the sweep's indexer caches and its MoE layers recording their
   routing in the first pass, both replayed by the block recompute. For the same reason the sweep
   runs the last block's mixer only for its caches and selection (no attention output, no MoE):
   the backward sweep's first pass over each chunk routes that MoE (`RoutingTape.live`).
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

Over several processes the step runs over data- and expert-parallel ranks, each on its own rows
(`forward_backward`'s n_labels / n_rows / grad_sync; FSDP as `distributed/fsdp.py` says), not over
context-parallel ones.

Limits (raised as ConfigError by `check_supported`): MoE's aux-loss balancer couples all tokens
of the sequence (a product of sequence means); packed documents (cu_seqlens) are not passed to
chunked steps. The indexer KL is carried like the latent rows: the pooled keys of earlier chunks
are a leaf whose gradient is added to an fp32 buffer that the chunk that built them reads
(chunks must then start on pool borders). Quantile/sign balancing sees each chunk as a micro-batch (the pending
bias is averaged over the chunks, as over micro-batches).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError
from ..layers.dsa import LatentPrefix, keeping_attention
from ..layers.kda import KDAState
from ..layers.moe import MoE, RoutingTape, replaying, routing_tape
from .host_buffers import as_view, host_buffer, release


def check_supported(model) -> None:
    cfg = model.cfg
    if "m" in cfg.mlp_kinds() and cfg.balancer == "aux":
        raise ConfigError("memory.seq_chunk cannot train with model.balancer = aux (its loss couples all tokens of "
                          "the sequence); use model.balancer = quantile or sign, or set memory.seq_chunk = off.")


def check_chunk(model, chunk: int) -> None:
    """With the indexer KL, chunk borders must fall on pool borders (a pool's key is built in one chunk)."""
    P = model.cfg.index_pool
    if model.cfg.indexer_loss and "D" in model.cfg.layer_kinds() and chunk % P:
        raise ConfigError(f"memory.seq_chunk ({chunk}) must be a multiple of model.index_pool ({P}) while "
                          f"model.indexer_loss is on; use e.g. {max(P, chunk // P * P)}.")


class SequenceChunker:
    """The trainer's memory policy for a sequence-chunked stage: `forward_backward` replaces
    `model(x, labels=y).loss.backward()`. `chunk`: tokens per chunk; `checkpoint_blocks`: per-block
    recompute inside a chunk (True: every block; N: the first N, the later ones keep their activations);
    `selection_to_host`: keep selections in pinned host memory (CUDA); `reuse_attention`: a DSA block's
    recompute takes the attention output and lse of its first pass rather than re-running the sparse
    forward (memory.reuse_attention)."""

    def __init__(self, chunk: int, checkpoint_blocks: bool | int = True, selection_to_host: bool = True,
                 pin_memory: bool = True, skip_last_chunk: bool = True, reuse_attention: bool = False,
                 compact_selection: bool = True):
        if chunk < 1:
            raise ConfigError(f"memory.seq_chunk must be >= 1 tokens (got {chunk}).")
        self.chunk, self.checkpoint_blocks = chunk, checkpoint_blocks
        self.selection_to_host, self.pin_memory = selection_to_host, pin_memory
        self.skip_last_chunk = skip_last_chunk  # memory.seq_skip_last
        self.reuse_attention = reuse_attention  # memory.reuse_attention
        self.compact_selection = compact_selection  # memory.compact_selection: one int32 per pool, not per token
        self.last_stats: dict = {}
        self._host: dict = {}  # (layer, chunk) -> pinned selection buffer, reused step after step
        self.progress = None  # optional callable(str): one line per chunk of each sweep (benchmarks)

    # ------------------------------------------------------------------ step
    def forward_backward(self, model, input_ids: torch.Tensor, labels: torch.Tensor, routing: RoutingTape | None = None,
                         *, n_labels: torch.Tensor | None = None, n_rows: int | None = None, grad_sync=None):
        """Forward + backward of the LM loss over [B, S] tokens; gradients accumulate into .grad.
        Returns a ModelOutput with the (detached) loss and per-token losses.

        Over data-parallel ranks each rank runs its own rows, and its loss is its share of the global
        mean: `n_labels` (the label count of all ranks) replaces this rank's as the denominator and
        `n_rows` (all ranks' sequences) its B in the indexer KL's mean, so the ranks' summed gradients
        are the one-process gradient. `grad_sync(on)` is called before each chunk's backward, on for
        the last one only (chunk 0): a sharded model reduces its gradients once per step, holding
        them unsharded across the chunks, rather than once per chunk.

        MoE routing: the forward sweep records every expert choice (a RoutingTape) and the backward
        sweep replays it, so each rebuilt chunk routes exactly as the sweep whose carries it uses.
        `routing`: a tape recorded elsewhere (positions 0..S) to replay in both sweeps instead."""
        from ..model import ModelOutput

        check_supported(model)
        B, S = input_ids.shape
        C = min(self.chunk, S)
        if C < S:
            check_chunk(model, C)
        bounds = self._bounds(S)
        n_tokens = (labels != -100).sum().clamp(min=1) if n_labels is None else n_labels.clamp(min=1)
        tape = routing if routing is not None else RoutingTape()
        # the forward sweep stops before the last chunk: the backward sweep builds that one first, from
        # the carries at its start, selecting and routing by itself (nothing after it needs its carries)
        skip_last = self.skip_last_chunk and len(bounds) > 1
        carries, selections, caches = self._forward_sweep(model, input_ids, bounds, tape=tape, skip_last=skip_last)
        tape.replay = True
        # the sweep ran the last block's mixer only: its MoE routes (and records) in each chunk's first pass
        live_moe = {m for m in model.layers[-1].mlp.modules() if isinstance(m, MoE)}
        cfg, P = model.cfg, model.cfg.index_pool
        kl_layers = [i for i, b in enumerate(model.layers) if b.kind == "D" and b.mixer.indexer is not None]
        self._kl = None
        if cfg.indexer_loss and model.training and kl_layers:
            # KL(attention || indexer) averaged over the queries that have a complete pool before them
            # (t >= P - 1: the indexer always selects one then), and over the full DSA layers
            rows = B if n_rows is None else n_rows
            self._kl = {"scale": cfg.indexer_loss_coef / len(kl_layers) / max(1, rows * (S - (P - 1))),
                        "dense": S <= cfg.indexer_loss_dense_below, "caches": caches}

        kinds = [b.kind for b in model.layers]
        d_carry = [None] * len(kinds)  # per KDA layer: (d recurrent, d conv) of the next chunk's start
        latent = {i: caches[i].latent.view() for i, k in enumerate(kinds) if k == "D"}
        acc = torch.promote_types(model.embed.weight.dtype, torch.float32)  # fp32, or fp64 for an fp64 model
        d_latent = {i: torch.zeros(v.shape, dtype=acc, device=v.device) for i, v in latent.items()}
        d_pool = {}  # per full DSA layer with the KL: gradient of each pooled indexer key, from later chunks
        if self._kl is not None:
            for i in kl_layers:
                pk = caches[i].indexer.pool_keys.view()
                if pk is not None:
                    d_pool[i] = torch.zeros(pk.shape, dtype=acc, device=pk.device)
        losses = []
        total = torch.zeros((), dtype=acc, device=input_ids.device)
        total_kl = torch.zeros((), dtype=acc, device=input_ids.device)
        last = len(bounds) - 1
        for ci in range(last, -1, -1):
            s0, s1 = bounds[ci]
            leaves, outs, grads, pools = {}, [], [], {}
            tape.offset = s0
            # the skipped last chunk's first forward is its first: it records its routing (unless an
            # outside tape is replayed) and keeps the balance bookkeeping; its recompute replays both
            first_pass = skip_last and ci == last
            tape.replay = not first_pass or routing is not None
            tape.live = live_moe if routing is None and not first_pass else set()
            with (contextlib.nullcontext() if first_pass else replaying()), routing_tape(tape):
                with _views_handed_on():
                    tl, ends = model.call(lambda m: self._chunk_graph(
                        m, input_ids[:, s0:s1], labels[:, s0:s1], s0, ci, carries, selections, latent, leaves, pools,
                        caches if first_pass else None))
            tape.replay, tape.live = True, set()
            loss = tl.sum() / n_tokens
            kl = sum(k for k, _, _ in pools.values()) if pools else None
            outs.append(loss if kl is None else loss + kl)
            grads.append(torch.ones_like(loss))
            for i, (_, prev, own) in pools.items():
                if own is not None and own.requires_grad and i in d_pool and not first_pass:
                    n0 = prev.shape[1] if prev is not None else 0
                    outs.append(own)
                    grads.append(d_pool[i][:, n0 : n0 + own.shape[1]].to(own.dtype))
            for i, end in ends.items():
                if kinds[i] == "K" and d_carry[i] is not None:
                    for t, g in zip(end, d_carry[i]):
                        if t.requires_grad and g is not None:
                            outs.append(t)
                            grads.append(g.to(t.dtype))
                elif kinds[i] == "D" and end.requires_grad and not first_pass:  # no later chunk read them
                    outs.append(end)
                    grads.append(d_latent[i][:, s0:s1].to(end.dtype))
            if grad_sync is not None:
                grad_sync(ci == 0)
            with torch.autocast(input_ids.device.type, enabled=False), routing_tape(tape):  # recomputes replay
                torch.autograd.backward(outs, grads)
            for i, lv in leaves.items():
                if kinds[i] == "K":
                    d_carry[i] = tuple(t.grad for t in lv)
                elif lv is not None and lv.grad is not None:
                    d_latent[i][:, :s0] += lv.grad
            for i, (_, prev, _) in pools.items():
                if prev is not None and prev.grad is not None:
                    d_pool[i][:, : prev.shape[1]] += prev.grad
            losses.append(tl.detach())
            total += loss.detach()
            if kl is not None:
                total_kl += kl.detach()
            self._report(f"backward sweep: chunk {ci + 1}/{len(bounds)} done", input_ids)
        token_losses = torch.cat(losses[::-1], 1)
        self.last_stats = {"chunks": len(bounds), "chunk": C, "routing_bytes": tape.bytes()}
        self._kl = None
        aux = {"indexer_kl": total_kl} if cfg.indexer_loss and model.training and kl_layers else {}
        return ModelOutput(loss=total + total_kl, lm_loss=total, token_losses=token_losses, aux=aux)

    @torch.no_grad()
    def token_losses(self, model, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token losses [B, S] of a forward over the sequence in chunks, no graph (evaluation at
        a length whose training step is chunked): the forward sweep alone, the head on each chunk."""
        losses = []
        bounds = self._bounds(input_ids.shape[1])
        self._forward_sweep(model, input_ids, bounds, labels=labels, losses=losses)
        return torch.cat(losses, 1)

    def _bounds(self, S: int) -> list[tuple[int, int]]:
        C = min(self.chunk, S)
        return [(s, min(S, s + C)) for s in range(0, S, C)]

    # ------------------------------------------------------------------ the two sweeps
    @torch.no_grad()
    def _forward_sweep(self, model, input_ids, bounds, labels=None, losses=None, tape=None, skip_last=False):
        return model.call(lambda m: self._sweep(m, input_ids, bounds, labels, losses, tape, skip_last))

    def _sweep(self, model, input_ids, bounds, labels, losses, tape, skip_last):
        """Run every chunk through every layer once; record the carries each chunk starts from.
        With `losses` (a list): append each chunk's token losses and record nothing else. With `tape`:
        MoE routing records into (or replays from) it, positioned at each chunk's start. `skip_last`:
        stop before the last chunk, recording only the KDA carries at its start (the backward sweep
        runs it first, with a graph). A recording sweep runs the last block's mixer for its caches and
        selection only: no attention output, no MLP or MoE (`live_moe`: the backward sweep routes that
        MoE in each chunk's first pass)."""
        record = losses is None
        last_block = len(model.layers) - 1
        B = input_ids.shape[0]
        caches = model.init_caches(B, device=input_ids.device, dtype=self._act_dtype(model, input_ids))
        carries = [[None] * len(bounds) for _ in model.layers]
        selections = [[None] * len(bounds) for _ in model.layers]
        host = self.selection_to_host and input_ids.is_cuda
        with routing_tape(tape) if tape is not None else contextlib.nullcontext():
            for ci, (s0, s1) in enumerate(bounds):
                if tape is not None:
                    tape.offset = s0
                state = model.embed_state(input_ids[:, s0:s1])
                sel = None
                for i, block in enumerate(model.layers):
                    if block.kind == "K" and record:
                        carries[i][ci] = (caches[i].recurrent.clone(), caches[i].conv.clone())
                    # nothing reads the last block's output in a recording sweep: only its caches and selection
                    state, sel = block(state, sel, cache=caches[i], caches_only=record and i == last_block)
                    if block.kind == "D" and block.mixer.indexer is not None and record:
                        kept = block.mixer.indexer.compact(sel) if self._compacts(block) else sel
                        selections[i][ci] = self._keep(kept, host, (i, ci))
                if not record:
                    losses.append(model.chunked_token_losses(model.norm(model.stream.final(state)), labels[:, s0:s1]))
                self._report(f"forward sweep: chunk {ci + 1}/{len(bounds)} done", input_ids)
                if skip_last and ci == len(bounds) - 2:
                    break
        if skip_last:
            for i, block in enumerate(model.layers):
                if block.kind == "K":
                    carries[i][-1] = (caches[i].recurrent.clone(), caches[i].conv.clone())
        return carries, selections, caches

    def _report(self, what: str, x: torch.Tensor) -> None:
        if self.progress is None:
            return
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
            what += f", peak {torch.cuda.max_memory_allocated(x.device) / 2**30:.2f} GiB"
        self.progress(what)

    def _compacts(self, block) -> bool:
        return self.compact_selection and block.mixer.indexer.pool > 1

    def _keep(self, sel: torch.Tensor, host: bool, key) -> torch.Tensor:
        """The selection, or its copy in a host buffer. Pinned buffers are allocated once and reused
        (pinning 8 GiB per DSA layer at 1M each step would cost seconds); the copies are ordered on
        the current stream with the later reads, so reuse is safe."""
        if not host:
            return sel
        nbytes = sel.numel() * sel.element_size()
        raw = self._host.get(key)
        if raw is None or raw.numel() != nbytes:
            if raw is not None:
                if sel.is_cuda:
                    torch.cuda.current_stream(sel.device).synchronize()  # no earlier step's copy still uses it
                release(raw)
            # page-locked at its exact size: torch's pinned allocator would take 2 GiB for a 1.002 GiB selection
            raw = self._host[key] = host_buffer(nbytes, self.pin_memory and sel.is_cuda)
        buf = as_view(raw, sel.shape, sel.dtype)
        buf.copy_(sel, non_blocking=self.pin_memory and sel.is_cuda)
        return buf

    def end_step(self):
        if not self.pin_memory:
            self._host.clear()

    def close(self):
        """Unregister the kept selection buffers now (the policy is being replaced)."""
        if self._host and torch.cuda.is_available():
            torch.cuda.synchronize()
        for raw in self._host.values():
            release(raw)
        self._host.clear()

    @staticmethod
    def _act_dtype(model, x) -> torch.dtype:
        dev = x.device.type
        return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else model.embed.weight.dtype

    def _chunk_graph(self, model, ids, labels, s0, ci, carries, selections, latent, leaves, pools, caches=None):
        """Chunk ci with a graph. Fills `leaves` (the carry inputs whose .grad goes to the previous
        chunk) and, with the indexer KL, `pools` {layer: (KL term, earlier pooled keys (leaf), this
        chunk's pooled keys)}; returns (token losses [B, T], {layer: what this chunk hands on}).
        `caches`: the forward sweep's caches, for a chunk the sweep skipped: its DSA layers select
        through their indexer caches in the first pass and the recompute reuses that selection."""
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
                    if self._compacts(block):
                        forced = block.mixer.indexer.expand(forced, s0)
                select = None
                if forced is None and caches is not None and block.mixer.indexer is not None:
                    select = {"cache": caches[i].indexer}  # the selection lands here for the recompute
                want_kl = self._kl is not None and block.mixer.indexer is not None
                state, sel, new_rows, kl_inputs = self._run(_dsa_block, block, state, sel, rows, forced, want_kl, select)
                ends[i] = new_rows
                if want_kl:  # through the block's call: the indexer's parameters are the block's (FSDP)
                    pools[i] = block.call(lambda b, i=i, s=sel, k=kl_inputs: self._indexer_kl(b.mixer, i, s0, k, s))
        h = model.norm(model.stream.final(state))
        return model.chunked_token_losses(h, labels), ends

    def _indexer_kl(self, mixer, i, s0, kl_inputs, sel):
        """The indexer KL of this chunk's queries, built outside the block's checkpoint (its graph
        holds only detached inputs and the indexer's parameters): pooled keys of earlier chunks are a
        leaf (their gradient goes back to the chunk that built them), this chunk's are built here."""
        x, q_latent, q_abs, kv = kl_inputs
        idx, P = mixer.indexer, mixer.indexer.pool
        cached = self._kl["caches"][i].indexer.pool_keys.view()
        n_prev = s0 // P
        prev = cached[:, :n_prev].detach().requires_grad_(True) if n_prev else None
        with torch.enable_grad():
            n = x.shape[1] // P * P
            own = None
            if n:
                k, gate = idx.key_rows(x)
                own = idx.pool_keys(k[:, :n], gate[:, :n])
            parts = [t for t in (prev, own) if t is not None]
            pk = torch.cat(parts, 1) if len(parts) > 1 else parts[0] if parts else x.new_zeros(x.shape[0], 0, idx.head_dim)
            kl_sum, _ = idx.kl_loss(x, q_latent, q_abs, kv, mixer.scale, selection=sel, dense=self._kl["dense"],
                                    pk=pk, q_offset=s0, reduce=False)
        return kl_sum * self._kl["scale"], prev, own

    def _run(self, fn, block, state, sel, a, b, *more):
        if self.checkpoint_blocks is True or block.idx < self.checkpoint_blocks:
            kw = {}
            if self.reuse_attention and block.kind == "D":
                kept: dict = {}
                # the first pass records the attention output and lse, the recompute replays them
                kw["context_fn"] = lambda: (keeping_attention(block.mixer, kept), keeping_attention(block.mixer, kept, replay=True))
            return checkpoint(fn, block, state, sel, a, b, *more, use_reentrant=False, **kw)
        return fn(block, state, sel, a, b, *more)


@contextlib.contextmanager
def _views_handed_on():
    """FSDP warns when a forward returns a view (an in-place op on it would skip FSDP's backward
    hook); a chunk's token losses and conv window are views that nothing modifies in place."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        yield


def _kda_block(block, state, sel, rec, conv):
    """A KDA block over one chunk from a given carry; returns (state, final recurrent, final conv)."""
    carry = KDAState(conv=conv, recurrent=rec)
    state, _ = block(state, sel, cache=carry)
    return state, carry.recurrent, carry.conv


def _dsa_block(block, state, sel, rows, forced, want_kl=False, select=None):
    """A DSA block over one chunk given the earlier latent rows; returns (state, selection, own rows,
    the indexer KL's detached inputs or None). `select`: see LatentPrefix."""
    prefix = LatentPrefix(rows, want_kl=want_kl, select=select)
    state, sel = block(state, sel, cache=prefix, forced_selection=forced)
    return state, sel, prefix.new_rows, prefix.kl_inputs
