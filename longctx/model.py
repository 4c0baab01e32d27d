"""The hybrid model: embeddings -> blocks (KDA or DSA mixer + dense or MoE MLP) -> norm -> head.

Single-device, readable PyTorch. Memory techniques (recompute, offload, chunking) are applied
around it from `longctx.memory`, and `longctx.kernels.apply_kernels` sets which backend each op runs
(`kernels` on every module that runs one); nothing here depends on them except the LM head + loss,
chunked by `loss_chunk` (the loss op, `longctx.ops.loss`).

    model = LongCtxModel(preset("tiny"))
    logits = model(input_ids).logits              # [B, S, vocab]
    loss = model(input_ids, labels=labels).loss   # chunked head: never materialises [S, vocab]
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from .config import ModelConfig
from .layers.dsa import SparseMLA
from .layers.kda import KimiDeltaAttention
from .layers.mlp import DenseMLP
from .layers.moe import MoE
from .layers.norms import RMSNorm
from .layers.residual import build_residuals
from .ops import loss as loss_ops


@dataclass
class ModelOutput:
    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None  # LM loss + auxiliary losses (what to backprop)
    lm_loss: torch.Tensor | None = None
    token_losses: torch.Tensor | None = None  # [B, S] when asked for
    aux: dict = field(default_factory=dict)


class CallsAsForward:
    """`module.call(fn)` runs `fn(module)` as a forward of the module. Code that drives a module's
    parameters outside its `forward` (the sequence-chunked step calls the model's `embed_state`,
    `norm` and `chunked_token_losses`, and a DSA block's indexer KL, itself) runs through here so
    that FSDP, which registers `call` as a forward method of each unit
    (`distributed.fsdp.parallelize`), gathers the unit's parameters around it as around `forward`.
    `fn` takes no tensors: FSDP would cast, or hook for its gradient, a forward's tensor inputs."""

    def call(self, fn):
        return fn(self)


class Block(CallsAsForward, nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, mixer_res: nn.Module, mlp_res: nn.Module):
        super().__init__()
        self.idx = idx
        self.kind = cfg.layer_kinds()[idx]
        self.mixer = KimiDeltaAttention(cfg, idx) if self.kind == "K" else SparseMLA(cfg, idx)
        if cfg.mlp_kinds()[idx] == "d":
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.swiglu_limit)
        else:
            self.mlp = MoE(cfg, idx)
        self.mixer_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer_res, self.mlp_res = mixer_res, mlp_res

    def forward(self, state, selection=None, cache=None, cu_seqlens=None, forced_selection=None, caches_only=False):
        """One block. Returns (state, selection): DSA layers that run their indexer return theirs.
        `forced_selection` (recompute with selection reuse) replaces this layer's indexer run.
        `caches_only` (with `cache`): only update the decoding caches and select, for a sweep that reads
        nothing after this block; returns (None, selection)."""
        x, ctx = self.mixer_res.enter(state)
        x = self.mixer_norm(x)
        if caches_only:
            if self.kind == "K":
                self.mixer(x, state=cache, cu_seqlens=cu_seqlens)
            else:
                _, selection = self.mixer(x, prev_selection=selection, cache=cache, caches_only=True)
            return None, selection
        if self.kind == "K":
            y = self.mixer(x, state=cache, cu_seqlens=cu_seqlens)
        else:
            y, selection = self.mixer(x, prev_selection=selection, cache=cache, forced_selection=forced_selection,
                                      cu_seqlens=cu_seqlens)
        state = self.mixer_res.exit(state, ctx, y)
        x, ctx = self.mlp_res.enter(state)
        state = self.mlp_res.exit(state, ctx, self.mlp(self.mlp_norm(x)))
        return state, selection


