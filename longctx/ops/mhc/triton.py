"""mHC's coefficient projection, mix = RMSNorm(x) @ fn^T, forward and backward in Triton: the costly part of
liger's coefficient Function (x the flattened streams [N, nD], fn [M, nD] with M = (2+n)n; the plain-torch
twin is `naive.mhc_project`). The liger path runs it for up to 8 streams (`liger.projection`): on the H200
2.2x liger's kernels at 128k tokens (`python bench/mhc.py --project`, bench/results/mhc.json).

Why. In a 128k step with liger's projection, liger's `_mhc_mm_norm_fwd_kernel` takes 2.9 ms a call (48 a
step) and its backward 5.9 ms (24 a step):
0.28 s of a 3.8 s profiled step. Reading liger's sm_90 build (`python dev/compile_sm90.py`):
the forward unrolls its whole K loop (`tl.static_range` over nD = 6,144), 255 registers with 592 bytes
spilled, mma.sync rather than wgmma, and reloads fn's 786 KB for every 32 rows; the backward adds every
program's [256, 24] slice of grad fn with acq_rel atomics, 4,096 programs onto the same 147 K addresses
at 128k tokens. Count: the forward must read x once (1.6 GB at 128k, ~0.5 ms at 3.3 TB/s), the backward
read x and write grad x (3.2 GB, ~1 ms), so ~0.2 s of the step is above the floor.

Here. Forward: a program per BLOCK_N rows, a runtime loop over K (pipelined loads), all M columns in one
[BLOCK_N, BLOCK_M] fp32 accumulator and the rows' sums of squares beside it: mix = (x @ fn^T) * invr,
invr = rsqrt(mean(x^2) + eps). Backward, with g = grad mix: grad x = (g * invr) @ fn + f x, where
f = -(g . mix) invr^2 / K per row (torch forms g * invr and f: [N, M] and [N], small); grad fn =
(g * invr)^T @ x. A program per (K block, ROW_BLOCKS x BLOCK_N rows) writes its rows' grad x and sums
their grad fn slice in registers, then adds it once with a relaxed atomic (N / 512 adds an address).
Counted: forward ~0.6-0.8 ms, backward ~1.2-1.5 ms a call at 128k tokens; measured on the H200: 1.35 and
2.68 ms against liger's 2.99 and 5.84 (bench/results/mhc.json).
Products as liger's: x in fp32, tf32 tensor-core dots with fp32 accumulation ("ieee" for fp32 checks).

The entering connection's backward (`liger._Enter`) also runs here: `pre_grad`, the collapse's coefficient
gradient (x and the collapse's output gradient read once), and `project_bwd` with the collapse's and the
expand's gradients of x added in its registers, so x's gradient is written once (docs/design/mhc.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import triton_interpreting as interpreting
from ..triton_utils import round_rne

# Launch configs, chosen from their sm_90 builds (dev/compile_sm90.py: no spills, wgmma products; the
# forward 100 registers at these blocks, the backward 141), not from a timing sweep on the GPU.
FWD = {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
BWD = {"BLOCK_N": 128, "BLOCK_K": 64, "ROW_BLOCKS": 4, "num_warps": 8, "num_stages": 2}


@triton.jit
def _project_fwd(X, PHI, MIX, INVR, N, M, eps, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, PREC: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < N
    cm = tl.arange(0, BLOCK_M)
    m_ok = cm < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    ss = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(X + rows[:, None] * K + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        ss += tl.sum(x * x, 1)
        phi = tl.load(PHI + ks[:, None] * M + cm[None, :], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        acc = tl.dot(x, phi, acc, input_precision=PREC)
    invr = 1.0 / tl.sqrt(ss / K + eps)
    tl.store(MIX + rows[:, None] * M + cm[None, :], acc * invr[:, None], mask=r_ok[:, None] & m_ok[None, :])
    tl.store(INVR + rows, invr, mask=r_ok)


@triton.jit
def _project_bwd(X, PHI, GZ, FAC, GX, GPHI, HPRE, GO, GIN, N, M, K: tl.constexpr, D: tl.constexpr,
                 NS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                 ROW_BLOCKS: tl.constexpr, PREC: tl.constexpr, HAS_PRE: tl.constexpr, HAS_IN: tl.constexpr):
    ks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    cm = tl.arange(0, BLOCK_M)
    m_ok = cm < M
    phi = tl.load(PHI + ks[:, None] * M + cm[None, :], mask=k_ok[:, None] & m_ok[None, :], other=0.0)  # [BK, BM]
    dphi = tl.zeros([BLOCK_K, BLOCK_M], tl.float32)
    first = tl.program_id(1).to(tl.int64) * (ROW_BLOCKS * BLOCK_N)
    for i in range(ROW_BLOCKS):
        rows = first + i * BLOCK_N + tl.arange(0, BLOCK_N)
        r_ok = rows < N
        xk = r_ok[:, None] & k_ok[None, :]
        x = tl.load(X + rows[:, None] * K + ks[None, :], mask=xk, other=0.0).to(tl.float32)
        gz = tl.load(GZ + rows[:, None] * M + cm[None, :], mask=r_ok[:, None] & m_ok[None, :], other=0.0)
        f = tl.load(FAC + rows, mask=r_ok, other=0.0)
        gx = tl.dot(gz, tl.trans(phi), input_precision=PREC) + f[:, None] * x
        if HAS_PRE:  # the collapse's: column k = i D + d of row t gets pre[t, i] * grad_x_in[t, d]
            if D % BLOCK_K == 0:  # the block's columns lie in one stream: one coefficient a row
                s0 = (tl.program_id(0) * BLOCK_K) // D
                h = tl.load(HPRE + rows * NS + s0, mask=r_ok, other=0.0)[:, None]
                go = tl.load(GO + rows[:, None] * D + (ks - s0 * D)[None, :], mask=xk, other=0.0)
            else:
                si = ks // D
                h = tl.load(HPRE + rows[:, None] * NS + si[None, :], mask=xk, other=0.0)
                go = tl.load(GO + rows[:, None] * D + (ks - si * D)[None, :], mask=xk, other=0.0)
            gx += h * go.to(tl.float32)
        if HAS_IN:  # a gradient of x computed elsewhere (the expand's), summed here rather than by autograd
            gx += tl.load(GIN + rows[:, None] * K + ks[None, :], mask=xk, other=0.0).to(tl.float32)
        tl.store(GX + rows[:, None] * K + ks[None, :], round_rne(gx, GX.dtype.element_ty), mask=xk)
        dphi = tl.dot(tl.trans(x), gz, dphi, input_precision=PREC)
    tl.atomic_add(GPHI + ks[:, None] * M + cm[None, :], dphi, mask=k_ok[:, None] & m_ok[None, :], sem="relaxed")


@triton.jit
def _pre_grad(X, GO, GH, N, D: tl.constexpr, NS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_S: tl.constexpr):
    """GH[t, i] = sum_d GO[t, d] X[t, i D + d] in fp32: the collapse's coefficient gradient (x and GO read once)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < N
    cs = tl.arange(0, BLOCK_S)
    acc = tl.zeros([BLOCK_N, BLOCK_S], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        m = r_ok[:, None] & (ds < D)[None, :]
        go = tl.load(GO + rows[:, None] * D + ds[None, :], mask=m, other=0.0).to(tl.float32)
        for i in tl.static_range(NS):
            x = tl.load(X + rows[:, None] * (NS * D) + i * D + ds[None, :], mask=m, other=0.0).to(tl.float32)
            acc += tl.where(cs[None, :] == i, tl.sum(x * go, 1)[:, None], 0.0)
    tl.store(GH + rows[:, None] * NS + cs[None, :], acc, mask=r_ok[:, None] & (cs < NS)[None, :])


def _prec(x: torch.Tensor) -> str:
    """tf32 products for 16-bit streams, as liger's; exact fp32 products for fp32 streams (the checks)."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _block_m(M: int) -> int:
    return max(16, triton.next_power_of_2(M))


def project_fwd(x: torch.Tensor, phi: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, K] (bf16/fp16/fp32, contiguous), phi = fn^T [K, M] fp32 contiguous -> (mix [N, M] fp32, invr [N] fp32)."""
    N, K = x.shape
    M = phi.shape[1]
    mix = torch.empty((N, M), dtype=torch.float32, device=x.device)
    invr = torch.empty((N,), dtype=torch.float32, device=x.device)
    if N:
        c = FWD
        _project_fwd[(triton.cdiv(N, c["BLOCK_N"]),)](
            x, phi, mix, invr, N, M, float(eps), K=K, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
            BLOCK_M=_block_m(M), PREC=_prec(x), num_warps=c["num_warps"], num_stages=c["num_stages"])
    return mix, invr


def project_bwd(x, phi, mix, invr, grad_mix, pre=None, grad_in=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad x like x, grad phi [K, M] fp32) of mix = project_fwd(x, phi)[0] for grad_mix [N, M].

    pre = (h [N, n] fp32, grad_x_in [N, D]): x [N, n D] also fed the collapse x_in = sum_i h_i x_i, and its
    gradient h_i grad_x_in is added; grad_in [N, n D]: another gradient of x, added too. Either way x's
    gradient is summed in the kernel's fp32 registers and written once, where autograd would add whole
    [N, n D] tensors (`liger._Enter`)."""
    N, K = x.shape
    M = phi.shape[1]
    g = grad_mix.float()
    gz = (g * invr[:, None]).contiguous()
    fac = (-(g * mix).sum(1) * invr * invr / K).contiguous()
    gx = torch.empty_like(x)
    gphi = torch.zeros((K, M), dtype=torch.float32, device=x.device)
    n, h, go = 1, gz, gz  # unread placeholders without `pre`
    if pre is not None:
        h, go = pre[0].float().contiguous(), pre[1].contiguous()
        n = h.shape[1]
        if h.shape != (N, n) or K % n or go.shape != (N, K // n):
            raise ValueError(f"project_bwd: pre = (h {tuple(h.shape)}, grad_x_in {tuple(go.shape)}) must be "
                             f"[N, n] and [N, K / n] for x {tuple(x.shape)}.")
    if grad_in is not None:
        grad_in = grad_in.contiguous()
        if grad_in.shape != x.shape:
            raise ValueError(f"project_bwd: grad_in {tuple(grad_in.shape)} must be x's shape {tuple(x.shape)}.")
    if N:
        c = BWD
        grid = (triton.cdiv(K, c["BLOCK_K"]), triton.cdiv(N, c["BLOCK_N"] * c["ROW_BLOCKS"]))
        _project_bwd[grid](x, phi, gz, fac, gx, gphi, h, go, grad_in if grad_in is not None else x, N, M, K=K,
                           D=K // n, NS=n, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], BLOCK_M=_block_m(M),
                           ROW_BLOCKS=c["ROW_BLOCKS"], PREC=_prec(x), HAS_PRE=pre is not None,
                           HAS_IN=grad_in is not None, num_warps=c["num_warps"], num_stages=c["num_stages"])
    return gx, gphi


PRE_GRAD = {"BLOCK_N": 32, "BLOCK_D": 128, "num_warps": 4}


def pre_grad(x: torch.Tensor, grad_x_in: torch.Tensor, n: int) -> torch.Tensor:
    """[N, n] fp32: sum_d grad_x_in[t, d] x[t, i D + d], the gradient of the collapse's coefficients h in
    x_in = sum_i h_i x_i (x [N, n D] and grad_x_in [N, D], read once each)."""
    N, K = x.shape
    if K % n or grad_x_in.shape != (N, K // n):
        raise ValueError(f"pre_grad: grad_x_in {tuple(grad_x_in.shape)} must be [N, K / n] for x {tuple(x.shape)}, n = {n}.")
    gh = torch.empty((N, n), dtype=torch.float32, device=x.device)
    if N:
        c = PRE_GRAD
        _pre_grad[(triton.cdiv(N, c["BLOCK_N"]),)](x.contiguous(), grad_x_in.contiguous(), gh, N, D=K // n, NS=n,
                                                   BLOCK_N=c["BLOCK_N"], BLOCK_D=c["BLOCK_D"],
                                                   BLOCK_S=triton.next_power_of_2(n), num_warps=c["num_warps"])
    return gh


class MHCProjectFn(torch.autograd.Function):
    """x [N, nD], fn [M, nD] fp32 -> mix [N, M] fp32 = RMSNorm(x) @ fn^T; keeps x, fn^T, mix and invr
    (the rows' [M] and one float: no fp32 copy of x)."""

    @staticmethod
    def forward(ctx, x, fn, eps):
        if x.device.type != "cuda" and not interpreting():
            raise RuntimeError(f"mhc_project_triton runs on CUDA tensors (or under TRITON_INTERPRET=1); got {x.device}.")
        x = x.contiguous()
        phi = fn.detach().float().t().contiguous()
        mix, invr = project_fwd(x, phi, eps)
        ctx.save_for_backward(x, phi, mix, invr)
        return mix

    @staticmethod
    def backward(ctx, grad_mix):
        x, phi, mix, invr = ctx.saved_tensors
        gx, gphi = project_bwd(x, phi, mix, invr, grad_mix.contiguous())
        return gx, gphi.t(), None


def mhc_project_triton(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    return MHCProjectFn.apply(x, fn, eps)
