"""The k-pool indexer's Triton path on CUDA at the real widths (16x64 and 32x128 heads, top-512 pools of 4)
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
    """Selection layout: per row exactly min(K, selectable pools) ids, strictly ascending, then -1s; the
    -1 padding is not compared with itself (tests/ops/test_indexer.py checks this checker on the CPU,
    against the torch twin and broken layouts)."""
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
        (1, 2048, 16, 64, 1, 300, 0, torch.bfloat16, {"TILES": 2}),  # P=1, K not 2^n, short strips
        (1, 2048, 16, 64, 4, 128, 0, torch.bfloat16, {"BLOCK_N": 32}),  # narrower pool tiles
        (1, 1024, 5, 24, 2, 64, 0, torch.bfloat16, {"BLOCK_N": 32}),  # padded heads and head dim
    ],
)
def test_exact_inputs_match_twin(B, S, H, D, P, K, q_offset, dtype, cfg):
    """kpool_topk_triton (score kernel, then the row-select kernel, or torch.topk's k-th score and the emit
    kernel, or the twin's selection over the kernel's scores) == the twin, ties included, with a buffer of
    1000 queries (not the tiles')."""
    from longctx.ops.indexer import kpool_topk_torch
    from longctx.ops.indexer.triton import kpool_topk_triton

    NP = (q_offset + S) // P + 3  # a few pools no query sees yet
    q, w, pk = problem(B, S, H, D, NP, exact=True, dtype=dtype)
    ref = kpool_topk_torch(q, w, pk, P, K, chunk=256, q_offset=q_offset)
    selects = [(1024, "triton"), (1000, "triton"), (1000, "topk"), (1000, "torch")]
    if dtype != torch.float32:  # the fp32 kernels' compiles are the file's longest; the CPU tests cover it
        selects.append((1000, "compact"))
    for chunk, select in selects:
        out = kpool_topk_triton(q, w, pk, P, K, chunk=chunk, q_offset=q_offset, cfg=cfg, select=select)
        assert int((out != ref).any(-1).sum()) == 0, (chunk, select)


@pytest.mark.parametrize("H,D", [(16, 64), (32, 128)])
def test_random_inputs_match_twin_up_to_rounding(H, D):
    """Fresh random bf16 inputs: the emit kernel picks what the twin's selection picks from the same
    scores, and the twin's own picks differ only between near-tied pools."""
    from longctx.ops.indexer import kpool_topk_torch
    from longctx.ops.indexer.triton import kpool_topk_triton

    S, P, K = 8192, 4, 512
    q, w, pk = problem(1, S, H, D, S // P, exact=False, seed=1)
    out = kpool_topk_triton(q, w, pk, P, K)
    assert torch.equal(kpool_topk_triton(q, w, pk, P, K, select="torch"), out)
    assert torch.equal(kpool_topk_triton(q, w, pk, P, K, select="compact"), out)
    ref = kpool_topk_torch(q, w, pk, P, K, chunk=512)
    n_rows, gap = near_tie_gap(out, ref, q, w, pk)
    assert n_rows <= S // 100, n_rows  # last-bit score differences flip at most a few rows
    assert gap < 1e-5, (n_rows, gap)
    check_structure(out, P, K)


@pytest.mark.parametrize("n", [511, 4097, 16384, 32768, 32769])
def test_row_select_kernel_matches_twin_on_long_rows(n):
    """The one-kernel row select (rows up to ROW_CAP scores) and the torch.topk + emit path pick what the
    twin's selection picks: fp32 scores of several magnitudes with many exact ties, -0.0 beside +0.0,
    rows from none to all selectable; past ROW_CAP `auto` takes the topk path and "rows" is refused."""
    from longctx.ops.indexer.naive import select_from_scores
    from longctx.ops.indexer.triton import ROW_CAP, select_from_scores_triton

    g = torch.Generator(device="cuda").manual_seed(n)
    c, k = 24, 512
    sc = torch.randn(1, c, n, device="cuda", generator=g) * torch.logspace(-3, 3, c, device="cuda")[None, :, None]
    sc[:, ::2] = sc[:, ::2].round()  # integer rows: many scores equal the k-th
    sc[:, 1::4, ::7] = -0.0
    valid = torch.rand(1, c, n, device="cuda", generator=g) < torch.linspace(0, 1, c, device="cuda")[None, :, None]
    sc = torch.where(valid, sc, float("-inf"))
    ref = select_from_scores(sc, valid, k)
    assert torch.equal(select_from_scores_triton(sc, k, method="topk"), ref)
    assert torch.equal(select_from_scores_triton(sc, k), ref)
    assert torch.equal(select_from_scores_triton(sc, k, method="compact"), ref)
    if triton_next_pow2(n) <= ROW_CAP:
        assert torch.equal(select_from_scores_triton(sc, k, method="rows"), ref)
    else:
        with pytest.raises(ValueError, match="method='topk'"):
            select_from_scores_triton(sc, k, method="rows")


@pytest.mark.parametrize("n", [65536, 262144 + 4099, 1048576])
def test_compact_select_matches_twin_on_wide_rows(n):
    """"compact" on rows past the row kernel (what `auto` runs there), with group maxima coarsened past
    GROUP_ROW_CAP groups: the twin's picks on float rows, tied integer rows, rows rising with the pool id
    (the best pools packed into the last groups) and all-equal rows; as many candidates as the bound says."""
    from longctx.ops.indexer.naive import select_from_scores
    from longctx.ops.indexer.triton import compact_candidates, compact_group, group_maxima, select_from_scores_triton
    from test_indexer import _compact_count  # tests/ops is on sys.path (pytest's rootdir import mode)

    g = torch.Generator(device="cuda").manual_seed(n)
    c, k = 8, 512
    assert compact_group(n, k) is not None
    valid = torch.rand(1, c, n, device="cuda", generator=g) < torch.linspace(0.5, 1, c, device="cuda")[None, :, None]
    rising = torch.arange(n, device="cuda").float() + torch.rand(1, c, n, device="cuda", generator=g)
    for sc in (torch.randn(1, c, n, device="cuda", generator=g), torch.randint(-3, 4, (1, c, n), device="cuda",
               generator=g).float(), rising, torch.zeros(1, c, n, device="cuda")):
        sc = torch.where(valid, sc, float("-inf"))
        ref = select_from_scores(sc, valid, k)
        assert torch.equal(select_from_scores_triton(sc, k), ref)
        assert torch.equal(select_from_scores_triton(sc, k, method="compact", gmax=group_maxima(sc, 16)), ref)
        assert torch.equal(compact_candidates(sc, k, group_maxima(sc, 16)), _compact_count(sc, k, compact_group(n, k)))


@pytest.mark.parametrize("group", [16, 32, 64])
def test_score_kernel_group_maxima(group):
    """The score kernel's group maxima (each `group` pools' largest score, written from its tiles) equal
    torch's over the scores it writes, -inf groups and a ragged last group included."""
    from longctx.ops.indexer.triton import group_maxima, kpool_scores_triton

    q, w, pk = problem(1, 1500, 16, 64, 1100, exact=False, seed=5)
    score, gm = kpool_scores_triton(q, w, pk, 4, 1000, q_offset=2500, group=group)
    assert gm.shape[-1] == -(-1000 // group)
    assert torch.equal(gm, group_maxima(score, group))


def test_default_path_equals_topk_at_128k():
    """At 131,072 tokens the default selection (the row kernel on rows of up to 8,192 pools, "compact"
    past them, its group maxima from the score kernel) picks what torch.topk's k-th score and the emit
    kernel pick from the same scores, on every row."""
    from longctx.ops.indexer.triton import kpool_topk_triton

    S, P, K = 131072, 4, 512
    q, w, pk = problem(1, S, 16, 64, S // P, exact=False, seed=3)
    assert torch.equal(kpool_topk_triton(q, w, pk, P, K), kpool_topk_triton(q, w, pk, P, K, select="topk"))


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def test_memory_is_one_buffer_of_queries():
    """Peak memory beyond the inputs: the output plus one block of queries' fp32 scores against the pools
    (and the selection's temporaries over it; one buffer, the last block's size, for every block), never
    the [S, NP] scores (4 GiB here)."""
    from longctx.ops.indexer.triton import kpool_topk_triton

    S, H, D, P, K, chunk = 65536, 16, 64, 4, 512, 1024
    q, w, pk = problem(1, S, H, D, S // P, exact=False)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = kpool_topk_triton(q, w, pk, P, K, chunk=chunk)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    n = S // P  # past ROW_AUTO pools: the buffer, its 16-pool maxima, compact's candidates (k x 16 a row)
    # and the ids of the groups it reads (k a row)
    bound = out.numel() * 4 + chunk * n * 4 * (1 + 1 / 16) + chunk * K * 16 * 8 + 2 * chunk * K * 4 + (1 << 20)
    assert extra < bound < S * (S // P) * 4 / 8, (extra, bound)


# ------------------------------------------------------------------------------ the layer's backend switch
def h200_indexer(seed=0):
    """KPoolIndexer at the h200-ref shapes (16 heads x 64, pools of 4, top-2048 tokens = 512 pools,
    tail on) in bf16 on CUDA, its default init (pool gate ones, no positional bias)."""
    from longctx.config import preset
    from longctx.layers.kpool_indexer import KPoolIndexer

    cfg = preset("h200-ref")
    torch.manual_seed(seed)
    ind = KPoolIndexer(cfg, 3).cuda().to(torch.bfloat16)
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
    """KPoolIndexer.select, kernels.indexer triton (the Triton path over the whole sequence) vs torch
    (chunks of 256, topk): the same token sets per query (ascending rows, so tensor equality), up to pools
    whose scores tie within fp32 rounding (random bf16 inputs: exact ties do not occur at the k-th score)."""
    ind, cfg = h200_indexer()
    g = torch.Generator(device="cuda").manual_seed(S)
    x = torch.randn(B, S, cfg.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    ql = torch.randn(B, S, cfg.q_lora_rank, device="cuda", generator=g).to(torch.bfloat16)
    ind.kernels["indexer"] = "triton"
    got = ind.select(x, ql)
    assert ind.last_impl == "indexer:triton-two-phase"
    ind.kernels["indexer"] = "torch"
    ref = ind.select(x, ql)
    assert ind.last_impl == "indexer:torch-chunked"
    assert got.shape == ref.shape == (B, S, ind.width) and got.dtype == torch.int32
    n_rows, gap = layer_near_tie_gap(ind, x, ql, got, ref)
    assert n_rows <= max(2, B * S // 1000), (n_rows, gap)
    assert gap < 1e-5, (n_rows, gap)
    ind.kernels["indexer"] = "auto"  # on CUDA: the Triton path, without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(ind.select(x[:, :600], ql[:, :600]), got[:, :600])
    assert ind.last_impl == "indexer:triton-two-phase"


@torch.no_grad()
def test_layer_triton_backend_decoding():
    """With an IndexerCache: a 6001-token prefill, then 1-, 7- and 1-token steps (query offsets
    p0 > 0), each backend with its own cache; then the triton picks equal the whole-sequence call's
    (its tie-break does not depend on the row length)."""
    from longctx.layers.kpool_indexer import IndexerCache

    ind, cfg = h200_indexer(seed=1)
    g = torch.Generator(device="cuda").manual_seed(5)
    S = 6010
    x = torch.randn(1, S, cfg.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    ql = torch.randn(1, S, cfg.q_lora_rank, device="cuda", generator=g).to(torch.bfloat16)
    caches = {"triton": IndexerCache(), "torch": IndexerCache()}
    outs = {"triton": [], "torch": []}
    for a, b in [(0, 6001), (6001, 6002), (6002, 6009), (6009, 6010)]:
        for backend in ("triton", "torch"):
            ind.kernels["indexer"] = backend
            outs[backend].append(ind.select(x[:, a:b], ql[:, a:b], cache=caches[backend]))
    got, ref = torch.cat(outs["triton"], 1), torch.cat(outs["torch"], 1)
    n_rows, gap = layer_near_tie_gap(ind, x, ql, got, ref)
    assert n_rows <= 6 and gap < 1e-5, (n_rows, gap)
    ind.kernels["indexer"] = "triton"
    full = ind.select(x, ql)
    n_rows, gap = layer_near_tie_gap(ind, x, ql, got, full)
    assert n_rows <= 6 and gap < 1e-5, (n_rows, gap)