class LongCtxModel(CallsAsForward, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg.validate()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.stream, res = build_residuals(cfg)
        self.layers = nn.ModuleList(Block(cfg, i, *res[i]) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        # Chunked LM head + loss (a memory switch): rows of hidden per chunk; None = one shot.
        self.loss_chunk: int | None = 4096
        self.kernels = {"loss": "auto"}  # the LM head + loss (longctx.ops.loss), set by kernels.apply_kernels
        self.last_impl: str | None = None  # which loss ran last (impl_report shows it next to the layers')
        self.block_fn = None  # set by longctx.memory to wrap blocks (recompute / offload)
        self.init_weights()

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self):
        std = self.cfg.init_std
        for name, mod in self.named_modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, 0.0, std)
        for name, p in self.named_parameters():
            if name.endswith(("experts.gate_up", "experts.down", "router.weight")):
                nn.init.normal_(p, 0.0, std)

    # ------------------------------------------------------------------ trunk
    def embed_state(self, input_ids: torch.Tensor):
        """The residual state the first block reads (the streams of mHC, the embedding otherwise)."""
        h = self.embed(input_ids)
        if torch.is_autocast_enabled(h.device.type):  # the residual stream lives in the compute dtype
            h = h.to(torch.get_autocast_dtype(h.device.type))
        return self.stream.init(h)

    def hidden(self, input_ids: torch.Tensor, caches=None, cu_seqlens=None) -> torch.Tensor:
        state = self.embed_state(input_ids)
        selection = None
        for i, block in enumerate(self.layers):
            cache = caches[i] if caches is not None else None
            if self.block_fn is not None and caches is None:
                state, selection = self.block_fn(block, state, selection, cu_seqlens)
            else:
                state, selection = block(state, selection, cache=cache, cu_seqlens=cu_seqlens)
        return self.norm(self.stream.final(state))

    def forward(self, input_ids, labels=None, caches=None, cu_seqlens=None, return_logits=None,
                token_losses: bool = False) -> ModelOutput:
        h = self.hidden(input_ids, caches=caches, cu_seqlens=cu_seqlens)
        out = ModelOutput()
        if return_logits is None:
            return_logits = labels is None
        if return_logits:
            out.logits = self.lm_head(h)
        if labels is not None:
            tl = self.chunked_token_losses(h, labels)
            n = (labels != -100).sum().clamp(min=1)
            out.lm_loss = tl.sum() / n
            if token_losses:
                out.token_losses = tl.detach()
            out.aux = self.aux_losses()
            out.loss = out.lm_loss + sum(out.aux.values()) if out.aux else out.lm_loss
        return out

    def chunked_token_losses(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy [B, S] fp32 (0 where label == -100), through the loss op
        (`longctx.ops.loss`, the setting kernels.loss): the torch head `loss_chunk` rows at a time under
        checkpoint, so [S, vocab] logits never exist at once (loss_chunk None: one shot, logits
        materialised), or liger's fused linear + cross entropy. auto takes liger on CUDA where it
        imports and loss_chunk is on."""
        B, S, D = h.shape
        impl = loss_ops.pick(self.kernels["loss"], h, chunked=bool(self.loss_chunk))
        self.last_impl = "loss:liger-flce" if impl == "liger" else "loss:torch-chunked" if self.loss_chunk else "loss:torch"
        return loss_ops.token_losses(h.reshape(-1, D), self.lm_head.weight, labels.reshape(-1), impl,
                                     chunk=self.loss_chunk).view(B, S)

    # ------------------------------------------------------------------ bookkeeping
    def aux_losses(self) -> dict:
        """MoE auxiliary losses (aux balancer) and indexer KL losses from the last forward."""
        out = {}
        moe = [m.aux_loss for m in self.modules() if isinstance(m, MoE) and getattr(m, "aux_loss", None) is not None]
        if moe:
            out["moe_aux"] = sum(moe)
        idx = [m.indexer_loss_value for m in self.modules()
               if isinstance(m, SparseMLA) and getattr(m, "indexer_loss_value", None) is not None]
        if idx:
            out["indexer_kl"] = self.cfg.indexer_loss_coef * sum(idx) / len(idx)
        return out

    def clear_aux(self):
        for m in self.modules():
            if isinstance(m, MoE):
                m.aux_loss = None
            if isinstance(m, SparseMLA):
                m.indexer_loss_value = None

    def apply_balance_updates(self):
        """Apply each MoE's pending router-bias update (call after the optimizer step)."""
        for m in self.modules():
            if isinstance(m, MoE):
                m.apply_balance_update()

    def moe_balance(self) -> float | None:
        vals = [m.last_balance for m in self.modules() if isinstance(m, MoE) and getattr(m, "last_balance", None)]
        return max(vals) if vals else None

    def impl_report(self) -> str:
        """Which implementation each layer kind ran in the last forward, e.g. 'kda:fla-chunk x9'."""
        c = Counter(m.last_impl for m in self.modules() if getattr(m, "last_impl", None))
        return ", ".join(f"{k} x{v}" for k, v in sorted(c.items()))

    # ------------------------------------------------------------------ decoding
    def init_caches(self, batch: int, device=None, dtype=None) -> list:
        device = device or self.embed.weight.device
        dtype = dtype or self.embed.weight.dtype
        return [b.mixer.init_state(batch, device, dtype) if b.kind == "K" else b.mixer.init_cache(batch, device, dtype)
                for b in self.layers]

    def num_parameters(self) -> dict:
        total = sum(p.numel() for p in self.parameters())
        cfg = self.cfg
        inactive = 0
        for m in self.modules():
            if isinstance(m, MoE):
                per_expert = m.experts.gate_up[0].numel() + m.experts.down[0].numel()
                inactive += per_expert * (cfg.n_routed_experts - cfg.experts_per_token)
        return {"total": total, "active": total - inactive}


def build_model(cfg: ModelConfig, device=None, dtype=None) -> LongCtxModel:
    model = LongCtxModel(cfg)
    return model.to(device=device, dtype=dtype) if (device or dtype) else model
