"""Full activation recompute per block, with optional CPU offload of what it keeps.

A block under recompute keeps only its input (and, with `reuse_selection`, the int32 indices its
indexer chose; with `reuse_attention`, a DSA block's attention output and log-sum-exp, so that the
recompute runs only the attention's backward): forward runs without a graph; backward reloads the input, re-runs the block with a
graph, and backpropagates through it, under the autocast state the forward ran with (backward
runs outside the caller's autocast; a recompute without it would redo a bf16 block in fp32).
Written as our own autograd.Function rather than
torch.utils.checkpoint because (a) what is kept must pass through `save_for_backward`, where the
offload hooks can move it to pinned host memory, and (b) the recompute must be able to reuse the
forward's selection instead of re-running the indexer, the most expensive op at 1M tokens. mHC
needs no special case: its 4-stream residual is simply the block's input. A block keeps an incoming
selection only when it reads it (a shared 's' DSA layer); others let it pass by.
"""

from __future__ import annotations

import contextlib

import torch

from ..layers.dsa import keeping_attention
from .offload import Offloader


def _flatten(state):
    if isinstance(state, torch.Tensor):
        return [state], "t"
    blocks, partial = state  # block attention residuals: ((block sums...), partial or None)
    flat = list(blocks) + ([partial] if partial is not None else [])
    return flat, ("attnres", len(blocks), partial is not None)


def _unflatten(flat, spec):
    if spec == "t":
        return flat[0]
    _, nb, has_partial = spec
    return (tuple(flat[:nb]), flat[nb] if has_partial else None)


def _autocast_state(device_type: str) -> list:
    """The autocast settings in force now, for this device type and the CPU."""
    types = [device_type] + (["cpu"] if device_type != "cpu" else [])
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in types]


class _autocast_as:
    def __init__(self, state):
        self.ctxs = [torch.autocast(d, dtype=dt, enabled=on) for d, on, dt in state]

    def __enter__(self):
        for c in self.ctxs:
            c.__enter__()

    def __exit__(self, *a):
        for c in reversed(self.ctxs):
            c.__exit__(*a)
        return False


class _RecomputeBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, holder, spec, selection, *flat):
        ctx.holder, ctx.spec = holder, spec
        ctx.autocast = _autocast_state(flat[0].device.type)
        with torch.no_grad(), holder.paused(), holder.attention_context() as attn:
            out_state, out_sel = holder.run(_unflatten(list(flat), spec), selection, None)
        keep_sel = out_sel if (holder.reuse_selection and out_sel is not None and out_sel is not selection) else None
        keep_attn = [attn["o"], attn["lse"]] if attn else []
        ctx.has_sel_in = selection is not None
        ctx.has_sel_keep = keep_sel is not None
        ctx.has_attn = bool(keep_attn)
        to_save = (list(flat) + ([selection] if selection is not None else []) + ([keep_sel] if keep_sel is not None else [])
                   + keep_attn)
        ctx.save_for_backward(*to_save)  # packed (and offloaded) by the caller's hooks once forward returns
        out_flat, ctx.out_spec = _flatten(out_state)
        holder.out_spec = ctx.out_spec
        if out_sel is None:
            out_sel = torch.empty(0, dtype=torch.int32, device=flat[0].device)
        ctx.mark_non_differentiable(out_sel)
        return (out_sel, *out_flat)

    @staticmethod
    def backward(ctx, _g_sel, *grads):
        saved = list(ctx.saved_tensors)
        attn = tuple(saved[-2:]) if ctx.has_attn else None
        if ctx.has_attn:
            saved = saved[:-2]
        n = len(saved) - ctx.has_sel_in - ctx.has_sel_keep
        flat = [t.detach().requires_grad_(t.is_floating_point()) for t in saved[:n]]
        selection = saved[n] if ctx.has_sel_in else None
        kept = saved[n + ctx.has_sel_in] if ctx.has_sel_keep else None
        replay = ctx.holder.attention_context(attn) if ctx.has_attn else contextlib.nullcontext()
        with torch.enable_grad(), _autocast_as(ctx.autocast), replay:
            out_state, _ = ctx.holder.run(_unflatten(flat, ctx.spec), selection, kept)
        outs, _ = _flatten(out_state)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None, *[t.grad for t in flat])


class _Holder:
    """What the Function needs to re-run one block (kept off the graph's saved tensors)."""

    def __init__(self, block, cu_seqlens, reuse_selection, offloader, reuse_attention=False):
        self.block, self.cu_seqlens, self.reuse_selection, self.offloader = block, cu_seqlens, reuse_selection, offloader
        self.reuse_attention = reuse_attention and block.kind == "D"
        self.out_spec = None

    def run(self, state, selection, forced_selection):
        return self.block(state, selection, cu_seqlens=self.cu_seqlens, forced_selection=forced_selection)

    def attention_context(self, replay: tuple | None = None):
        """With `reuse_attention` on a DSA block (`dsa.keeping_attention`): the first pass yields the dict its
        attention output and lse are left in; with `replay` = (o, lse) the recompute takes them. Otherwise
        a context that yields None."""
        if self.reuse_attention and replay is None:
            return keeping_attention(self.block.mixer, {})
        if self.reuse_attention:
            return keeping_attention(self.block.mixer, {"o": replay[0], "lse": replay[1]}, replay=True)
        return contextlib.nullcontext()

    def offload_ctx(self):
        return _null() if self.offloader is None else self.offloader.hooks(self.block.idx)

    def paused(self):
        return _null() if self.offloader is None else self.offloader.paused()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class RecomputePolicy:
    """`model.block_fn`: run blocks under recompute (every block for `recompute=True`, the first N for
    `recompute=N`: the later blocks keep their activations, which their backward, the first to run, frees
    before any recompute); offload the inputs of the first `offload_layers` blocks (their inputs are
    needed last in backward, so the copies hide best)."""

    def __init__(self, recompute: bool | int = True, offload_layers: int = 0, reuse_selection: bool = True,
                 pin_memory: bool = True, force_offload: bool = False, keep_pinned: bool = True,
                 reuse_attention: bool = False):
        self.recompute = recompute
        self.offload_layers = offload_layers
        self.reuse_selection = reuse_selection
        self.reuse_attention = reuse_attention
        self.offloader = (Offloader(pin_memory=pin_memory, force=force_offload, keep_pinned=keep_pinned)
                          if offload_layers else None)

    def __call__(self, block, state, selection, cu_seqlens):
        if not self.recomputes(block.idx) or not torch.is_grad_enabled():
            return block(state, selection, cu_seqlens=cu_seqlens)
        flat, spec = _flatten(state)
        off = self.offloader if block.idx < self.offload_layers else None
        holder = _Holder(block, cu_seqlens, self.reuse_selection, off, self.reuse_attention)
        reads_sel = block.kind == "D" and block.mixer.indexer is None  # a shared ('s') DSA layer
        with holder.offload_ctx():
            out = _RecomputeBlock.apply(holder, spec, selection if reads_sel else None, *flat)
        sel, out_flat = out[0], list(out[1:])
        if block.kind != "D":
            sel = selection  # KDA blocks pass the last full layer's selection on, untouched
        elif not sel.numel():
            sel = None
        return _unflatten(out_flat, holder.out_spec), sel

    def recomputes(self, idx: int) -> bool:
        return self.recompute is True or idx < self.recompute

    def end_step(self):
        if self.offloader is not None:
            self.offloader.end_step()

    def close(self):
        """The policy is being replaced: give back what it keeps across steps."""
        if self.offloader is not None:
            self.offloader.close()
