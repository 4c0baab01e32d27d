"""The router's fp32 logits from bf16 tokens without an fp32 copy of them (`kernels.router = "bf16x3"`).

The router computes x W^T in fp32, as GLM-5.3-Flash and transformers do: the scores choose the experts,
and bf16 logits would tie and flip choices. With bf16 tokens the plain form (`naive.py`) casts x to fp32
first. At h200-ref's width that is a [t, 1536] fp32 copy written and read in the forward, again in the
backward for W's gradient, and dx comes out of an fp32 matmul to be cast down: ~5 GB of traffic a layer
at 128k tokens (counted) around a matmul of 32 columns that needs a tenth of it.

Here the fp32 weight is split into three bf16 pieces, W = W1 + W2 + W3 exactly (each piece holds the
next 8 bits of fp32's 24-bit significand; `split3`), and the product runs on the tensor cores as one bf16
matmul with fp32 output (`torch.mm(..., out_dtype=torch.float32)`: cuBLAS, fp32 accumulation) against
the stacked [3E, hidden] pieces, the three column blocks summed smallest first. A product of two bf16
values is exact in fp32, so the pieces lose nothing; what differs from an fp32 matmul is the accumulation.
cuBLAS's bf16 matmuls accumulate less exactly than its fp32 ones, the error growing with the sum's length
(docs/design/moe.md gives the figures), so sums over many tokens run in pieces of `TOKEN_CHUNK` with fp32
adds between them. Against bf16 logits' ~4e-3 this is still fp32-class: the experts chosen are the twin's
but for near ties.

Backward: dW = g^T x with g split the same way (three bf16 pieces of [t, E]; one batched matmul over
pieces of `TOKEN_CHUNK` tokens, fp32 output, the pieces summed in fp32); dx = g W straight into bf16 as
g1 W1 + g1 W2 + g2 W1, one matmul over K = 3E: the terms left out are ~2^-16 of the result, under dx's own
bf16 rounding (2^-9). x is read once in each matmul, in bf16.

On the CPU (the tests) the bf16 matmuls with fp32 output run as fp32 matmuls of the same bf16 values:
the same products, exact either way, summed in fp32; `kernels.router` itself takes this path on CUDA only.
"""

from __future__ import annotations

import torch

# tokens summed inside one bf16 matmul for the weight's gradient; the pieces' [3E, hidden] fp32 sums
# (18 MB at 128k tokens for h200-ref) are added in fp32
TOKEN_CHUNK = 4096


def split3(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three bf16 tensors whose fp32 sum is the fp32 `t`, largest first (exact but for values below
    bf16's normal range, ~1e-38, whose low pieces round away)."""
    hi = t.to(torch.bfloat16)
    r = t - hi.float()
    mid = r.to(torch.bfloat16)
    return hi, mid, (r - mid.float()).to(torch.bfloat16)


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b of bf16 matrices (or batches of them) with fp32 accumulation, returned in `out_dtype`."""
    if a.is_cuda:
        mm = torch.bmm if a.dim() == 3 else torch.mm
        return mm(a, b, out_dtype=out_dtype) if out_dtype != a.dtype else mm(a, b)
    return (a.float() @ b.float()).to(out_dtype)


def _weight_grad(gs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """gs^T x in fp32 for bf16 gs [t, n] and x [t, H]: the whole pieces of TOKEN_CHUNK tokens as one batched
    matmul (the strided views passed as they are), their sums and the ragged tail's added in fp32."""
    t = x.shape[0]
    full = t - t % TOKEN_CHUNK
    out = _mm(gs[full:].t(), x[full:], torch.float32)
    if full:
        n = full // TOKEN_CHUNK
        a, b = gs[:full].view(n, TOKEN_CHUNK, -1).transpose(1, 2), x[:full].reshape(n, TOKEN_CHUNK, -1)
        out += _mm(a, b, torch.float32).sum(0)
    return out


def _sum3(y: torch.Tensor) -> torch.Tensor:
    """y[0] + y[1] + y[2] of the pieces' products, smallest first."""
    return (y[2] + y[1]) + y[0]


class Bf16x3Logits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        E, H = weight.shape
        ctx.save_for_backward(x, weight)
        with torch.autocast(x.device.type, enabled=False):
            w3 = torch.cat(split3(weight))  # [3E, H]
            y = _mm(x.reshape(-1, H), w3.t(), torch.float32).view(-1, 3, E)
            return _sum3(y.unbind(1)).view(*x.shape[:-1], E)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        E, H = weight.shape
        with torch.autocast(x.device.type, enabled=False):
            g1, g2, g3 = split3(g.reshape(-1, E).float())
            gx = gw = None
            if ctx.needs_input_grad[0]:
                w1, w2, _ = split3(weight)
                gx = _mm(torch.cat([g1, g1, g2], 1), torch.cat([w1, w2, w1]), x.dtype).view(x.shape)
            if ctx.needs_input_grad[1]:
                gw3 = _weight_grad(torch.cat([g1, g2, g3], 1), x.reshape(-1, H)).view(3, E, H)
                gw = _sum3(gw3.unbind(0))
        return gx, gw


def router_logits_bf16x3(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.bfloat16 or weight.dtype != torch.float32:
        raise ValueError(f"router_logits_bf16x3 takes bf16 tokens and an fp32 weight, not {x.dtype} and {weight.dtype}")
    return Bf16x3Logits.apply(x, weight)
