"""Residual connections between sub-layers: mHC, Block Attention Residuals, or plain.

Every sub-layer (the token mixer and the MLP of each block) reads its input from the residual
*state* and writes its output back through one of these modules:

    x, ctx = res.enter(state)       # the sub-layer's input [B, S, D]
    state  = res.exit(state, ctx, y)  # y = sub-layer(norm(x))

and a model-level `*Stream` turns embeddings into the initial state and the final state into the
hidden [B, S, D] that goes to the head. The state is what full recompute keeps (and offload moves)
per layer, so its size is the memory story: mHC's state is 4 streams wide, plain's is one.

- mHC (manifold-constrained hyper-connections; GLM-5.3-Flash): state [B, S, n, D]. The maths are
  the mhc op (`longctx.ops.mhc`, the setting kernels.mhc): the coefficients come from an fp32
  projection of the RMS-normalised flattened streams. That fp32 copy of the input is what autograd
  would save; `recompute_cast=True` (default) checkpoints the small projection so backward recasts it
  from the bf16 streams instead (8 GiB at 512k for h200-ref). liger-kernel's Triton mHC ops compute the
  same thing (longctx.ops.mhc.liger says how the two map, and where the precision differs); auto takes
  them on CUDA where liger imports, the streams suit its kernels and `recompute_cast` is on (the
  baseline plan stays plain torch). On the H200 they match ours (out 3.3e-3, d_streams 3.9e-3 rel-RMS,
  bench/mhc.py), the whole model's gradients are as close to fp32 as the torch path's (6.9% vs 5.9%,
  tests/ops/test_mhc_gpu.py), and a 128k h200-ref step takes 5.87 s against 7.93 s, +1.1 GiB peak
  (`bench/memory.py --parts runs --configs all_on --seqlens 131072`, then with `--kernel mhc=torch`).
  `liger_chunk` (memory.mhc_chunk) runs liger's stream kernels over that many tokens at a time, so no
  whole-sequence fp32 copy of the streams exists (longctx.ops.mhc.liger, `_ChunkedPostRes`).
- Block Attention Residuals (Kimi, arXiv 2603.15031): state = (completed block sums, partial sum
  of the current block). Each sub-layer's input is a softmax-weighted sum of the sources, weighted
  by a zero-initialised pseudo-query against RMS-normalised sources.
- plain: state [B, S, D], x + y.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..ops import mhc as mhc_ops
from ..ops import pick as _pick
from ..ops.mhc import liger as mhc_liger


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------------------- mHC
class MHC(nn.Module):
    """One mHC connection: collapse n streams into the sub-layer input, expand its output back."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = self.n = cfg.hc_streams
        self.cfg = cfg  # what liger's kernels are checked against (`ops.mhc.unavailable`)
        self.iters, self.hc_eps, self.norm_eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.randn((2 + n) * n, n * cfg.hidden_size) * cfg.init_std)
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        self.recompute_cast = True
        self.liger_chunk = mhc_liger.DEFAULT_CHUNK  # memory.mhc_chunk: tokens per call of liger's stream ops (0: liger's Functions)
        self.kernels = {"mhc": "auto"}  # set by longctx.kernels.apply_kernels
        self.last_impl: str | None = None  # what ran (the step log's implementation report)

    def pick(self, streams: torch.Tensor) -> str:
        """"torch" or "liger" for kernels.mhc on these streams (the rule of `longctx.ops.pick`); the plan's
        baseline (`recompute_cast` off) makes auto the torch twin."""
        return _pick("mhc", self.kernels["mhc"], mhc_ops.IMPLS, streams.is_cuda,
                     lambda: mhc_ops.unavailable(streams.device, self.cfg), plain=not self.recompute_cast)

    def coefficients(self, streams: torch.Tensor):
        """(pre, post, comb) fp32 through the torch twin (`ops.mhc.mhc_coefficients`)."""
        return mhc_ops.mhc_coefficients(streams, self.fn, self.base, self.scale, iters=self.iters, hc_eps=self.hc_eps,
                                        norm_eps=self.norm_eps, recompute_cast=self.recompute_cast)

    def enter(self, streams: torch.Tensor):
        if self.pick(streams) == "liger":
            self.last_impl = "mhc:liger+triton-proj" if mhc_liger.projection(self.n) == "triton" else "mhc:liger"
            x, (post, comb, link) = mhc_liger.liger_mhc_enter(streams, self.fn, self.base, self.scale, iters=self.iters,
                                                              hc_eps=self.hc_eps, norm_eps=self.norm_eps,
                                                              chunk=self.liger_chunk)
            return x, (post, comb, "liger", link, streams)
        self.last_impl = "mhc:torch"
        pre, post, comb = self.coefficients(streams)
        return mhc_ops.mhc_pre(streams, pre), (post, comb, "torch", None, streams)

    def exit(self, streams: torch.Tensor, ctx, y: torch.Tensor) -> torch.Tensor:
        post, comb, impl, link, entered = ctx
        if impl == "liger":  # the link only joins the gradients of the streams the enter read
            return mhc_liger.liger_mhc_post_res(streams, y, post, comb, chunk=self.liger_chunk,
                                                link=link if streams is entered else None)
        return mhc_ops.mhc_post_res(streams, y, post, comb)


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
