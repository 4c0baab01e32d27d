"""The Triton DSA kernel on CUDA in bf16 at the real width (D=512, K=2051) against the fp32 torch twin."""

from __future__ import annotations

import pytest
import torch

from longctx.ops.sparse_attention.naive import causal_pool_indices

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


@pytest.mark.parametrize(
    "B,S,H,K",
    [
        (1, 2301, 16, 2051),  # past the 2048-token prefix: full index lists, S not a tile multiple
        (2, 333, 64, 2051),  # every query has -1 padding, two sequences
        (1, 200, 128, 2051),  # two head groups
        (1, 150, 5, 2051),  # heads padded up to the MMA minimum
    ],
)
def test_bf16_matches_fp32_twin(B, S, H, K):
    from longctx.ops.sparse_attention.naive import sparse_attention_torch
    from longctx.ops.sparse_attention.triton import sparse_attention_triton

    D = 512
    g = torch.Generator(device="cuda").manual_seed(S * 131 + H)
    q = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16().requires_grad_(True)
    kv = torch.randn(B, S, D, device="cuda", generator=g).bfloat16().requires_grad_(True)
    idx = torch.stack([causal_pool_indices(S, K, generator=g) for _ in range(B)])
    scale = D**-0.5 * 2.0  # a bit peakier than uniform so the softmax matters
    do = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16()

    o = sparse_attention_triton(q, kv, idx, scale)
    dq, dkv = torch.autograd.grad(o, (q, kv), do)

    q32 = q.detach().float().requires_grad_(True)
    kv32 = kv.detach().float().requires_grad_(True)
    o_ref = sparse_attention_torch(q32, kv32, idx, scale, chunk=32)
    dq_ref, dkv_ref = torch.autograd.grad(o_ref, (q32, kv32), do.float())

    assert o.dtype == torch.bfloat16 and dq.dtype == torch.bfloat16 and dkv.dtype == torch.bfloat16
    assert _rel(o, o_ref) <= 5e-3, _rel(o, o_ref)
    assert _rel(dq, dq_ref) <= 2e-2, _rel(dq, dq_ref)
    assert _rel(dkv, dkv_ref) <= 2e-2, _rel(dkv, dkv_ref)


def test_empty_rows_and_duplicates():
    """All -1 rows give zeros; a token chosen by many queries sums all their dkv contributions."""
    from longctx.ops.sparse_attention.naive import sparse_attention_torch
    from longctx.ops.sparse_attention.triton import sparse_attention_triton

    B, S, H, D, K = 1, 97, 16, 512, 77
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16().requires_grad_(True)
    kv = torch.randn(B, S, D, device="cuda", generator=g).bfloat16().requires_grad_(True)
    idx = torch.randint(0, 8, (B, S, K), device="cuda", generator=g, dtype=torch.int32)  # heavy overlap
    idx[:, ::5] = -1
    o = sparse_attention_triton(q, kv, idx, D**-0.5)
    do = torch.randn_like(o)
    dq, dkv = torch.autograd.grad(o, (q, kv), do)
    assert o[:, ::5].abs().max().item() == 0.0 and dq[:, ::5].abs().max().item() == 0.0
    q32 = q.detach().float().requires_grad_(True)
    kv32 = kv.detach().float().requires_grad_(True)
    o_ref = sparse_attention_torch(q32, kv32, idx, D**-0.5)
    dq_ref, dkv_ref = torch.autograd.grad(o_ref, (q32, kv32), do.float())
    assert _rel(o, o_ref) <= 5e-3
    assert _rel(dq, dq_ref) <= 2e-2
    assert _rel(dkv, dkv_ref) <= 2e-2
    assert dkv[0, 8:].abs().max().item() == 0.0  # never selected


