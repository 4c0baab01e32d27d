"""Union mode of DSA sparse attention (`longctx/ops/sparse_attention/union.py`): the union's construction
against a brute-force count, the union torch twin against the reference in fp64, the cost model's choice,
and the Triton union kernels under TRITON_INTERPRET=1 against the twin (in a subprocess, as
test_sparse_attention.py does, since the interpreter must be on before triton is first imported)."""

from __future__ import annotations

import collections
import json

import pytest
import torch

from longctx.ops.sparse_attention import union as un
from longctx.ops.sparse_attention.naive import sparse_attention_bwd_torch, sparse_attention_torch
from test_sparse_attention import _rel


def _expected(idx, G, S_kv, b, n):
    """Multiset of (row, occurrence, query-in-group) of group n: what the union must hold."""
    want = collections.Counter()
    for g in range(G):
        t = n * G + g
        if t >= idx.shape[1]:
            continue
        for r, m in collections.Counter(int(v) for v in idx[b, t] if 0 <= v < S_kv).items():
            for o in range(m):
                want[(r, o, g)] += 1
    return want


def _decoded(u, b, n):
    got, occ, rows = collections.Counter(), collections.Counter(), []
    L = int(u.length[b, n])
    p = u.packed[b, n].tolist()
    assert all(v == -1 for v in p[L:]), "padding after the group's length must be -1"
    for v in p[:L]:
        assert v >= 0, "no unused slot inside a group's length"
        r, bits = v >> un.ROW_SHIFT, v & 255
        assert bits and bits >> u.G == 0, "every slot has a member, and only the group's queries"
        rows.append(r)
        for g in range(u.G):
            if bits >> g & 1:
                got[(r, occ[(r, g)], g)] += 1
                occ[(r, g)] += 1
    assert rows == sorted(rows), "slots in ascending row order"
    return got


