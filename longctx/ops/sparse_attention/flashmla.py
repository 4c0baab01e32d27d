"""FlashMLA's sparse prefill forward (as SGLang packages it: `sgl-flash-mla`) with our Triton backward.

Why a second fast backend: at many heads a query's tile fills the tensor cores, and FlashMLA's SM90
forward (hand-written CUTLASS, warp-specialised) beats our Triton forward by 2.4-2.7x at 64 heads
(bench/results/installed_kernels.json: 16.0 against 43.2 ms at 32k tokens, 75.2 against 181.0 ms at
128k; D = 512, 2,051 slots, bf16, H200). At 16 heads it pads to 64 and gains nothing (1.08x at 32k,
0.92x at 128k), so `auto` takes it from 64 heads (GLM-5.3-Flash's) and leaves h200-ref's 16 heads on
ours. It has no backward: its (o, lse) feed our Triton backward, the same function of them as after
our own forward (dq and dkv about 1e-3 relative from the all-Triton pair's in the same run).

What it takes, and how our inputs are fitted to it (each difference costs a bounded copy):
- bf16 q [S, 64 or 128 heads, D], one latent kv [S_kv, 1, D] and int32 indices [S, 1, K], K a
  multiple of 128 (its main loop takes two 64-slot blocks a step; -1 is an unused slot). Our heads
  are zero-padded up to 64 or 128 and our K slots (2,051 for index_topk 2,048) padded with -1 to the
  next multiple of 128; the padded heads' outputs are dropped.
- D 512 here (the latent is key and value: d_v = D), which is GLM-5.3-Flash's and h200-ref's
  kv_lora_rank; other widths stay on Triton.
- One sequence, flat over tokens: batch rows run one at a time, and the queries in blocks whose
  output is at most `_BLOCK_BYTES` (8,192 queries at 64 heads, 4,096 at 128), so its output block
  and the padded copies cost one block (at 64 heads: 512 MiB of output, 68 MiB of indices, and 512
  MiB of q where heads are padded), not the whole sequence's. The memory estimate does not count
  this transient of the forward (under 1% of a step's peak at the lengths it is used).
- SM90 only here: its SM90 kernels are the `use_legacy` ones in 1.0.0; the SM100 kernels are not
  measured (nothing here has one).
The plain-torch twin is `naive.sparse_attention_torch`; tests/ops/test_sparse_attention_flashmla_gpu.py
compares the two (forward, lse and gradients) where flash_mla imports.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

HEADS = (64, 128)      # the head counts its SM90 sparse prefill dispatches
TOPK_MULTIPLE = 128    # slots per query must be a multiple of this
WIDTHS = (512,)        # latent widths wired here (d_v = D)
AUTO_MIN_HEADS = 64    # auto takes FlashMLA from here (measured faster at 64; padding 16 to 64 is not)
_BLOCK_BYTES = 2**29   # a call's bf16 output block at most: bounds it and the padded copies of q and the indices


@functools.lru_cache(maxsize=None)
def import_error() -> str | None:
    """Why flash_mla (sgl-flash-mla) or its SM90 kernels do not load, or None."""
    try:
        from flash_mla import _loader, flash_mla_sparse_fwd  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a torch ABI mismatch raised while loading
        return f"{type(e).__name__}: {e}"
    if not _loader.has_legacy():
        return f"its SM90 kernels did not load ({str(getattr(_loader, '_LEGACY_UNAVAILABLE', ''))[:200]})"
    return None


def shape_problem(H: int, D: int, dtype: torch.dtype | None = None) -> str | None:
    """Why FlashMLA's sparse prefill cannot take H heads of latent width D (and dtype), or None."""
    if H > HEADS[-1]:
        return f"{H} heads; it takes at most {HEADS[-1]}"
    if D not in WIDTHS:
        return f"latent width {D} (kv_lora_rank); it is wired for {', '.join(map(str, WIDTHS))}"
    if dtype is not None and dtype != torch.bfloat16:
        return f"{str(dtype).replace('torch.', '')} inputs; it takes bfloat16 (train with dtype bfloat16)"
    return None