@pytest.mark.parametrize("B,S,H", [(1, 2301, 16), (2, 333, 64)])
def test_kept_attention_backward(B, S, H):
    """memory.reuse_attention's path: the kernel's backward from a kept (o, lse) equals the regular
    Function's gradients (the same kernel on the same saved tensors: dq bit for bit; dkv to within one bf16
    rounding step, since its fp32 atomics add in whatever order the CTAs run, so two runs may differ), and the backward's
    torch twin (sparse_attention_bwd_torch, fp32, from the kernel's o and lse) agrees within the
    gradient tolerance, on fresh random inputs with -1 padding and tails."""
    from longctx.ops.sparse_attention.naive import sparse_attention_bwd_torch
    from longctx.ops.sparse_attention.triton import (
        kept_sparse_attention_triton,
        sparse_attention_fwd,
        sparse_attention_triton,
    )

    D, K = 512, 2051
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16().requires_grad_(True)
    kv = torch.randn(B, S, D, device="cuda", generator=g).bfloat16().requires_grad_(True)
    idx = torch.stack([causal_pool_indices(S, K, generator=g) for _ in range(B)])
    scale = D**-0.5 * 2.0
    do = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16()

    ref = torch.autograd.grad(sparse_attention_triton(q, kv, idx, scale), (q, kv), do)
    with torch.no_grad():
        o, lse = sparse_attention_fwd(q, kv, idx, scale)
    kept = kept_sparse_attention_triton(q, kv, idx, o, lse, scale)
    assert torch.equal(kept, o)
    got = torch.autograd.grad(kept, (q, kv), do)
    assert torch.equal(got[0], ref[0]), seed
    # the fp32 sums are equal up to reordering (~1e-7 relative); their bf16 roundings then differ by at most
    # one step of 2^-8 relative (and by fp32's reordering error where a sum cancels to near zero)
    diff = (got[1].float() - ref[1].float()).abs()
    ulp = ref[1].float().abs() * 2.0**-7 + ref[1].float().abs().max() * 1e-6
    print(f"B={B} S={S} H={H} dkv: kept vs regular, {int((diff > 0).sum())} of {diff.numel()} elements differ, "
          f"max {diff.max().item():.2e}")
    assert bool((diff <= ulp).all()), (float((diff - ulp).max()), seed)
    twin = sparse_attention_bwd_torch(q.detach().float(), kv.detach().float(), idx, o.float(), lse, do.float(), scale,
                                      chunk=64)
    for name, a, b in zip(("dq", "dkv"), got, twin):
        print(f"B={B} S={S} H={H} {name}: kernel vs twin rel-RMS {_rel(a, b):.2e} (seed {seed})")
        assert _rel(a, b) <= 2e-2, (name, _rel(a, b), seed)


