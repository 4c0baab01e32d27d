"""The hybrid model: embeddings -> blocks (KDA or DSA mixer + dense or MoE MLP) -> norm -> head.

Single-device, readable PyTorch. Memory techniques (recompute, offload, chunking) are applied
around it from `longctx.memory`; nothing here depends on them except the chunked LM head + loss,
which lives here because it *is* the head.

    model = LongCtxModel(preset("tiny"))
    logits = model(input_ids).logits              # [B, S, vocab]
    loss = model(input_ids, labels=labels).loss   # chunked head: never materialises [S, vocab]
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig
from .layers.dsa import SparseMLA
from .layers.kda import KimiDeltaAttention
from .layers.mlp import DenseMLP
from .layers.moe import MoE
from .layers.norms import RMSNorm
from .layers.residual import build_residuals
from .ops.loss.liger import LIGER_ROWS_PER_CALL, liger_token_losses, resolve_loss_impl


@dataclass
class ModelOutput:
    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None  # LM loss + auxiliary losses (what to backprop)
    lm_loss: torch.Tensor | None = None
    token_losses: torch.Tensor | None = None  # [B, S] when asked for
    aux: dict = field(default_factory=dict)


class Block(nn.Module):
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
            y, selection = self.mixer(x, prev_selection=selection, cache=cache, forced_selection=forced_selection)
        state = self.mixer_res.exit(state, ctx, y)
        x, ctx = self.mlp_res.enter(state)
        state = self.mlp_res.exit(state, ctx, self.mlp(self.mlp_norm(x)))
        return state, selection


class LongCtxModel(nn.Module):
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
        # LM head + loss implementation: "auto" | "torch" | "liger" (longctx.ops.loss.liger); `last_impl`
        # says which ran in the last loss (impl_report shows it next to the layers').
        self.loss_impl: str = "auto"
        self.last_impl: str | None = None
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
        """Per-token cross entropy [B, S] fp32 (0 where label == -100).

        loss_impl "torch": the head applied `loss_chunk` rows at a time under checkpoint, so [S, vocab]
        logits never exist at once (loss_chunk None: one shot, logits materialised).
        loss_impl "liger": liger-kernel's fused linear + cross entropy with reduction="none" (per-token
        losses and a correct per-token backward in liger 0.8.5), LIGER_ROWS_PER_CALL rows per call and
        liger's own chunking inside; `loss_chunk` does not apply. Raises ConfigError when it cannot run.
        loss_impl "auto": liger on CUDA when liger imports and loss_chunk is on, torch otherwise (on CUDA
        without liger it warns once). See longctx.ops.loss.liger.
        """
        if resolve_loss_impl(self.loss_impl, h, chunked=bool(self.loss_chunk)) == "liger":
            B, S, D = h.shape
            self.last_impl = "loss:liger-flce"
            return liger_token_losses(h.reshape(-1, D), self.lm_head.weight, labels.reshape(-1),
                                      rows_per_call=LIGER_ROWS_PER_CALL).view(B, S)
        self.last_impl = "loss:torch-chunked" if self.loss_chunk else "loss:torch"
        B, S, D = h.shape
        flat_h, flat_y = h.reshape(-1, D), labels.reshape(-1)
        step = self.loss_chunk or flat_h.shape[0]
        parts = []
        for s0 in range(0, flat_h.shape[0], step):
            hh, yy = flat_h[s0 : s0 + step], flat_y[s0 : s0 + step]
            if self.loss_chunk and torch.is_grad_enabled() and hh.requires_grad:
                parts.append(checkpoint(self._ce, hh, yy, self.lm_head.weight, use_reentrant=False))
            else:
                parts.append(self._ce(hh, yy, self.lm_head.weight))
        return torch.cat(parts).view(B, S)

    @staticmethod
    def _ce(h, y, w):
        return F.cross_entropy(F.linear(h, w).float(), y, ignore_index=-100, reduction="none")

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

    def set_backend(self, backend: str):
        """auto | torch | triton for every kernel switch: KDA, DSA attention and the k-pool indexers
        ('fla', the KDA's name for its Triton kernels, sets the indexers to 'triton')."""
        for m in self.modules():
            if isinstance(m, (KimiDeltaAttention, SparseMLA)):
                m.backend = backend
            if isinstance(m, SparseMLA) and m.indexer is not None:
                m.indexer.backend = "triton" if backend == "fla" else backend

    @contextlib.contextmanager
    def plain_torch(self):
        """Every switch on its plain-torch path inside the block (KDA, its conv, DSA attention, the
        indexers, mHC, the LM head + loss), restored after: the fp32 references of the GPU tests.
        `set_backend("torch")` alone leaves mHC on liger and the conv on fla where they are `auto`."""
        kept = [(m, a, getattr(m, a)) for m in self.modules()
                for a in ("backend", "conv_impl", "norm_impl", "impl", "loss_impl") if hasattr(m, a)]
        try:
            self.set_backend("torch")
            self.set_impls(loss="torch", residual="torch", kda_conv="torch", kda_norm="torch", norm="torch",
                           swiglu="torch")
            yield self
        finally:
            for m, a, v in kept:
                setattr(m, a, v)

    def set_impls(self, loss: str | None = None, residual: str | None = None, indexer_kernel: str | None = None,
                  kda_conv: str | None = None, kda_norm: str | None = None, norm: str | None = None,
                  swiglu: str | None = None):
        """auto | torch | liger for the LM head + loss (`loss_impl`, longctx.ops.loss.liger) and for every
        mHC residual (`MHC.impl`, longctx.ops.mhc.liger); INDEXER_KERNELS for the indexers' Triton path
        (`KPoolIndexer.kernel`, two_phase by default); auto | torch | fla for the KDA short conv
        (`KimiDeltaAttention.conv_impl`, auto by default) and its gated output norm (`norm_impl`); auto | torch
        | triton for every RMSNorm (`RMSNorm.impl`, the setting norm_impl, auto by default) and every clamped
        SwiGLU (`DenseMLP.impl`, `Experts.impl`, the setting swiglu_impl, auto by default). None leaves a
        switch as it is.
        Whether liger or fla can run is checked at the first forward (a ConfigError there)."""
        from .errors import ConfigError
        from .layers.kda import CONV_IMPLS, NORM_IMPLS
        from .layers.kpool_indexer import INDEXER_KERNELS, KPoolIndexer
        from .layers.mlp import SWIGLU_IMPLS, DenseMLP
        from .layers.moe import Experts
        from .layers.norms import RMS_NORM_IMPLS, RMSNorm
        from .layers.residual import MHC, RESIDUAL_IMPLS
        from .ops.loss.liger import LOSS_IMPLS

        for name, v, allowed in (("loss_impl", loss, LOSS_IMPLS), ("residual_impl", residual, RESIDUAL_IMPLS),
                                 ("indexer_kernel", indexer_kernel, INDEXER_KERNELS), ("kda_conv", kda_conv, CONV_IMPLS),
                                 ("kda_norm", kda_norm, NORM_IMPLS), ("norm_impl", norm, RMS_NORM_IMPLS),
                                 ("swiglu_impl", swiglu, SWIGLU_IMPLS)):
            if v is not None and v not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)} (got {v!r}).")
        if loss is not None:
            self.loss_impl = loss
        for m in self.modules():
            if residual is not None and isinstance(m, MHC):
                m.impl = residual
            if indexer_kernel is not None and isinstance(m, KPoolIndexer):
                m.kernel = indexer_kernel
            if kda_conv is not None and isinstance(m, KimiDeltaAttention):
                m.conv_impl = kda_conv
            if kda_norm is not None and isinstance(m, KimiDeltaAttention):
                m.norm_impl = kda_norm
            if norm is not None and isinstance(m, RMSNorm):
                m.impl = norm
            if swiglu is not None and isinstance(m, (DenseMLP, Experts)):
                m.impl = swiglu

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
