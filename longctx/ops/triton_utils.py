"""fp32 -> bf16/fp16 rounding inside Triton kernels that the CPU tests can check bit for bit."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_rne(v, dtype: tl.constexpr):
    """fp32 -> `dtype` rounding to nearest even, as torch's casts. For bf16 the rounding is done on the
    bits (add 0x7fff plus the lowest kept bit, drop the low half) and the cast is then exact: the GPU
    rounds to nearest even by itself, but the Triton interpreter truncates (with or without
    fp_downcast_rounding="rtne"), and the CPU test should check the arithmetic the GPU runs."""
    if dtype == tl.float32:
        return v
    if dtype == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        return b.to(tl.float32, bitcast=True).to(dtype)
    return v.to(dtype)