# ------------------------------------------------------------------------------------------- union mode
@pytest.mark.parametrize(
    "B,S,H,G,redraw",
    [
        (1, 2301, 16, 4, 0.1),  # h200-ref's heads, 64 rows a program, partial last group
        (1, 2301, 16, 2, 0.1),  # 32 rows
        (2, 333, 16, 4, 0.3),  # every query with -1 padding, two sequences
        (1, 700, 64, 2, 0.1),  # 128 rows: two programs per group
    ],
)
def test_union_bf16_matches_twin_and_per_query_kernel(B, S, H, G, redraw):
    """The compiled union kernels against the union's fp32 torch twin and against today's per-query kernel
    (G = 1) on the same inputs, with bf16 tolerances; forced G through autograd, and the kept-output path."""
    from longctx.ops.sparse_attention import union as un
    from longctx.ops.sparse_attention.naive import persistent_pool_indices
    from longctx.ops.sparse_attention.triton import (
        kept_sparse_attention_triton,
        sparse_attention_triton,
        union_attention_bwd,
        union_attention_fwd,
    )

    D, K = 512, 2051
    g = torch.Generator(device="cuda").manual_seed(S * 7 + H + G)
    q = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16().requires_grad_(True)
    kv = torch.randn(B, S, D, device="cuda", generator=g).bfloat16().requires_grad_(True)
    idx = torch.stack([persistent_pool_indices(S, K, redraw, generator=g) for _ in range(B)])
    scale = D**-0.5 * 2.0
    do = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16()

    u = un.build_union(idx, G, S)
    o, lse = union_attention_fwd(q.detach(), kv.detach(), u, scale)
    dq, dkv = union_attention_bwd(q.detach(), kv.detach(), u, o, lse, do, scale)
    o_t, lse_t = un.union_attention_torch(q.detach().float(), kv.detach().float(), u, scale)
    dq_t, dkv_t = un.union_attention_bwd_torch(q.detach().float(), kv.detach().float(), u, o.float(), lse, do.float(),
                                               scale)
    assert _rel(o, o_t) <= 5e-3 and _rel(dq, dq_t) <= 2e-2 and _rel(dkv, dkv_t) <= 2e-2, (
        _rel(o, o_t), _rel(dq, dq_t), _rel(dkv, dkv_t))
    fin = torch.isfinite(lse_t)
    assert torch.equal(torch.isfinite(lse), fin) and float((lse[fin] - lse_t[fin]).abs().max()) < 1e-2

    o1 = sparse_attention_triton(q, kv, idx, scale, group=1)
    ref = torch.autograd.grad(o1, (q, kv), do)
    og = sparse_attention_triton(q, kv, idx, scale, group=G)
    got = torch.autograd.grad(og, (q, kv), do)
    print(f"B={B} S={S} H={H} G={G}: U/k {un.union_sizes(idx, S)[G]:.3f}; union vs G=1: o {_rel(og, o1):.2e} "
          f"dq {_rel(got[0], ref[0]):.2e} dkv {_rel(got[1], ref[1]):.2e}")
    assert _rel(og, o1) <= 5e-3 and _rel(got[0], ref[0]) <= 2e-2 and _rel(got[1], ref[1]) <= 2e-2

    kept = kept_sparse_attention_triton(q, kv, idx, o, lse, scale, group=G)
    got_k = torch.autograd.grad(kept, (q, kv), do)
    assert torch.equal(got_k[0], got[0])  # dq stays in registers: the same kernel gives the same bits
    assert _rel(got_k[1], got[1]) <= 1e-2


@pytest.mark.parametrize("G", [2, 4, 8])
def test_union_merge_build_equals_sort_on_the_gpu(G):
    """The merge build (searchsorted merges, on the device) gives the sort build's Union on CUDA, on
    persistent_pool_indices (-1 between pools) and on the same rows packed to the front (the indexer's form)."""
    from longctx.ops.sparse_attention import union as un
    from longctx.ops.sparse_attention.naive import persistent_pool_indices

    S, K = 5000, 2051
    g = torch.Generator(device="cuda").manual_seed(G)
    idx = torch.stack([persistent_pool_indices(S, K, 0.2, generator=g) for _ in range(2)])
    packed = torch.where(idx >= 0, idx, S).sort(-1).values  # rows ascending, unused slots last
    for sel in (idx, torch.where(packed < S, packed, -1).to(torch.int32)):
        sort = un.build_union(sel, G, S, method="sort")
        merge = un.build_union(sel, G, S, method="merge")
        assert merge.packed.shape == sort.packed.shape and torch.equal(merge.packed, sort.packed)
        assert torch.equal(merge.length, sort.length)


def test_union_auto_choice_on_the_gpu():
    """The cost model picks a union for neighbours that keep their pools and today's kernel for independent
    ones, and either way the result is today's function."""
    from longctx.ops.sparse_attention import union as un
    from longctx.ops.sparse_attention.naive import persistent_pool_indices
    from longctx.ops.sparse_attention.triton import sparse_attention_triton

    S, H, D, K = 16384, 16, 512, 2051  # long enough that independent picks rarely coincide
    g = torch.Generator(device="cuda").manual_seed(3)
    close = persistent_pool_indices(S, K, 0.02, generator=g)[None]
    apart = causal_pool_indices(S, K, generator=g)[None]
    assert un.resolve_group(close, H, S, "auto") == 4
    assert un.resolve_group(apart, H, S, "auto") == 1
    q = torch.randn(1, S, H, D, device="cuda", generator=g).bfloat16()
    kv = torch.randn(1, S, D, device="cuda", generator=g).bfloat16()
    o_auto = sparse_attention_triton(q, kv, close, D**-0.5)
    o_one = sparse_attention_triton(q, kv, close, D**-0.5, group=1)
    assert _rel(o_auto, o_one) <= 5e-3
