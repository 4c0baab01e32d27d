"""The fused k-pool indexer kernel on CUDA at the real widths (16x64 and 32x128 heads, top-512 pools of 4)
against the torch twin: identical pool ids on exact (small-integer) inputs, ties included, and on
random inputs identical except between pools whose scores tie to within fp32 rounding."""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def problem(B, S, H, D, NP, exact, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if exact:  # small integers: exact products and sums in fp32, many equal scores
        q = torch.randint(-2, 3, (B, S, H, D), device="cuda", generator=g).float()
        pk = torch.randint(-2, 3, (B, NP, D), device="cuda", generator=g).float()
        w = torch.randint(-2, 4, (B, S, H), device="cuda", generator=g).float() * 0.5
    else:
        q = torch.randn(B, S, H, D, device="cuda", generator=g) * D**-0.5
        pk = torch.randn(B, NP, D, device="cuda", generator=g)
        w = torch.randn(B, S, H, device="cuda", generator=g) * H**-0.5
    return q.to(dtype), w, pk.to(dtype)


def check_structure(out: torch.Tensor, P: int, K: int, q_offset: int = 0) -> None:
    """Selection layout: per row exactly min(K, selectable pools) ids, strictly ascending, then -1s.
    (A first version compared the -1 padding with itself and failed on every padded row, the torch
    twin's included; tests/ops/test_indexer.py checks this checker on the CPU.)"""
    S = out.shape[1]
    valid = out >= 0
    visible = ((torch.arange(S, device=out.device) + q_offset + 1) // P).clamp(max=K)
    assert torch.equal(valid.sum(-1), visible.expand_as(valid.sum(-1))), "wrong number of picks"
    assert bool((valid[..., 1:] <= valid[..., :-1]).all()), "-1 before a pick"
    both = valid[..., 1:] & valid[..., :-1]
    assert bool((out[..., 1:] > out[..., :-1])[both].all()), "ids not strictly ascending"


def near_tie_gap(out, ref, q, w, pk) -> tuple[int, float]:
    """Rows that differ, and the largest |score - k-th score| (relative to the row's score scale)
    over pools picked by only one of the two: 0 when the picks agree."""
    from longctx.ops.indexer import kpool_scores_torch

    rows = (out != ref).any(-1).nonzero().tolist()
    worst = 0.0
    for b, t in rows[:200]:
        sc = kpool_scores_torch(q[b : b + 1, t : t + 1], w[b : b + 1, t : t + 1], pk[b : b + 1])[0, 0].double()
        a, c = set(out[b, t].tolist()) - {-1}, set(ref[b, t].tolist()) - {-1}
        kth = sc[sorted(c)].min()
        scale = sc.abs().max().clamp_min(1e-30)
        for p in a ^ c:
            worst = max(worst, float((sc[p] - kth).abs() / scale))
    return len(rows), worst


@pytest.mark.parametrize(
    "B,S,H,D,P,K,q_offset,dtype,cfg",
    [
        (1, 4096, 16, 64, 4, 512, 0, torch.bfloat16, None),  # the flash config's indexer
        (2, 3001, 32, 128, 4, 512, 0, torch.bfloat16, None),  # the large config's, two sequences, ragged S
        (1, 2500, 16, 64, 4, 512, 0, torch.float32, None),  # fp32 MMAs
        (1, 64, 16, 64, 4, 512, 6000, torch.bfloat16, None),  # decoding: 64 queries after 6000 cached tokens
        (1, 2048, 16, 64, 1, 300, 0, torch.bfloat16, {"CAND": 0}),  # pure radix select, P=1, K not 2^n
        (1, 2048, 16, 64, 4, 128, 0, torch.bfloat16, {"HIST_TL": False, "RBITS": 2}),  # one-hot histogram
        (1, 1024, 5, 24, 2, 64, 0, torch.bfloat16, {"BLOCK_N": 32}),  # padded heads and head dim
    ],
)
def test_exact_inputs_match_twin(B, S, H, D, P, K, q_offset, dtype, cfg):
    from longctx.ops.indexer import kpool_topk_torch
    from longctx.ops.indexer.fused import LAST_LAUNCH, kpool_topk_triton

    NP = (q_offset + S) // P + 3  # a few pools no query sees yet
    q, w, pk = problem(B, S, H, D, NP, exact=True, dtype=dtype)
    out = kpool_topk_triton(q, w, pk, P, K, q_offset=q_offset, cfg=cfg)
    ref = kpool_topk_torch(q, w, pk, P, K, chunk=256, q_offset=q_offset)
    torch.cuda.synchronize()
    bad = int((out != ref).any(-1).sum())
    assert bad == 0, (bad, LAST_LAUNCH.get("passes").float().mean().item())


@pytest.mark.parametrize("H,D", [(16, 64), (32, 128)])
def test_random_inputs_match_twin_up_to_rounding(H, D):
    from longctx.ops.indexer import kpool_topk_torch
    from longctx.ops.indexer.fused import kpool_topk_triton

    S, P, K = 8192, 4, 512
    q, w, pk = problem(1, S, H, D, S // P, exact=False, seed=1)
    out = kpool_topk_triton(q, w, pk, P, K)
    ref = kpool_topk_torch(q, w, pk, P, K, chunk=512)
    n_rows, gap = near_tie_gap(out, ref, q, w, pk)
    assert n_rows <= S // 100, n_rows  # last-bit score differences flip at most a few rows
    assert gap < 1e-5, (n_rows, gap)
    check_structure(out, P, K)


@pytest.mark.parametrize("B,S,H,D,P,K,q_offset,dtype", [
    (1, 4096, 16, 64, 4, 512, 0, torch.bfloat16),  # the flash config's indexer, exact inputs
    (2, 3001, 32, 128, 4, 512, 0, torch.bfloat16),  # the large config's, two sequences, ragged S
    (1, 64, 16, 64, 4, 512, 6000, torch.bfloat16),  # decoding offset
    (1, 2500, 16, 64, 1, 300, 0, torch.float32),  # fp32 MMAs, P=1, K not 2^n
])
def test_two_phase_exact_inputs_match_twin(B, S, H, D, P, K, q_offset, dtype):
    """The two-phase indexer (score kernel into a buffer + torch selection) == the twin, ties included."""
    from longctx.ops.indexer import kpool_topk_torch, kpool_topk_two_phase

    NP = (q_offset + S) // P + 3
    q, w, pk = problem(B, S, H, D, NP, exact=True, dtype=dtype)
    out = kpool_topk_two_phase(q, w, pk, P, K, chunk=1000, q_offset=q_offset)
    ref = kpool_topk_torch(q, w, pk, P, K, chunk=256, q_offset=q_offset)
    assert int((out != ref).any(-1).sum()) == 0
    radix = kpool_topk_two_phase(q, w, pk, P, K, chunk=1000, q_offset=q_offset, kth="radix")
    assert int((radix != ref).any(-1).sum()) == 0
    grouped = kpool_topk_two_phase(q, w, pk, P, K, chunk=1000, q_offset=q_offset, kth="grouped")
    assert int((grouped != ref).any(-1).sum()) == 0


def test_two_phase_random_inputs_match_fused_and_twin():
    """Fresh random bf16 inputs at h200-ref's width: the two-phase picks equal the fused kernel's (one
    tile-score code path) and differ from the twin only between near-tied pools."""
    from longctx.ops.indexer import kpool_topk_torch, kpool_topk_two_phase
    from longctx.ops.indexer.fused import kpool_topk_triton

    S, P, K = 8192, 4, 512
    q, w, pk = problem(1, S, 16, 64, S // P, exact=False, seed=5)
    two = kpool_topk_two_phase(q, w, pk, P, K, chunk=1024)
    assert torch.equal(kpool_topk_two_phase(q, w, pk, P, K, chunk=1024, kth="radix"), two)  # the same k-th scores
    assert torch.equal(kpool_topk_two_phase(q, w, pk, P, K, chunk=1024, kth="grouped"), two)
    fused = kpool_topk_triton(q, w, pk, P, K)
    ref = kpool_topk_torch(q, w, pk, P, K, chunk=512)
    assert int((two != fused).any(-1).sum()) <= S // 1000
    n_rows, gap = near_tie_gap(two, ref, q, w, pk)
    assert n_rows <= S // 100 and gap < 1e-5, (n_rows, gap)
    check_structure(two, P, K)


@pytest.mark.parametrize("rbits", [8, 4])
def test_radix_kth_equals_topk(rbits):
    """_kth_score_kernel against torch.topk's k-th value, exactly, on causal-looking fp32 rows (a prefix
    of finite scores, -inf after), bf16-rounded so that ties occur, signed zeros, k past the finite part."""
    from longctx.ops.indexer.triton import kth_scores_triton

    g = torch.Generator(device="cuda").manual_seed(rbits)
    c, n = 300, 20011
    sc = torch.randn(2, c, n, device="cuda", generator=g).relu_().bfloat16().float()
    sc[0, :, ::7] = -0.0
    lens = torch.linspace(1, n, c, device="cuda").long()
    sc = torch.where(torch.arange(n, device="cuda") < lens[:, None], sc, float("-inf"))
    for k in (1, 512, 5000, n + 5):
        got = kth_scores_triton(sc, k, rbits=rbits)
        ref = sc.topk(min(k, n), dim=-1, sorted=False).values.amin(-1)
        assert torch.equal(got, ref), (k, int((got != ref).sum()))


def test_memory_is_o_s_k():
    """Peak memory beyond the inputs: the output plus a small candidate buffer, no [S, NP] scores."""
    from longctx.ops.indexer.fused import kpool_topk_triton

    S, H, D, P, K = 65536, 16, 64, 4, 512
    q, w, pk = problem(1, S, H, D, S // P, exact=False)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = kpool_topk_triton(q, w, pk, P, K)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 1.5 * out.numel() * 4, (extra, out.numel() * 4)  # scores would be S*NP*4 = 4 GiB


def test_select_pools_dispatch():
    from longctx.ops.indexer import select_pools

    q, w, pk = problem(1, 300, 16, 64, 75, exact=True)
    a = select_pools(q, w, pk, 4, 20, backend="triton")
    b = select_pools(q, w, pk, 4, 20, backend="torch")
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------ the layer's backend switch
def h200_indexer(seed=0, kernel="fused"):
    """KPoolIndexer at the h200-ref shapes (16 heads x 64, pools of 4, top-2048 tokens = 512 pools,
    tail on) in bf16 on CUDA, its default init (pool gate ones, no positional bias); `kernel` its
    Triton path (the default is two_phase; the tests name the one they check)."""
    from longctx.config import preset
    from longctx.layers.kpool_indexer import KPoolIndexer

    cfg = preset("h200-ref")
    torch.manual_seed(seed)
    ind = KPoolIndexer(cfg, 3).cuda().to(torch.bfloat16)
    ind.kernel = kernel
    return ind, cfg


def layer_near_tie_gap(ind, x, ql, got, ref, p0=0, pk=None) -> tuple[int, float]:
    """Rows whose token sets differ, and the largest relative |score - k-th score| over the pools
    only one backend picked (scores from the layer's own fp32 pool_scores)."""
    P = ind.pool
    rows = (got != ref).any(-1).nonzero().tolist()
    if pk is None:
        k, gate = ind.key_rows(x)
        n = x.shape[1] // P * P
        pk = ind.pool_keys(k[:, :n], gate[:, :n])
    worst = 0.0
    for b, t in rows[:200]:
        sc = ind.pool_scores(ql[b : b + 1, t : t + 1], x[b : b + 1, t : t + 1], pk[b : b + 1])[0, 0].double()
        a = {v // P for v in got[b, t].tolist() if v >= 0 and (v // P + 1) * P - 1 <= p0 + t}
        c = {v // P for v in ref[b, t].tolist() if v >= 0 and (v // P + 1) * P - 1 <= p0 + t}
        kth, scale = sc[sorted(c)].min(), sc.abs().max().clamp_min(1e-30)
        for p in a ^ c:
            worst = max(worst, float((sc[p] - kth).abs() / scale))
    return len(rows), worst


@pytest.mark.parametrize("B,S", [(2, 2500), (1, 8192), (1, 32765)])
@torch.no_grad()
def test_layer_triton_backend_matches_torch(B, S):
    """KPoolIndexer.select, backend triton (one fused launch) vs torch (chunks of 256, topk): the
    same token sets per query (ascending rows, so tensor equality), up to pools whose scores tie
    within fp32 rounding (random bf16 inputs: exact ties do not occur at the k-th score)."""
    ind, cfg = h200_indexer()
    g = torch.Generator(device="cuda").manual_seed(S)
    x = torch.randn(B, S, cfg.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    ql = torch.randn(B, S, cfg.q_lora_rank, device="cuda", generator=g).to(torch.bfloat16)
    ind.backend = "triton"
    got = ind.select(x, ql)
    assert ind.last_impl == "indexer:triton-fused"
    ind.backend = "torch"
    ref = ind.select(x, ql)
    assert ind.last_impl == "indexer:torch-chunked"
    assert got.shape == ref.shape == (B, S, ind.width) and got.dtype == torch.int32
    n_rows, gap = layer_near_tie_gap(ind, x, ql, got, ref)
    assert n_rows <= max(2, B * S // 1000), (n_rows, gap)
    assert gap < 1e-5, (n_rows, gap)
    ind.backend = "auto"  # on CUDA: the kernel, without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(ind.select(x[:, :600], ql[:, :600]), got[:, :600])
    assert ind.last_impl == "indexer:triton-fused"


@torch.no_grad()
def test_layer_two_phase_kernel_matches_torch():
    """KPoolIndexer.kernel = two_phase at h200-ref's width: the torch backend's picks up to near-ties."""
    ind, cfg = h200_indexer()
    B, S = 1, 8192
    g = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(B, S, cfg.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    ql = torch.randn(B, S, cfg.q_lora_rank, device="cuda", generator=g).to(torch.bfloat16)
    ind.backend, ind.kernel = "triton", "two_phase"
    got = ind.select(x, ql)
    assert ind.last_impl == "indexer:triton-two-phase"
    ind.backend, ind.kernel = "torch", "fused"
    ref = ind.select(x, ql)
    n_rows, gap = layer_near_tie_gap(ind, x, ql, got, ref)
    assert n_rows <= max(2, B * S // 1000) and gap < 1e-5, (n_rows, gap)


@pytest.mark.parametrize("kernel", ["fused", "two_phase", "two_phase_radix", "two_phase_grouped"])
@torch.no_grad()
def test_layer_triton_backend_decoding(kernel):
    """With an IndexerCache: a 6001-token prefill, then 1-, 7- and 1-token steps (query offsets
    p0 > 0), each backend with its own cache; then the triton picks equal the whole-sequence call's
    (its tie-break does not depend on the row length)."""
    from longctx.layers.kpool_indexer import IndexerCache

    ind, cfg = h200_indexer(seed=1, kernel=kernel)
    g = torch.Generator(device="cuda").manual_seed(5)
    S = 6010
    x = torch.randn(1, S, cfg.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    ql = torch.randn(1, S, cfg.q_lora_rank, device="cuda", generator=g).to(torch.bfloat16)
    caches = {"triton": IndexerCache(), "torch": IndexerCache()}
    outs = {"triton": [], "torch": []}
    for a, b in [(0, 6001), (6001, 6002), (6002, 6009), (6009, 6010)]:
        for backend in ("triton", "torch"):
            ind.backend = backend
            outs[backend].append(ind.select(x[:, a:b], ql[:, a:b], cache=caches[backend]))
    got, ref = torch.cat(outs["triton"], 1), torch.cat(outs["torch"], 1)
    n_rows, gap = layer_near_tie_gap(ind, x, ql, got, ref)
    assert n_rows <= 6 and gap < 1e-5, (n_rows, gap)
    ind.backend = "triton"
    full = ind.select(x, ql)
    n_rows, gap = layer_near_tie_gap(ind, x, ql, got, full)
    assert n_rows <= 6 and gap < 1e-5, (n_rows, gap)
