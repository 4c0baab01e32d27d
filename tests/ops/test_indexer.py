"""The k-pool indexer (score + top-k pools): the torch twin vs a slow reference, the Triton path vs the twin.

The twin is checked in-process against a per-query Python sort (fp64 scores, key (-score, pool)).
The Triton kernel runs on the CPU through the interpreter: `TRITON_INTERPRET=1` must be set before
triton is first imported, and other test modules import triton earlier in the same pytest
process, so those checks run in a fresh subprocess (this file run as a script) that prints one
JSON line per case; the pytest side asserts on them.

Most cases use small-integer inputs: every score is then exact in fp32 whatever the summation
order, so the kernel and the twin must agree id for id, and ties (equal scores, all-zero ReLUs,
negative weights, -0.0) are frequent, which is what the lower-pool-id tie-break is about.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from longctx import errors
from longctx.ops.indexer import kpool_scores_torch, kpool_topk_torch, select_from_scores


def ref_select(q, w, pk, P, K, q_offset=0) -> torch.Tensor:
    """Slow reference: fp64 scores, each query's selectable pools sorted by (-score, pool id)."""
    s = torch.einsum("bshd,bnd->bshn", q.double(), pk.double()).clamp_min(0)
    score = torch.einsum("bsh,bshn->bsn", w.double(), s)
    B, S, NP = score.shape
    out = torch.full((B, S, K), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(S):
            sc = score[b, t].tolist()
            cand = [p for p in range(NP) if (p + 1) * P - 1 <= q_offset + t]
            best = sorted(sorted(cand, key=lambda p: (-sc[p], p))[:K])
            out[b, t, : len(best)] = torch.tensor(best, dtype=torch.int32)
    return out


def int_problem(B, S, H, D, NP, lo, seed, dtype=torch.float32):
    """Small-integer q, pk and w in {-1, -0.5, 0, 0.5, 1, 1.5}: exact fp32 scores, many ties."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-lo, lo + 1, (B, S, H, D), generator=g).float().to(dtype)
    pk = torch.randint(-lo, lo + 1, (B, NP, D), generator=g).float().to(dtype)
    w = torch.randint(-2, 4, (B, S, H), generator=g).float() * 0.5
    return q, w, pk


# (name, B, S, H, D, P, NP, K, q_offset, lo, dtype, tiles)
CASES = [
    # many ties, two blocks of queries, several pool tiles
    ("ties_fp32", 2, 45, 3, 16, 2, 22, 7, 0, 1, "float32", {"BLOCK_M": 8, "BLOCK_N": 16}),
    # wider values, every token its own pool
    ("wide_values", 1, 40, 5, 24, 1, 40, 9, 0, 3, "float32", {"BLOCK_M": 8, "BLOCK_N": 16}),
    # bf16 inputs, decoding offset, pools beyond the causal range, production tile shape
    ("bf16_offset", 1, 30, 16, 32, 4, 20, 5, 13, 2, "bfloat16", {"BLOCK_N": 16}),
    # k_pools above the pool count: every row partly -1; P=4 and D=8 (padded to 16)
    ("k_over_np", 2, 21, 2, 8, 4, 5, 8, 0, 1, "float32", {"BLOCK_N": 16}),
    # all weights zero: every score is 0, so every query takes its lowest pool ids
    ("all_zero", 1, 40, 4, 16, 1, 40, 6, 0, 1, "float32", {"BLOCK_M": 8, "BLOCK_N": 16}),
]


def layer_problem(B, S, heads, head_dim, topk, pool, seed):
    """A KPoolIndexer with random weights (no exact score ties: every head's ReLU rarely vanishes
    together) and random x, q_latent [B, S, ...] for it."""
    from longctx.config import preset
    from longctx.layers.kpool_indexer import KPoolIndexer

    cfg = preset("tiny").replace(index_heads=heads, index_head_dim=head_dim, index_topk=topk, index_pool=pool,
                                 index_tail=True)
    torch.manual_seed(seed)
    ind = KPoolIndexer(cfg, 0)
    with torch.no_grad():
        for p in ind.parameters():
            p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]))
    return ind, torch.randn(B, S, cfg.hidden_size), torch.randn(B, S, cfg.q_lora_rank)


def kth_gap(ind, x, ql) -> float:
    """Smallest relative gap between a query's k-th and (k+1)-th best selectable pool score (fp64 of
    the layer's fp32 scores); inf when no query has more pools than it keeps. A gap near fp32
    rounding would let the backends' summation orders pick differently."""
    P, K = ind.pool, ind.topk // ind.pool
    S = x.shape[1]
    with torch.no_grad():
        k, gate = ind.key_rows(x)
        pk = ind.pool_keys(k[:, : S // P * P], gate[:, : S // P * P])
        score = ind.pool_scores(ql, x, pk).double()
    gap = math.inf
    for t in range(S):
        n = (t + 1) // P
        if n > K:
            row = score[:, t, :n].sort(-1, descending=True).values
            rel = (row[:, K - 1] - row[:, K]).abs() / row.abs().amax(-1).clamp_min(1e-30)
            gap = min(gap, float(rel.min()))
    return gap


def _run_layer_cases() -> None:
    """The layer's select with kernels.indexer triton (the Triton path, interpreted) against torch."""
    from longctx.layers.kpool_indexer import IndexerCache

    # whole sequences (the kernels' default tiles): S=101 is four query blocks of 32 (8 heads), the
    # last one ragged, and 25 pools (a partial pool tile of 64); topk 16 in pools of 4 = 4 pools per
    # query, tail on.
    ind, x, ql = layer_problem(2, 101, 8, 16, 16, 4, seed=3)
    ind.kernels["indexer"] = "triton"
    got = ind.select(x, ql)
    impl = ind.last_impl
    ind.kernels["indexer"] = "torch"
    ref_chunked = ind.select(x, ql, chunk=7)
    ref_unchunked = ind.select(x, ql, chunk=None)
    print("RESULT " + json.dumps({"name": "layer_full", "impl": impl, "gap": kth_gap(ind, x, ql),
                                  "equal": bool(torch.equal(got, ref_chunked) and torch.equal(got, ref_unchunked)),
                                  "n_bad_rows": int((got != ref_chunked).any(-1).sum())}), flush=True)

    # decoding: a ragged prefill, then steps of 1..13 tokens crossing pool boundaries (query offset p0 not a
    # multiple of the pool or of the tiles), each backend with its own cache
    ind, x, ql = layer_problem(1, 83, 8, 16, 20, 4, seed=4)
    caches = {"triton": IndexerCache(), "torch": IndexerCache()}
    bounds = [0, 45, 46, 47, 52, 65, 66, 83]
    equal, impls, n_bad = True, set(), 0
    for a, b in itertools.pairwise(bounds):
        outs = {}
        for backend in ("triton", "torch"):
            ind.kernels["indexer"] = backend
            outs[backend] = ind.select(x[:, a:b], ql[:, a:b], cache=caches[backend])
            impls.add(ind.last_impl)
        equal &= torch.equal(outs["triton"], outs["torch"])
        n_bad += int((outs["triton"] != outs["torch"]).any(-1).sum())
    ind.kernels["indexer"] = "torch"
    full = ind.select(x, ql)  # decoding picks the same tokens as the whole sequence at once
    print("RESULT " + json.dumps({"name": "layer_cache", "impls": sorted(impls), "gap": kth_gap(ind, x, ql),
                                  "equal": bool(equal), "n_bad_rows": n_bad,
                                  "cache_len": caches["triton"].length,
                                  "full_equal_last": bool(torch.equal(full[:, 66:], outs["triton"]))}), flush=True)


def _compact_count(sc: torch.Tensor, k: int, group: int) -> torch.Tensor:
    """How many candidates "compact" keeps a row: those above T (the k-th largest group maximum; every
    valid score where at most k groups are valid), then the first k - (groups above T) equal to it."""
    pad = (-sc.shape[-1]) % group
    gm = torch.nn.functional.pad(sc, (0, pad), value=float("-inf")).unflatten(-1, (-1, group)).amax(-1)
    n_valid = (gm != float("-inf")).sum(-1, keepdim=True)
    thr = gm.topk(min(k, gm.shape[-1]), -1).values[..., -1:]
    thr = torch.where(n_valid <= k, torch.full_like(thr, -float("inf")), thr)
    valid = sc != float("-inf")
    gt = (valid & (sc > thr)).sum(-1)
    eq = (valid & (sc == thr)).sum(-1)
    return (gt + torch.minimum(eq, k - (gm > thr).sum(-1))).int()


def _run_compact_cases() -> None:
    """The "compact" selection: the k-th largest group maximum bounds the k-th score from below, the scores
    at or above it go to a buffer, the row kernel selects among them."""
    import longctx.ops.indexer.triton as tri
    from longctx.ops.indexer.naive import select_from_scores

    g = torch.Generator().manual_seed(13)
    bad = []
    # one batch row of nine rows, from none to every score selectable (the interpreter's time goes by rows;
    # the cases above cover batch strides)
    for n, k in ((1000, 20), (700, 7), (333, 1), (150, 64), (64, 100)):
        valid = torch.rand(1, 9, n, generator=g) < torch.linspace(0, 1, 9)[None, :, None]
        ints = torch.randint(-3, 4, (1, 9, n), generator=g).float()  # many scores equal the k-th
        ints[:, ::3, ::5] = -0.0
        rising = torch.arange(n).float().expand(1, 9, n) + torch.rand(1, 9, n, generator=g)  # the best k in k / 16 groups
        rows = {"ints": ints, "floats": torch.randn(1, 9, n, generator=g) * 1e3, "rising": rising,
                "falling": -rising, "equal": torch.zeros(1, 9, n)}
        for name, sc in rows.items():
            sc = torch.where(valid, sc, float("-inf"))
            ref = select_from_scores(sc, valid, k)
            if not torch.equal(tri.select_from_scores_triton(sc, k, method="compact"), ref):
                bad.append((n, k, name))
            if not torch.equal(tri.select_from_scores_triton(sc, k, method="compact", gmax=tri.group_maxima(sc, 16)), ref):
                bad.append((n, k, name, "gmax"))
            # steps of two groups: the pass over a row's groups in several steps, ties counted across them
            block_s, tri.COMPACT_BLOCK_S = tri.COMPACT_BLOCK_S, 32
            try:
                if not torch.equal(tri.select_from_scores_triton(sc, k, method="compact"), ref):
                    bad.append((n, k, name, "steps"))
                if not torch.equal(tri.compact_candidates(sc, k), _compact_count(sc, k, 16)):
                    bad.append((n, k, name, "count"))
            finally:
                tri.COMPACT_BLOCK_S = block_s
    # rows wider than GROUP_ROW_CAP groups take coarser groups (here from 32 groups a row on)
    import longctx.ops.indexer as ind

    cap = ind.GROUP_ROW_CAP
    ind.GROUP_ROW_CAP = 32
    try:
        sc = torch.where(torch.rand(1, 5, 1500, generator=g) < 0.9, torch.randn(1, 5, 1500, generator=g), float("-inf"))
        group = tri.compact_group(1500, 9)
        if not torch.equal(tri.select_from_scores_triton(sc, 9, method="compact", gmax=tri.group_maxima(sc, 16)),
                           select_from_scores(sc, sc != float("-inf"), 9)):
            bad.append((1500, 9, "coarse"))
    finally:
        ind.GROUP_ROW_CAP = cap
    # the score kernel's group maxima are its scores' (-inf where nothing is selectable), and the whole path
    # with them picks what the twin picks, on rows of up to 25 groups
    q, w, pk = int_problem(1, 400, 4, 16, 400, 3, seed=21, dtype=torch.float32)
    score, gm = tri.kpool_scores_triton(q, w, pk, 1, 405, q_offset=2, cfg={"BLOCK_N": 32, "TILES": 2}, group=16)
    twin = kpool_topk_torch(q, w, pk, 1, 5)
    out = tri.kpool_topk_triton(q, w, pk, 1, 5, chunk=128, cfg={"BLOCK_N": 32, "TILES": 2}, select="compact")
    print("RESULT " + json.dumps({"name": "compact", "bad": bad, "coarse_group": group,
                                  "gm_equal": bool(torch.equal(gm, tri.group_maxima(score, 16))), "gm_shape": list(gm.shape),
                                  "equal": bool(torch.equal(out, twin)), "n_bad_rows": int((out != twin).any(-1).sum())}),
          flush=True)


def _run_cases() -> None:
    """Subprocess body: TRITON_INTERPRET=1 is already in the environment."""
    _run_layer_cases()
    from longctx.ops.indexer.triton import kpool_scores_triton, kpool_topk_triton, select_from_scores_triton

    for i, (name, B, S, H, D, P, NP, K, off, lo, dt, tiles) in enumerate(CASES):
        q, w, pk = int_problem(B, S, H, D, NP, lo, seed=100 + i, dtype=getattr(torch, dt))
        if name == "all_zero":
            w = torch.zeros_like(w)
            w[..., ::2] = -0.0  # zero scores whatever the heads' ReLUs: lowest pool ids win
        q = torch.cat([q, torch.zeros_like(q[..., :3])], -1)[..., :D]  # a strided view
        twin = kpool_topk_torch(q, w, pk, P, K, chunk=7, q_offset=off)
        cfg = dict(tiles, TILES=2)
        out = kpool_topk_triton(q, w, pk, P, K, chunk=13, q_offset=off, cfg=cfg)
        out_t = kpool_topk_triton(q, w, pk, P, K, chunk=13, q_offset=off, cfg=cfg, select="torch")
        out_c = kpool_topk_triton(q, w, pk, P, K, chunk=13, q_offset=off, cfg=cfg, select="compact")
        res = {"name": name, "equal": bool(torch.equal(out, twin) and torch.equal(out_c, twin)),
               "equal_torch_select": bool(torch.equal(out_t, twin)),
               "dtype": str(out.dtype), "n_bad_rows": int((out != twin).any(-1).sum())}
        print("RESULT " + json.dumps(res), flush=True)

    # fresh float inputs: scores differ from the twin's in the last bits (summation order), so the
    # picks may differ only between pools whose scores tie to within rounding
    g = torch.Generator().manual_seed(7)
    B, S, H, D, P, K = 1, 48, 16, 64, 2, 5
    q = torch.randn(B, S, H, D, generator=g) * D**-0.5
    pk = torch.randn(B, S // P, D, generator=g)
    w = torch.randn(B, S, H, generator=g) * H**-0.5
    out = kpool_topk_triton(q, w, pk, P, K, chunk=11, cfg={"BLOCK_N": 16, "TILES": 2})
    twin = kpool_topk_torch(q, w, pk, P, K)
    score = torch.einsum("bsh,bshn->bsn", w.double(), torch.einsum("bshd,bnd->bshn", q.double(), pk.double()).relu())
    worst = 0.0
    for b, t in (out != twin).any(-1).nonzero().tolist():
        a, c = set(out[b, t].tolist()) - {-1}, set(twin[b, t].tolist()) - {-1}
        for p in a ^ c:  # every pool in one pick and not the other sits at the k-th score
            kth = score[b, t, list(c)].min()
            worst = max(worst, float((score[b, t, p] - kth).abs()))
    print("RESULT " + json.dumps({"name": "float_random", "equal": bool(torch.equal(out, twin)),
                                  "n_bad_rows": int((out != twin).any(-1).sum()), "worst_gap": worst}), flush=True)

    # the emit kernel on its own: integer scores (many ties), unselectable entries anywhere (rows with
    # none, few or all selectable), k from 1 to more than the row
    g = torch.Generator().manual_seed(11)
    sc = torch.randint(-3, 4, (2, 37, 150), generator=g).float()
    valid = torch.rand(2, 37, 150, generator=g) < torch.linspace(0, 1, 37)[None, :, None]
    sc = torch.where(valid, sc, float("-inf"))
    sc[:, ::3, ::5] = torch.where(valid[:, ::3, ::5], -0.0, float("-inf"))  # -0.0 ties with +0.0
    bad = [(k, m) for k in (1, 7, 64, 200) for m in ("rows", "topk")
           if not torch.equal(select_from_scores_triton(sc, k, block_n=32, method=m), select_from_scores(sc, valid, k))]
    # float scores: the row kernel's search runs its steps instead of hitting a count of k at once
    fl = torch.where(valid, torch.randn(2, 37, 150, generator=g) * 1e3, float("-inf"))
    bad += [(k, "rows-float") for k in (1, 7, 64) if not torch.equal(
        select_from_scores_triton(fl, k, method="rows"), select_from_scores(fl, valid, k))]
    print("RESULT " + json.dumps({"name": "emit_kernel", "equal": not bad, "bad": bad}), flush=True)

    _run_compact_cases()

    # the score kernel's scores against the twin's (fp32 in both; -inf exactly where not selectable),
    # with a query offset and a column count past the pools, then its picks on the same float inputs
    # through the emit kernel and through the twin's selection (the same scores: the same ids)
    off, n_cols = 5, S // P + 3
    got = kpool_scores_triton(q, w, pk, P, n_cols, q_offset=off, cfg={"BLOCK_N": 16, "TILES": 3})
    ref = torch.full_like(got, float("-inf"))
    sel = (torch.arange(n_cols) * P + P - 1)[None, :] <= (off + torch.arange(S))[:, None]
    sel &= torch.arange(n_cols)[None, :] < S // P
    ref[:, :, : S // P] = kpool_scores_torch(q, w, pk)
    ref = torch.where(sel, ref, float("-inf"))
    fin = torch.isfinite(ref)
    rel = ((got[fin] - ref[fin]).abs().max() / ref[fin].abs().max()).item()
    out_t = kpool_topk_triton(q, w, pk, P, K, chunk=11, cfg={"BLOCK_N": 16, "TILES": 2}, select="torch")
    print("RESULT " + json.dumps({"name": "scores", "same_mask": bool(torch.equal(torch.isfinite(got), fin)),
                                  "max_rel": rel, "picks_equal_torch_select": bool(torch.equal(out_t, out)),
                                  "n_bad_rows": int((out_t != out).any(-1).sum())}), flush=True)


@pytest.fixture(scope="module")
def interp_results():
    from triton_interpreter import run_interpreted

    return run_interpreted(__file__)


# ------------------------------------------------------------------------------ Triton (interpreter)
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_triton_path_matches_twin_exactly(interp_results, case):
    """kpool_topk_triton (the score kernel, then the emit kernel or the twin's selection) == the twin,
    ties included."""
    pytest.importorskip("triton")
    r = interp_results[case]
    assert r["equal"] and r["equal_torch_select"], r
    assert r["dtype"] == "torch.int32", r


def test_emit_kernel_matches_select_from_scores(interp_results):
    """select_from_scores_triton, both its one-kernel row select and its torch.topk + emit path, == the
    twin's select_from_scores on tied scores (-0.0 and +0.0 among them) with -inf anywhere."""
    pytest.importorskip("triton")
    assert interp_results["emit_kernel"]["equal"], interp_results["emit_kernel"]


def test_compact_select_matches_twin(interp_results):
    """select_from_scores_triton's "compact" method == the twin's select_from_scores on tied, float, rising
    (the best pools in the last groups), falling and all-equal rows, with its group maxima given or not and
    with coarser groups; the score kernel's group maxima equal its scores'; kpool_topk_triton with it ==
    the twin."""
    pytest.importorskip("triton")
    r = interp_results["compact"]
    assert not r["bad"], r
    assert r["coarse_group"] == 64, r  # 1,500 scores: 94 groups of 16 > 32, so 4 x 16
    assert r["gm_equal"] and r["gm_shape"] == [1, 400, 26], r
    assert r["equal"], r


def test_scores_and_float_picks(interp_results):
    """The score kernel's scores are the twin's to fp32 rounding with -inf exactly on the unselectable
    pools; on float inputs the emit kernel picks what the twin's selection picks from the same scores."""
    r = interp_results["scores"]
    assert r["same_mask"] and r["max_rel"] < 1e-5, r
    assert r["picks_equal_torch_select"], r


def test_triton_path_float_inputs(interp_results):
    """On float inputs the Triton path and the twin differ only between pools within fp32 rounding of the
    k-th score."""
    r = interp_results["float_random"]
    assert r["worst_gap"] < 1e-5, r


def test_layer_triton_backend_matches_torch(interp_results):
    """KPoolIndexer.select with kernels.indexer triton (the Triton path) == torch, chunked and not."""
    r = interp_results["layer_full"]
    assert r["gap"] > 1e-4, r  # the random setup has no (near-)tie at any k-th score
    assert r["impl"] == "indexer:triton-two-phase", r
    assert r["equal"], r


def test_layer_triton_backend_matches_torch_decoding(interp_results):
    """The same with an IndexerCache: query offsets p0 > 0, one-token and multi-token steps."""
    r = interp_results["layer_cache"]
    assert r["gap"] > 1e-4, r
    assert r["impls"] == ["indexer:torch-chunked", "indexer:triton-two-phase"], r
    assert r["cache_len"] == 83, r
    assert r["equal"], r
    assert r["full_equal_last"], r


def test_gpu_structure_check_accepts_the_twin_and_rejects_broken_layouts():
    """The layout checker of the GPU rounding tests, run on the torch twin's output (must pass) and
    on three corruptions of it (must each fail)."""
    from test_indexer_gpu import check_structure

    from longctx.ops.indexer import kpool_topk_torch

    S, H, D, P, K = 300, 4, 16, 4, 32
    g = torch.Generator().manual_seed(0)
    q, pk, w = torch.randn(1, S, H, D, generator=g), torch.randn(1, S // P, D, generator=g), torch.randn(1, S, H, generator=g)
    out = kpool_topk_torch(q, w, pk, P, K, chunk=64)
    check_structure(out, P, K)
    swapped = out.clone()
    swapped[0, -1, [0, 1]] = swapped[0, -1, [1, 0]]
    hole = out.clone()
    hole[0, -1, 3] = -1
    early = out.clone()
    early[0, 40, :] = torch.roll(early[0, 40, :], 1)  # row 40 has 10 picks: a -1 moves to the front
    for bad, msg in ((swapped, "ascending"), (hole, "number of picks"), (early, "-1 before")):
        with pytest.raises(AssertionError, match=msg):
            check_structure(bad, P, K)


def _as_if_on_cuda(monkeypatch):
    """The layer's picks as on CUDA with the Triton path importable (the real rule, its plain switch kept)."""
    from longctx import ops
    from longctx.layers import kpool_indexer as ki

    monkeypatch.setattr(ki, "_pick", lambda op, impl, impls, cuda, why_not, plain=False, warn=True:
                        ops.pick(op, impl, impls, True, lambda: None, plain, warn))


def test_unchunked_switch_runs_torch_under_auto_even_where_the_kernel_would_run(monkeypatch):
    """The memory plan's chunked-indexer switch off (chunk None) is the plain baseline: under auto it
    runs the unchunked torch scoring also where auto picks the kernel (CUDA), so the ablation measures
    what it says. Chunked, the same layer goes to the kernel."""
    ind, x, ql = layer_problem(1, 30, 2, 8, 8, 4, seed=0)
    ref = ind.select(x, ql, chunk=None)
    _as_if_on_cuda(monkeypatch)

    class KernelCalled(Exception):
        pass

    def kernel(*a, **k):
        raise KernelCalled

    monkeypatch.setattr(ind, "_kernel_pools", kernel)
    ind.chunk = None
    assert torch.equal(ind.select(x, ql), ref) and ind.last_impl == "indexer:torch-unchunked"
    ind.chunk = 8
    with pytest.raises(KernelCalled):
        ind.select(x, ql)


def test_layer_backend_switch(monkeypatch):
    """auto on the CPU is torch; triton on the CPU without the interpreter and unknown names are
    ConfigErrors naming kernels.indexer; with the Triton path not importable, triton refuses, auto on
    CUDA warns once and runs torch, auto on the CPU is silent."""
    import warnings

    from longctx.errors import ConfigError
    from longctx.layers import kpool_indexer as ki

    ind, x, ql = layer_problem(1, 30, 2, 8, 8, 4, seed=0)
    assert ind.kernels["indexer"] == "auto"
    ref = ind.select(x, ql)
    assert ind.last_impl == "indexer:torch-chunked"
    assert torch.equal(ind.select(x, ql, chunk=None), ref) and ind.last_impl == "indexer:torch-unchunked"
    ind.kernels["indexer"] = "torch"
    assert torch.equal(ind.select(x, ql), ref) and ind.last_impl == "indexer:torch-chunked"
    ind.kernels["indexer"] = "cuda"
    with pytest.raises(ConfigError, match="kernels.indexer must be one of auto, torch, triton"):
        ind.select(x, ql)
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        ind.kernels["indexer"], ind.last_impl = "triton", None
        with pytest.raises(ConfigError, match="kernels.indexer = 'triton' cannot run here .*CUDA"):
            ind.select(x, ql)
        assert ind.last_impl is None
    monkeypatch.setattr(ki.indexer_ops, "unavailable", lambda device, cfg=None: "triton does not import: ImportError")
    monkeypatch.setattr(errors, "_FALLBACKS_SAID", set())
    ind.kernels["indexer"] = "triton"
    with pytest.raises(ConfigError, match="does not import"):
        ind.pick(torch.device("cuda"))
    ind.kernels["indexer"] = "auto"
    with pytest.warns(RuntimeWarning, match="kernels.indexer auto runs the plain-torch twin on CUDA .*does not import"):
        assert ind.pick(torch.device("cuda")) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ind.pick(torch.device("cuda")) == "torch"
        assert ind.pick(torch.device("cpu")) == "torch"


def test_kernel_rejects_unsupported():
    pytest.importorskip("triton")
    from longctx.ops.indexer.triton import kpool_topk_triton

    q, w, pk = torch.zeros(1, 8, 2, 16), torch.zeros(1, 8, 2), torch.zeros(1, 4, 16)
    bad = [
        (torch.zeros(1, 8, 2, 512), w, torch.zeros(1, 4, 512), "D=512"),
        (torch.zeros(1, 8, 129, 16), torch.zeros(1, 8, 129), pk, "H=129"),
        (q.double(), w, pk.double(), "float64"),
        (q, w, pk.half(), "mixed dtypes"),
        (q, w[:, :7], pk, "w shape"),
        (q, w, torch.zeros(1, 4, 8), "pk width"),
    ]
    for qq, ww, pp, what in bad:
        with pytest.raises(ValueError, match="kpool_topk_triton"):
            kpool_topk_triton(qq, ww, pp, 2, 3)
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        with pytest.raises(ValueError, match="needs CUDA"):
            kpool_topk_triton(q, w, pk, 2, 3)


# ------------------------------------------------------------------------------ torch twin (in-process)
@pytest.mark.parametrize("seed", range(4))
def test_twin_matches_slow_reference(seed):
    g = torch.Generator().manual_seed(seed)
    B, S, H, D = 2, int(torch.randint(1, 40, (1,), generator=g)), 3, 8
    P = [1, 2, 4, 3][seed]
    NP = S // P + seed  # a few pools no query can see yet (a decode cache holds such)
    K = [1, 5, 12, 40][seed]
    off = [0, 0, 5, 9][seed]
    q, w, pk = int_problem(B, S, H, D, NP, lo=1 + seed % 2, seed=seed)
    ref = ref_select(q, w, pk, P, K, off)
    for chunk in (None, 1, 6):
        assert torch.equal(kpool_topk_torch(q, w, pk, P, K, chunk=chunk, q_offset=off), ref), chunk


def test_twin_edges():
    q, w, pk = int_problem(1, 6, 2, 4, 3, lo=1, seed=0)
    assert torch.equal(kpool_topk_torch(q, w, pk, 2, 0), torch.zeros(1, 6, 0, dtype=torch.int32))
    empty = kpool_topk_torch(q, w, pk[:, :0], 2, 3)
    assert empty.shape == (1, 6, 3) and bool((empty == -1).all())
    with pytest.raises(ValueError, match="kpool_topk_torch"):
        kpool_topk_torch(q, w[..., :1], pk, 2, 3)


def test_twin_reproduces_kpool_indexer_selection():
    """The wiring for KPoolIndexer: pooled keys, q unscaled, w with both factors H^-1/2 * D^-1/2
    (D^-1/2 a power of two here, so the scores are bit-identical to pool_scores'); expanding the
    pools into tokens plus the tail gives the layer's own output. The layer breaks exact ties its own way
    (torch.topk), so the setup (16 heads: a score is exactly 0 only if all 16 ReLUs are) is
    checked to have none at any query's k-th score."""
    from longctx.config import preset
    from longctx.layers.kpool_indexer import KPoolIndexer

    cfg = preset("tiny").replace(index_heads=16, index_head_dim=16, index_topk=16, index_pool=4)
    torch.manual_seed(0)
    ind = KPoolIndexer(cfg, 0)
    with torch.no_grad():
        for p in ind.parameters():
            p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]))
    B, S, P, H, D = 2, 37, 4, 16, 16
    x, ql = torch.randn(B, S, cfg.hidden_size), torch.randn(B, S, cfg.q_lora_rank)
    expected = ind.select(x, ql, chunk=None)
    with torch.no_grad():
        k, gate = ind.key_rows(x)
        n = S // P * P
        pk = ind.pool_keys(k[:, :n], gate[:, :n])
        q = ind.wq_b(ql).view(B, S, H, D)
        w = ind.weights_proj(x).float() * (H**-0.5 * D**-0.5)
    pools = kpool_topk_torch(q, w, pk, P, ind.topk // P, chunk=10)
    score = kpool_scores_torch(q, w, pk)
    for b, t in [(b, t) for b in range(B) for t in range(S) if (t + 1) // P > ind.topk // P]:
        row = score[b, t, : (t + 1) // P].sort(descending=True).values
        assert row[ind.topk // P - 1] != row[ind.topk // P], "setup has a tie at the k-th score"
    # the layer's expansion: pools -> P tokens each, then the tail of the query's own pool
    t = torch.arange(S)
    tok = torch.where(pools[..., None] >= 0, pools[..., None] * P + torch.arange(P), -1).flatten(-2)
    n_valid = (pools >= 0).sum(-1)
    cnt = (t + 1) % P
    j = torch.arange(P - 1)
    tail = torch.where(j < cnt[:, None], (t + 1 - cnt)[:, None] + j, -1).expand(B, S, P - 1)
    got = torch.full((B, S, ind.width), -1, dtype=torch.int64)
    got[..., : tok.shape[-1]] = tok
    got.scatter_(-1, n_valid[..., None] * P + j, tail)
    assert torch.equal(got.to(torch.int32), expected)


if __name__ == "__main__":
    _run_cases()


def test_indexer_benchmark_cpu_smoke(tmp_path):
    """bench/indexer.py --cpu-smoke --probe (the Triton path interpreted, its probe): every code path the H200
    run takes, at tiny sizes; a fresh process, since the interpreter must be on before triton loads."""
    pytest.importorskip("triton")
    import subprocess

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "bench" / "indexer.py"), "--cpu-smoke", "--probe", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "indexer_cpu_smoke.json").read_text())
    assert [c["S"] for c in res["cases"]] == [48, 101] and all("ms" in c["two_phase"] for c in res["cases"])
    assert all(c["two_phase"]["check_vs_chunked"]["worst_rel_gap"] < 1e-5 for c in res["cases"])
    probe = res["two_phase_probe"]
    assert [p["S"] for p in probe] == [48, 101]
    assert all(p["topk_ms"] > 0 and p["score_mm_ms"] > 0 for p in probe)