@pytest.mark.parametrize("G", [1, 2, 4, 8])
def test_build_union_membership(G):
    """Every (query, row) pair of the group, each repeat of a row once more, nothing else; -1 and indices
    outside [0, S_kv) are unused; the last group is partial; building in pieces gives the same union."""
    g = torch.Generator().manual_seed(G)
    B, S, K, S_kv = 2, 13, 9, 12
    idx = torch.randint(-1, S_kv + 2, (B, S, K), generator=g, dtype=torch.int32)
    idx[0, 3] = -1  # a query that selects nothing
    idx[1, 4, :4] = 5  # a row repeated four times by one query
    idx[1, 5, :2] = 5  # ... and twice by its neighbour
    u = un.build_union(idx, G, S_kv)
    assert u.packed.shape[:2] == (B, -(-S // G)) and u.packed.dtype == torch.int32
    for b in range(B):
        for n in range(u.groups):
            assert _decoded(u, b, n) == _expected(idx, G, S_kv, b, n), (G, b, n)
    assert int(u.length.max()) == u.packed.shape[2]
    pieces = un.build_union(idx, G, S_kv, max_elements=2 * G * K)
    assert torch.equal(pieces.packed, u.packed) and torch.equal(pieces.length, u.length)


def test_build_union_overlap_and_sizes():
    """Neighbours that select the same rows share slots: U/k = 1 for identical lists, G for disjoint ones."""
    S, K = 16, 8
    same = torch.arange(K, dtype=torch.int32).expand(1, S, K).contiguous()
    disjoint = (torch.arange(S)[:, None] * K + torch.arange(K)).to(torch.int32)[None]
    r_same = un.union_sizes(same, 1000)
    r_dis = un.union_sizes(disjoint, 1000)
    for G in (2, 4, 8):
        assert r_same[G] == pytest.approx(1.0) and r_dis[G] == pytest.approx(G)
    u = un.build_union(same, 4, 1000)
    assert u.packed.shape == (1, 4, K) and bool((u.packed & 255 == 15).all())


def _ascending_selections(B, S, K, S_kv, seed):
    """Selections in the indexer's form (each query's in-range rows strictly ascending) that exercise the
    merge build: neighbours drawing from one shared set (overlapping groups), a query equal to its
    neighbour, one disjoint from the rest, one that selects nothing, one with all K slots used, rows 0 and
    S_kv - 1; the unused slots -1 at the end, or -1 and rows outside [0, S_kv) between the used ones."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((B, S, K), -1, dtype=torch.int32)
    for b in range(B):
        shared = torch.randperm(S_kv - 4, generator=g)[: 2 * K] + 2  # rows 2 .. S_kv - 3
        for t in range(S):
            pick = shared[torch.rand(len(shared), generator=g) < 0.4]
            if t == 1:
                pick = torch.cat([pick, torch.tensor([0, S_kv - 1])])
            if t == 5:
                pick = torch.tensor([0, 1, S_kv - 2])  # rows no other query holds
            rows = pick.unique()[:K].to(torch.int32)  # sorted, distinct
            if t == 3:
                rows = rows[:0]
            if t == 7:
                rows = idx[b, 6][idx[b, 6] >= 0]
            if t == 9:
                rows = torch.arange(S_kv - K, S_kv, dtype=torch.int32)
            n = len(rows)
            if t % 2 == 0 and n < K:  # unused slots between the used ones, some of them out of range
                slots = torch.randperm(K, generator=g)[:n].sort().values
                junk = torch.where(torch.rand(K, generator=g) < 0.3, S_kv + torch.arange(K, dtype=torch.int32), -1)
                idx[b, t] = junk.to(torch.int32)
                idx[b, t, slots] = rows
            else:
                idx[b, t, :n] = rows
    return idx


def _same_union(a, b):
    return a.G == b.G and a.S == b.S and a.packed.shape == b.packed.shape and torch.equal(a.packed, b.packed) \
        and torch.equal(a.length, b.length) and a.packed.dtype == b.packed.dtype and a.length.dtype == b.length.dtype


@pytest.mark.parametrize("G", [1, 2, 3, 4, 8])
def test_merge_build_equals_sort_on_ascending_selections(G):
    """The merge build (each query's ascending list merged, not sorted) gives the sort build's Union exactly,
    on ascending selections with -1 padding at the end or in between, out-of-range rows, overlapping,
    equal and disjoint neighbours, an empty query and a partial last group; in pieces too; and both are
    the brute-force union."""
    B, S, K, S_kv = 2, 13, 16, 40
    idx = _ascending_selections(B, S, K, S_kv, seed=G)
    sort = un.build_union(idx, G, S_kv, method="sort")
    merge = un.build_union(idx, G, S_kv, method="merge")  # raises if the check wrongly refused the input
    assert _same_union(merge, sort), G
    assert _same_union(un.build_union(idx, G, S_kv), sort)
    assert _same_union(un.build_union(idx.long(), G, S_kv, method="merge"), sort)
    assert _same_union(un.build_union(idx, G, S_kv, method="merge", max_elements=3 * G * K), sort)
    for b in range(B):
        for n in range(merge.groups):
            assert _decoded(merge, b, n) == _expected(idx, G, S_kv, b, n), (G, b, n)


def test_merge_build_on_indexer_and_trained_like_selections():
    """On what sparse attention is given: the k-pool indexer's selection (ascending, -1 at the end, the
    query's tail pool last), its compact/expand round trip, and persistent_pool_indices (-1 between
    pools): the merge build takes them all and equals the sort build."""
    from longctx.config import preset
    from longctx.layers.kpool_indexer import KPoolIndexer
    from longctx.ops.sparse_attention.naive import persistent_pool_indices

    cfg = preset("tiny").replace(index_topk=32, index_pool=4, index_tail=True)
    torch.manual_seed(0)
    ind = KPoolIndexer(cfg, 0)
    with torch.no_grad():
        for p in ind.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    S = 203
    sel = ind.select(torch.randn(2, S, cfg.hidden_size), torch.randn(2, S, cfg.q_lora_rank))
    sels = {"indexer": sel, "expanded": ind.expand(ind.compact(sel), 0),
            "persistent": persistent_pool_indices(300, 131, 0.2, device="cpu",
                                                  generator=torch.Generator().manual_seed(1))[None]}
    for name, idx in sels.items():
        for G in (2, 4, 8):
            sort = un.build_union(idx, G, idx.shape[1], method="sort")
            assert _same_union(un.build_union(idx, G, idx.shape[1], method="merge"), sort), (name, G)


def test_build_union_sorts_what_the_merge_cannot():
    """A query that repeats a row, or lists rows out of order, fails the merge build's check: "auto" then
    builds by the sort (the same Union as method="sort"), "merge" refuses; a single such query in the
    last piece of a build in pieces is enough."""
    B, S, K, S_kv = 2, 13, 16, 40
    base = _ascending_selections(B, S, K, S_kv, seed=11)
    repeat, unsorted, late = base.clone(), base.clone(), base.clone()
    repeat[0, 4, 1] = repeat[0, 4, 0] = 17
    unsorted[1, 2, :3] = torch.tensor([9, 3, 30], dtype=torch.int32)
    late[1, 12, -2:] = torch.tensor([8, 8], dtype=torch.int32)
    for idx in (repeat, unsorted, late):
        for G in (1, 4):
            grouped = un._grouped(idx, G).reshape(-1, G, K)
            assert un._union_by_merge(grouped, G, S_kv, 2 * G * K) is None
            assert _same_union(un.build_union(idx, G, S_kv, max_elements=2 * G * K),
                               un.build_union(idx, G, S_kv, method="sort"))
            with pytest.raises(ValueError, match="strictly ascending"):
                un.build_union(idx, G, S_kv, method="merge")
    assert un._union_by_merge(un._grouped(base, 4).reshape(-1, 4, K), 4, S_kv, 2 * 4 * K) is not None


def test_cost_model_choice():
    """The model's numbers (module docstring): at 16 heads G = 4 is chosen while U_4/k < 1.61, G = 2 while
    U_2/k < 1.26 (and G = 4 is worse); random-init overlap keeps G = 1; 64 heads always 1."""
    t1 = un.predicted_ns_per_query(1, 16, 1.0)
    assert t1 == pytest.approx(2051 * (0.267 + 1.330))
    assert un.predicted_ns_per_query(4, 16, 1.0) == pytest.approx(2051 * ((0.690 + 2.505) / 4 + un.COST_BUILD))
    assert un.choose_group(16, {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.6}) == 4
    assert un.choose_group(16, {1: 1.0, 2: 1.9, 4: 3.5, 8: 6.5}) == 1
    assert un.choose_group(16, {1: 1.0, 2: 1.2, 4: 2.5, 8: 4.0}) == 2
    assert un.choose_group(16, {1: 1.0, 2: 1.3, 4: 2.5, 8: 4.0}) == 1
    assert un.choose_group(64, {1: 1.0, 2: 1.0, 4: 1.0}) == 1
    idx = torch.arange(8, dtype=torch.int32).expand(1, 64, 8).contiguous()
    assert un.resolve_group(idx, 16, 100, group="auto") == 4  # identical neighbours: U_G = k
    assert un.resolve_group(idx, 64, 100, group="auto") == 1
    assert un.resolve_group(idx, 16, 100, group=2) == 2
    assert un.resolve_group(idx, 16, 100, group="1") == 1
    with pytest.raises(ValueError, match="group"):
        un.resolve_group(idx, 16, 100, group=3)


def test_env_forces_group(monkeypatch):
    idx = torch.arange(8, dtype=torch.int32).expand(1, 64, 8).contiguous()
    monkeypatch.delenv(un.ENV, raising=False)
    # opt-in: its measured gain does not pay for auto's sync (docs/design/sparse_attention.md)
    assert un.resolve_group(idx, 16, 100) == 1
    monkeypatch.setenv(un.ENV, "1")
    assert un.resolve_group(idx, 16, 100) == 1
    monkeypatch.setenv(un.ENV, "auto")
    assert un.resolve_group(idx, 16, 100) == 4


@pytest.mark.parametrize("G", [1, 2, 4, 8])
def test_union_twin_matches_reference_fp64(G):
    """The union formulation (rows of the union, non-members at -inf) is the reference's function: o, lse,
    dq, dkv in fp64, with repeats, -1 slots, a query with nothing selected and a partial last group."""
    g = torch.Generator().manual_seed(10 + G)
    B, S, H, D, K, S_kv = 2, 11, 3, 16, 9, 12
    q = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    kv = torch.randn(B, S_kv, D, generator=g, dtype=torch.float64)
    idx = torch.randint(-1, S_kv, (B, S, K), generator=g, dtype=torch.int32)
    idx[:, :, 0] = idx[:, :, 1]  # repeats
    idx[0, 2] = -1
    do = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    o_ref, lse_ref = sparse_attention_torch(q, kv, idx, 0.3, chunk=4, return_lse=True)
    dq_ref, dkv_ref = sparse_attention_bwd_torch(q, kv, idx, o_ref, lse_ref, do, 0.3, chunk=4)
    u = un.build_union(idx, G, S_kv)
    o, lse = un.union_attention_torch(q, kv, u, 0.3, chunk=2)
    dq, dkv = un.union_attention_bwd_torch(q, kv, u, o, lse, do, 0.3, chunk=2)
    fin = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), fin) and bool((lse[~fin] == float("-inf")).all())
    for a, b in ((o, o_ref), (lse[fin], lse_ref[fin]), (dq, dq_ref), (dkv, dkv_ref)):
        assert (a - b).abs().max().item() < 1e-12
    assert o[0, 2].abs().max().item() == 0.0 and dq[0, 2].abs().max().item() == 0.0


# ------------------------------------------------------------------------- Triton kernels, interpreted
# (name, B, S, S_kv, H, D, K, G, p_unused)
CASES = [
    ("g2_h2_k13", 2, 9, 11, 2, 32, 13, 2, 0.3),  # two sequences, partial last group, M = 4 padded to 16
    ("g4_h4_k21", 1, 10, 14, 4, 32, 21, 4, 0.3),  # K over one slot tile
    ("g8_h2_d48", 1, 11, 9, 2, 48, 7, 8, 0.2),  # D not a power of two
    ("g4_h5_k9", 1, 7, 9, 5, 32, 9, 4, 0.2),  # heads that split across queries within a tile
    ("g2_h40_k9", 1, 5, 9, 40, 32, 9, 2, 0.2),  # 80 rows: two programs per group
    ("g4_h16_d256", 1, 4, 9, 16, 256, 11, 4, 0.2),  # 64 rows: the 8-warp look-ahead forward
]
KEPT = ("g4_h4_k21",)


def _run_cases() -> None:
    """Subprocess body (TRITON_INTERPRET=1 is set)."""
    from longctx.ops.sparse_attention.triton import (
        kept_sparse_attention_triton,
        sparse_attention_fwd,
        sparse_attention_triton,
        union_attention_bwd,
        union_attention_fwd,
    )

    gen = torch.Generator().manual_seed(4321)
    for name, B, S, S_kv, H, D, K, G, p_unused in CASES:
        q = torch.randn(B, S, H, D + 16, generator=gen)[..., :D]  # strided heads
        kv = torch.randn(B, S_kv, D, generator=gen)
        idx = torch.randint(0, S_kv, (B, S, K), generator=gen, dtype=torch.int32)
        idx[torch.rand(B, S, K, generator=gen) < p_unused] = -1
        idx[:, :, 1] = idx[:, :, 2]  # repeats add up
        idx[0, 1] = -1  # nothing selected
        do = torch.randn(B, S, H, D, generator=gen)
        scale = D**-0.5
        u = un.build_union(idx, G, S_kv)
        o, lse = union_attention_fwd(q, kv, u, scale)
        dq, dkv = union_attention_bwd(q, kv, u, o, lse, do, scale)
        o_t, lse_t = un.union_attention_torch(q, kv, u, scale)
        dq_t, dkv_t = un.union_attention_bwd_torch(q, kv, u, o_t, lse_t, do, scale)
        o_1, lse_1 = sparse_attention_fwd(q, kv, idx, scale, group=1)  # today's kernel
        fin = torch.isfinite(lse_t)
        res = {"name": name, "o": _rel(o, o_t), "lse": _rel(lse[fin], lse_t[fin]), "dq": _rel(dq, dq_t),
               "dkv": _rel(dkv, dkv_t), "lse_inf_match": bool(torch.equal(torch.isinf(lse), ~fin)),
               "empty_zero": float(o[0, 1].abs().max() + dq[0, 1].abs().max()), "o_vs_g1": _rel(o, o_1),
               "lse_vs_g1": _rel(lse[fin], lse_1[fin])}
        # through autograd with the group forced, and chosen by the model
        qr, kr = q.detach().clone().requires_grad_(True), kv.detach().clone().requires_grad_(True)
        o_a = sparse_attention_triton(qr, kr, idx, scale, group=G)
        dq_a, dkv_a = torch.autograd.grad(o_a, (qr, kr), do)
        res["autograd"] = max(_rel(o_a, o_t), _rel(dq_a, dq_t), _rel(dkv_a, dkv_t))
        o_m = sparse_attention_triton(qr, kr, idx, scale)
        res["auto"] = max(_rel(o_m, o_t), *(_rel(a, b) for a, b in zip(torch.autograd.grad(o_m, (qr, kr), do),
                                                                           (dq_t, dkv_t))))
        if name in KEPT:
            o_k = kept_sparse_attention_triton(qr, kr, idx, o.detach(), lse, scale, group=G)
            dq_k, dkv_k = torch.autograd.grad(o_k, (qr, kr), do)
            res["kept"] = max(_rel(dq_k, dq_t), _rel(dkv_k, dkv_t))
        print("RESULT " + json.dumps(res), flush=True)


@pytest.fixture(scope="module")
def interp_results():
    pytest.importorskip("triton")
    from triton_interpreter import run_interpreted

    return run_interpreted(__file__)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_union_kernels_match_twin_fp32(interp_results, case):
    r = interp_results[case]
    assert max(r["o"], r["dq"], r["dkv"], r["autograd"], r["auto"]) < 1e-5, r
    assert r["lse"] < 1e-6 and r["lse_inf_match"] and r["empty_zero"] == 0.0, r
    assert r["o_vs_g1"] < 1e-5 and r["lse_vs_g1"] < 1e-6, r  # today's kernel, the same function
    if case in KEPT:
        assert r["kept"] < 1e-5, r


def test_union_rejects_a_union_of_other_queries():
    pytest.importorskip("triton")
    from longctx.ops.sparse_attention.triton import union_attention_fwd

    idx = torch.zeros(1, 8, 4, dtype=torch.int32)
    u = un.build_union(idx, 2, 8)
    with pytest.raises(ValueError, match="union_attention"):
        union_attention_fwd(torch.randn(1, 6, 2, 32), torch.randn(1, 8, 32), u, 0.1)


def test_bench_union_tiles_cpu_smoke(tmp_path):
    """bench/sparse_attention.py --union-tiles --cpu-smoke: every tile config of the union kernels (several
    programs a group among them) gives the per-query kernel's o, dq and dkv on both selections, in fp32 under
    the interpreter, and the benchmark records each with the tiles that ran."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, str(root / "bench" / "sparse_attention.py"), "--union-tiles", "--out", str(tmp_path)]
    r = subprocess.run([*cmd, "--cpu-smoke"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "sparse_attention_union_tiles_cpu_smoke.json").read_text())["union_tiles"]
    assert [w["workload"] for w in rows] == ["trained_like", "random"]
    for w in rows:
        assert w["ratio"] >= 1.0
        ran = [(t["which"], *(t["kernel"][c] for c in ("BLOCK_H", "BLOCK_N", "num_warps"))) for t in w["tiles"]]
        assert len(set(ran)) == len(ran) == 8, ran
        assert all(v < 1e-5 for t in w["tiles"] for v in t["rel_vs_per_query"].values()), w["tiles"]
    # without the interpreter the smoke is refused in one sentence
    r = subprocess.run([*cmd, "--cpu-smoke"], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "TRITON_INTERPRET=1" in r.stderr


if __name__ == "__main__":
    _run_cases()