def device_problem(device) -> str | None:
    """Why FlashMLA cannot run on the visible CUDA `device` (its compute capability), or None."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(dev)
    return None if major == 9 else f"its SM90 kernels run on sm_90 and this GPU is sm_{major}{minor}"


def sparse_attention_fwd_flashmla(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float):
    """(o [B,S,H,D] bf16, lse [B,S,H] fp32, natural log) for q [B,S,H,D], kv [B,S_kv,D], idx [B,S,K] (-1 = unused):
    the forward of `naive.sparse_attention_torch` through FlashMLA's sparse prefill. ValueError naming the
    shape on what it cannot take. A query with no selected slot gets what FlashMLA gives it (DSA never asks:
    every query selects a pool or its own tail)."""
    if q.dim() != 4 or kv.dim() != 3 or idx.dim() != 3 or kv.shape[0] != q.shape[0] or idx.shape[:2] != q.shape[:2]:
        raise ValueError(f"sparse_attention_flashmla: expected q [B,S,H,D], kv [B,S_kv,D], idx [B,S,K]; got "
                         f"q {tuple(q.shape)}, kv {tuple(kv.shape)}, idx {tuple(idx.shape)}")
    B, S, H, D = q.shape
    why = shape_problem(H, D, q.dtype) or (None if kv.dtype == q.dtype else f"kv is {kv.dtype}, q {q.dtype}")
    if why or kv.shape[2] != D:
        raise ValueError(f"sparse_attention_flashmla: cannot take q {tuple(q.shape)} {q.dtype}, kv {tuple(kv.shape)}: "
                         f"{why or 'kv width differs from q'}")
    from flash_mla import flash_mla_sparse_fwd

    Hp = next(h for h in HEADS if h >= H)
    K = idx.shape[-1]
    Kp = max(TOPK_MULTIPLE, math.ceil(K / TOPK_MULTIPLE) * TOPK_MULTIPLE)
    o = torch.empty_like(q)
    lse = torch.empty(B, S, H, device=q.device, dtype=torch.float32)
    rows = max(1, _BLOCK_BYTES // (Hp * D * 2))
    for b in range(B):
        kv3 = kv[b].contiguous()[:, None, :]
        for s0 in range(0, S, rows):
            s1 = min(S, s0 + rows)
            qb = q[b, s0:s1]
            qb = qb.contiguous() if Hp == H else F.pad(qb, (0, 0, 0, Hp - H))
            ib = F.pad(idx[b, s0:s1].to(torch.int32), (0, Kp - K), value=-1)[:, None, :]
            out, _max_logits, lse_b = flash_mla_sparse_fwd(qb, kv3, ib, float(scale), d_v=D, use_legacy=True)
            o[b, s0:s1] = out[:, :H]
            lse[b, s0:s1] = lse_b[:, :H]
    return o, lse


class _FlashMLASparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, idx, scale):
        o, lse = sparse_attention_fwd_flashmla(q, kv, idx, scale)
        ctx.save_for_backward(q, kv, idx, o, lse)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        from .triton import sparse_attention_bwd

        q, kv, idx, o, lse = ctx.saved_tensors
        dq, dkv = sparse_attention_bwd(q, kv, idx, o, lse, do.contiguous(), ctx.scale, group=1)
        return dq, dkv, None, None


def sparse_attention_flashmla(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """o [B,S,H,D], differentiable in q and kv: FlashMLA's forward, our Triton backward from its (o, lse)."""
    if not math.isfinite(scale):
        raise ValueError(f"sparse_attention_flashmla: scale={scale} must be finite")
    return _FlashMLASparseAttention.apply(q, kv, idx, float(scale))
