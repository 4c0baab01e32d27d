"""Fused clamped SwiGLU, silu(min(gate, limit)) * clamp(up, -limit, limit), forward and backward in Triton,
with `naive.py`'s arithmetic and saved tensors.

Why. The torch form (`naive.ClampedSwiGLU[Packed]`) runs 4 kernels a forward (two clamps, the SiLU, the
product: ~9 passes over a [rows, I] tensor) and ~10 a backward (~25 passes, the masks included); at
h200-ref's widths that is every MoE layer's 4 x S routed rows plus the shared expert and the dense MLP,
in the forward, the block recompute and the backward (a 128k step's profile: clamps 83 ms, the SiLU
products and masks among the multiplies and wheres). Here the forward reads gate and up once and writes
the product; the backward reads gate, up and dy once and writes both gradients. The count:
~6.1 G elements of [rows, I] per 128k step; fwd 18 -> 6 bytes an element (twice: forward, recompute),
bwd ~50 -> 10: ~0.39 TB less traffic, ~0.12 s at 3.3 TB/s (of a 3.9 s step).

Arithmetic (as torch's ops in the input's dtype, each op rounding once): gc = min(gate, limit),
uc = clamp(up, -limit, limit) (exact); s = round(silu(gc)); y = round(s * uc). Backward:
a = round(dy * uc); d_gc = round(silu'(gc) * a); d_gate = d_gc where gate <= limit, else 0;
d_up = round(dy * s) where -limit <= up <= limit, else 0 (a clamp passes the gradient on its closed
interval, as torch's). Intermediates are rounded to the input's dtype where torch rounds them, so bf16
results differ from torch's only where the fp32 SiLU differs in its last bit (exp's implementation).

Runs on CUDA tensors, and on CPU tensors under `TRITON_INTERPRET=1` (the CPU tests)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import triton_interpreting as interpreting
from ..triton_utils import round_rne

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK = 1024  # columns per program (rows of the widths here: 768, 1536, 4096)


def rejects(*ts: torch.Tensor) -> str | None:
    """Why the kernels cannot take these inputs (the rule in `ops.pick` turns it into auto's warning or
    an explicit setting's ConfigError), or None."""
    t = ts[0]
    if t.device.type != "cuda" and not interpreting():
        return f"the Triton SwiGLU runs on CUDA tensors, and these are on {t.device}"
    if any(x.dtype != t.dtype for x in ts) or t.dtype not in DTYPES:
        return (f"the Triton SwiGLU takes bf16, fp16 or fp32 gate and up of one dtype, not "
                f"{', '.join(str(x.dtype) for x in ts)}")
    return None


def _check(*ts: torch.Tensor) -> None:
    why = rejects(*ts)
    if why is not None:
        raise ValueError(f"clamped_swiglu_triton: {why}.")


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _swiglu_fwd(G, U, Y, n, sg, su, sy, limit, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    g = tl.load(G + row * sg + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + row * su + cols, mask=m, other=0.0).to(tl.float32)
    dt = Y.dtype.element_ty
    s = round_rne(_silu(tl.minimum(g, limit)), dt).to(tl.float32)
    uc = tl.minimum(tl.maximum(u, -limit), limit)
    tl.store(Y + row * sy + cols, round_rne(s * uc, dt), mask=m)


@triton.jit
def _swiglu_bwd(G, U, DY, DG, DU, n, sg, su, sdy, sdg, sdu, limit, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    g = tl.load(G + row * sg + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + row * su + cols, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * sdy + cols, mask=m, other=0.0).to(tl.float32)
    dt = DG.dtype.element_ty
    gc = tl.minimum(g, limit)
    uc = tl.minimum(tl.maximum(u, -limit), limit)
    a = round_rne(dy * uc, dt).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gc))
    d_gc = round_rne(a * sig * (1.0 + gc * (1.0 - sig)), dt)
    s = round_rne(gc * sig, dt).to(tl.float32)
    d_u = round_rne(dy * s, dt)
    zero = tl.zeros_like(d_gc)
    tl.store(DG + row * sdg + cols, tl.where(g <= limit, d_gc, zero), mask=m)
    tl.store(DU + row * sdu + cols, tl.where((u >= -limit) & (u <= limit), d_u, zero), mask=m)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, width] with unit column stride (a view where t is one, as the packed halves are)."""
    if t.dim() == 2 and t.stride(-1) == 1:
        return t
    return t.reshape(-1, t.shape[-1]).contiguous()


def _grid(rows: int, n: int):
    return (rows, triton.cdiv(n, BLOCK))


def _fwd(g2: torch.Tensor, u2: torch.Tensor, limit: float) -> torch.Tensor:
    rows, n = g2.shape
    y = torch.empty((rows, n), dtype=g2.dtype, device=g2.device)
    if rows and n:
        _swiglu_fwd[_grid(rows, n)](g2, u2, y, n, g2.stride(0), u2.stride(0), y.stride(0), float(limit),
                                    BLOCK=BLOCK, num_warps=4)
    return y


def _bwd(g2, u2, dy2, dg2, du2, limit: float) -> None:
    rows, n = g2.shape
    if rows and n:
        _swiglu_bwd[_grid(rows, n)](g2, u2, dy2, dg2, du2, n, g2.stride(0), u2.stride(0), dy2.stride(0),
                                    dg2.stride(0), du2.stride(0), float(limit), BLOCK=BLOCK, num_warps=4)


class TritonSwiGLUFn(torch.autograd.Function):
    """gate, up [..., I] (one dtype) -> [..., I]; keeps gate and up for backward, as `naive.ClampedSwiGLU`."""

    @staticmethod
    def forward(ctx, gate, up, limit):
        _check(gate, up)
        if gate.shape != up.shape:
            raise ValueError(f"clamped SwiGLU: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ.")
        g2, u2 = _rows(gate), _rows(up)
        ctx.save_for_backward(g2, u2)
        ctx.limit, ctx.shape = limit, gate.shape
        return _fwd(g2, u2, limit).view(gate.shape)

    @staticmethod
    def backward(ctx, dy):
        g2, u2 = ctx.saved_tensors
        dy2 = _rows(dy)
        dg, du = torch.empty_like(g2), torch.empty_like(u2)
        _bwd(g2, u2, dy2, dg, du, ctx.limit)
        return dg.view(ctx.shape), du.view(ctx.shape), None


class TritonSwiGLUPackedFn(torch.autograd.Function):
    """h = [gate | up] [..., 2I] -> [..., I]; keeps h and returns its gradient as one tensor, as
    `naive.ClampedSwiGLUPacked` (the experts' layout)."""

    @staticmethod
    def forward(ctx, h, limit):
        _check(h)
        h2 = _rows(h)
        n = h2.shape[1] // 2
        ctx.save_for_backward(h2)
        ctx.limit, ctx.shape = limit, h.shape
        return _fwd(h2[:, :n], h2[:, n:], limit).view(*h.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        h2, = ctx.saved_tensors
        n = h2.shape[1] // 2
        dh = torch.empty_like(h2)
        _bwd(h2[:, :n], h2[:, n:], _rows(dy), dh[:, :n], dh[:, n:], ctx.limit)
        return dh.view(ctx.shape), None


def clamped_swiglu_triton(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return TritonSwiGLUFn.apply(gate, up, limit)


def clamped_swiglu_packed_triton(h: torch.Tensor, limit: float) -> torch.Tensor:
    return TritonSwiGLUPackedFn.apply(h, limit)
