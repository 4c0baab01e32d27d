"""Residual connections between sub-layers: mHC, Block Attention Residuals, or plain.

Every sub-layer (the token mixer and the MLP of each block) reads its input from the residual
*state* and writes its output back through one of these modules:

    x, ctx = res.enter(state)       # the sub-layer's input [B, S, D]
    state  = res.exit(state, ctx, y)  # y = sub-layer(norm(x))

and a model-level `*Stream` turns embeddings into the initial state and the final state into the
hidden [B, S, D] that goes to the head. The state is what full recompute keeps (and offload moves)
per layer, so its size is the memory story: mHC's state is 4 streams wide, plain's is one.

- mHC (manifold-constrained hyper-connections; GLM-5.3-Flash): state [B, S, n, D]. The
  coefficients come from an fp32 projection of the RMS-normalised flattened streams. That fp32
  copy of the input is what autograd would save; `recompute_cast=True` (default) checkpoints the
  small projection so backward recasts it from the bf16 streams instead (seed 000: 8 GiB at 512k).
  `impl` (residual_impl) "auto" | "torch" | "liger": liger-kernel's Triton mHC ops compute the same
  thing (longctx.ops.mhc.liger says how the two map, and where the precision differs); auto takes
  them on CUDA when liger imports and `recompute_cast` is on (the baseline plan stays plain torch).
  `liger_chunk` (memory.mhc_chunk) runs liger's stream kernels over that many tokens at a time, so no
  whole-sequence fp32 copy of the streams exists (longctx.ops.mhc.liger, `_ChunkedPostRes`).
- Block Attention Residuals (Kimi, arXiv 2603.15031): state = (completed block sums, partial sum
  of the current block). Each sub-layer's input is a softmax-weighted sum of the sources, weighted
  by a zero-initialised pseudo-query against RMS-normalised sources.
- plain: state [B, S, D], x + y.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig
from ..errors import ConfigError, warn_fallback
from ..ops.mhc import liger as mhc_liger

RESIDUAL_IMPLS = ("auto", "torch", "liger")
AUTO_USES_LIGER = True


def auto_takes_liger(n_streams: int, recompute_cast: bool) -> bool:
    """residual_impl "auto" on CUDA with liger importable: liger's mHC or not (`MHC.pick_impl`, which
    also warns where liger is missing or the stream count unsupported; the estimator asks this)."""
    return AUTO_USES_LIGER and recompute_cast and mhc_liger.streams_supported(n_streams)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------------------- mHC
def _mhc_project(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    flat = streams.flatten(-2).float()
    return F.linear(_rms(flat, eps), fn.float())


class MHC(nn.Module):
    """One mHC connection: collapse n streams into the sub-layer input, expand its output back."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = self.n = cfg.hc_streams
        self.iters, self.hc_eps, self.norm_eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.randn((2 + n) * n, n * cfg.hidden_size) * cfg.init_std)
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        self.recompute_cast = True
        self.liger_chunk = mhc_liger.DEFAULT_CHUNK  # memory.mhc_chunk: tokens per call of liger's stream ops (0: liger's Functions)
        self.impl = "auto"  # residual_impl: "auto" | "torch" | "liger" (longctx.ops.mhc.liger)
        self.last_impl: str | None = None

    def pick_impl(self, streams: torch.Tensor) -> str:
        """"torch" or "liger" for `self.impl` on these streams; ConfigError when liger is asked for and cannot run."""
        if self.impl not in RESIDUAL_IMPLS:
            raise ConfigError(f"residual_impl must be one of {', '.join(RESIDUAL_IMPLS)} (got {self.impl!r}).")
        if self.impl == "torch":
            return "torch"
        if self.impl == "liger":
            if not streams.is_cuda or not mhc_liger.liger_mhc_available():
                err = mhc_liger.import_error()
                raise ConfigError(
                    f"residual_impl 'liger' needs CUDA tensors and liger-kernel >= {mhc_liger.LIGER_MIN_VERSION} "
                    f"(streams on {streams.device}, liger {'importable' if err is None else 'not importable: ' + err}); "
                    "install liger-kernel==0.8.5 (`pip install -e .[gpu]`) or set residual_impl to 'auto' or 'torch'.")
            if not mhc_liger.streams_supported(self.n):
                raise ConfigError(f"residual_impl 'liger' takes model.hc_streams a power of two <= "
                                  f"{mhc_liger.MAX_STREAMS} (got {self.n}); set residual_impl to 'torch' or 'auto'.")
            return "liger"
        # auto takes liger on CUDA: its ops match ours (out 3.3e-3, d_streams 3.9e-3 rel-RMS, bench/mhc.py), the
        # whole model's gradients are as close to fp32 as the torch path's (6.9% vs 5.9%, tests/ops/test_mhc_gpu.py on
        # the H200), and a 128k h200-ref step takes 5.87 s (bench/run_h200.sh liger) against 7.93 s with the torch path
        # (an earlier session's run, bench/results/memory_runs/1_*), +1.1 GiB peak.
        if not streams.is_cuda or not self.recompute_cast or not AUTO_USES_LIGER:
            return "torch"
        if not mhc_liger.liger_mhc_available():
            warn_fallback(f"mHC runs the plain-torch path on CUDA because liger-kernel is not importable "
                       f"({mhc_liger.import_error()}); install liger-kernel==0.8.5 (`pip install -e .[gpu]`) or set "
                       "residual_impl = 'torch' to accept it.")
            return "torch"
        if not mhc_liger.streams_supported(self.n):
            warn_fallback(f"mHC runs the plain-torch path on CUDA: liger's kernels take a power-of-two hc_streams <= "
                       f"{mhc_liger.MAX_STREAMS}, not {self.n}; set residual_impl = 'torch' to accept it.")
            return "torch"
        return "liger"

    def coefficients(self, streams: torch.Tensor):
        n = self.n
        if self.recompute_cast and torch.is_grad_enabled() and streams.requires_grad:
            mixed = checkpoint(_mhc_project, streams, self.fn, self.norm_eps, use_reentrant=False)
        else:
            mixed = _mhc_project(streams, self.fn, self.norm_eps)
        pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * s_comb + comb_b.view(n, n), dim=-1) + self.hc_eps
        # Sinkhorn: columns first, then (iters - 1) rounds of rows and columns -> doubly stochastic.
        comb = comb / (comb.sum(-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + self.hc_eps)
        return pre, post, comb

    def enter(self, streams: torch.Tensor):
        if self.pick_impl(streams) == "liger":
            self.last_impl = "mhc:liger+triton-proj" if mhc_liger.projection(self.n) == "triton" else "mhc:liger"
            pre, post, comb = mhc_liger.liger_mhc_coefficients(streams, self.fn, self.base, self.scale, iters=self.iters,
                                                               hc_eps=self.hc_eps, norm_eps=self.norm_eps)
            return mhc_liger.liger_mhc_pre(streams, pre, chunk=self.liger_chunk), (post, comb, "liger")
        self.last_impl = "mhc:torch"
        pre, post, comb = self.coefficients(streams)
        x = (pre.unsqueeze(-1) * streams).sum(-2).to(streams.dtype)
        return x, (post, comb, "torch")

    def exit(self, streams: torch.Tensor, ctx, y: torch.Tensor) -> torch.Tensor:
        post, comb, impl = ctx
        if impl == "liger":
            return mhc_liger.liger_mhc_post_res(streams, y, post, comb, chunk=self.liger_chunk)
        dt = streams.dtype
        # out[i] = post[i] * y + sum_j comb[j, i] * streams[j]
        return post.to(dt).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), streams)


class MHCStream(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n = cfg.hc_streams

    def init(self, h: torch.Tensor) -> torch.Tensor:
        return h.unsqueeze(-2).expand(*h.shape[:-1], self.n, h.shape[-1]).contiguous()

    def final(self, streams: torch.Tensor) -> torch.Tensor:
        return streams.mean(-2)


# --------------------------------------------------------------------------------------- plain
class Plain(nn.Module):
    def enter(self, h):
        return h, None

    def exit(self, h, ctx, y):
        return h + y


class PlainStream(nn.Module):
    def init(self, h):
        return h

    def final(self, h):
        return h


# ------------------------------------------------------------------- block attention residuals
class AttnResQuery(nn.Module):
    """A zero-initialised pseudo-query attending over the block sources (softmax over sources)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.key_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.eps = cfg.rms_norm_eps

    def aggregate(self, sources: list[torch.Tensor]) -> torch.Tensor:
        v = torch.stack(sources, dim=-2)  # [B, S, n_src, D]
        k = _rms(v.float(), self.eps) * self.key_norm.float()
        w = torch.softmax(k @ self.query.float(), dim=-1)  # [B, S, n_src]
        return (w.unsqueeze(-1) * v.float()).sum(-2).to(v.dtype)


class AttnRes(AttnResQuery):
    """A sub-layer's connection; `closes_block` pushes the partial sum as a new block source."""

    def __init__(self, cfg: ModelConfig, closes_block: bool):
        super().__init__(cfg)
        self.closes_block = closes_block

    def enter(self, state):
        blocks, partial = state
        return self.aggregate(list(blocks) + ([partial] if partial is not None else [])), None

    def exit(self, state, ctx, y):
        blocks, partial = state
        partial = y if partial is None else partial + y
        if self.closes_block:
            return (tuple(blocks) + (partial,), None)
        return (tuple(blocks), partial)


class AttnResStream(AttnResQuery):
    def init(self, h):
        return ((h,), None)

    def final(self, state):
        blocks, partial = state
        return self.aggregate(list(blocks) + ([partial] if partial is not None else []))


def build_residuals(cfg: ModelConfig):
    """(stream, [(mixer_res, mlp_res) per layer]) for cfg.residual."""
    L = cfg.num_layers
    if cfg.residual == "mhc":
        return MHCStream(cfg), [(MHC(cfg), MHC(cfg)) for _ in range(L)]
    if cfg.residual == "plain":
        return PlainStream(), [(Plain(), Plain()) for _ in range(L)]
    n_sub = 2 * L
    per_block = max(1, -(-n_sub // cfg.attnres_blocks))
    closes = [(j + 1) % per_block == 0 for j in range(n_sub)]
    return AttnResStream(cfg), [(AttnRes(cfg, closes[2 * i]), AttnRes(cfg, closes[2 * i + 1])) for i in range(L)]
