"""The fused k-pool indexer (score + top-k pools): torch twin vs a slow reference, Triton kernel vs the twin.

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

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from longctx.ops.indexer import kpool_scores_torch, kpool_topk_torch, select_pools


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


# (name, B, S, H, D, P, NP, K, q_offset, lo, dtype, cfg)
CASES = [
    # many ties, two blocks of queries, several pool tiles, 2-bit digits (more search passes)
    # pure radix select (no candidate buffer)
    ("ties_fp32", 2, 45, 3, 16, 2, 22, 7, 0, 1, "float32", {"BLOCK_M": 8, "BLOCK_N": 16, "RBITS": 2, "CAND": 0}),
    # the one-hot histogram variant, wider values, a 4-key candidate buffer (ranked ties, row sort)
    ("onehot_hist", 1, 40, 5, 24, 1, 40, 9, 0, 3, "float32",
     {"BLOCK_M": 8, "BLOCK_N": 16, "HIST_TL": False, "CAND": 4}),
    # bf16 inputs, decoding offset, pools beyond the causal range, production tile shape
    ("bf16_offset", 1, 30, 16, 32, 4, 20, 5, 13, 2, "bfloat16", {"BLOCK_N": 16}),
    # k_pools above the pool count: every row partly -1; P=4 and D=8 (padded to 16)
    ("k_over_np", 2, 21, 2, 8, 4, 5, 8, 0, 1, "float32", {"BLOCK_N": 16}),
    # all weights zero: every score is 0, so every query takes its lowest pool ids
    ("all_zero", 1, 40, 4, 16, 1, 40, 6, 0, 1, "float32", {"BLOCK_M": 8, "BLOCK_N": 16}),
]


def _run_cases() -> None:
    """Subprocess body: TRITON_INTERPRET=1 is already in the environment."""
    from longctx.ops.indexer.triton_kernel import LAST_LAUNCH, kpool_topk_triton

    for i, (name, B, S, H, D, P, NP, K, off, lo, dt, cfg) in enumerate(CASES):
        q, w, pk = int_problem(B, S, H, D, NP, lo, seed=100 + i, dtype=getattr(torch, dt))
        if name == "all_zero":
            w = torch.zeros_like(w)
            w[..., ::2] = -0.0  # zero scores whatever the heads' ReLUs: lowest pool ids win
        q = torch.cat([q, torch.zeros_like(q[..., :3])], -1)[..., :D]  # a strided view
        twin = kpool_topk_torch(q, w, pk, P, K, chunk=7, q_offset=off)
        out = kpool_topk_triton(q, w, pk, P, K, q_offset=off, cfg=cfg)
        res = {"name": name, "equal": bool(torch.equal(out, twin)), "dtype": str(out.dtype),
               "n_bad_rows": int((out != twin).any(-1).sum()), "passes_max": int(LAST_LAUNCH["passes"].max()),
               "deferred": int(LAST_LAUNCH["deferred"].sum())}
        print("RESULT " + json.dumps(res), flush=True)

    # fresh float inputs: scores differ from the twin's in the last bits (summation order), so the
    # picks may differ only between pools whose scores tie to within rounding
    g = torch.Generator().manual_seed(7)
    B, S, H, D, P, K = 1, 48, 16, 64, 2, 5
    q = torch.randn(B, S, H, D, generator=g) * D**-0.5
    pk = torch.randn(B, S // P, D, generator=g)
    w = torch.randn(B, S, H, generator=g) * H**-0.5
    out = kpool_topk_triton(q, w, pk, P, K, cfg={"BLOCK_N": 16})
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


@pytest.fixture(scope="module")
def interp_results():
    from triton_interpreter import run_interpreted

    return run_interpreted(__file__)


# ------------------------------------------------------------------------------ Triton (interpreter)
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_kernel_matches_twin_exactly(interp_results, case):
    pytest.importorskip("triton")
    r = interp_results[case]
    assert r["equal"], r
    assert r["dtype"] == "torch.int32", r
    assert r["passes_max"] <= 33, r


def test_kernel_paths_exercised(interp_results):
    """The cases reach the candidate buffer (deferred rows) and, without it, several search passes."""
    assert interp_results["onehot_hist"]["deferred"] > 0, interp_results["onehot_hist"]
    assert interp_results["bf16_offset"]["deferred"] > 0, interp_results["bf16_offset"]
    assert interp_results["ties_fp32"]["deferred"] == 0 and interp_results["ties_fp32"]["passes_max"] >= 3
    assert interp_results["k_over_np"]["passes_max"] == 0  # every row takes all it sees


def test_kernel_float_inputs(interp_results):
    r = interp_results["float_random"]
    assert r["worst_gap"] < 1e-5, r


def test_kernel_rejects_unsupported():
    pytest.importorskip("triton")
    from longctx.ops.indexer.triton_kernel import kpool_topk_triton

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
        with pytest.raises(ValueError, match="needs CUDA"):
            select_pools(q, w, pk, 2, 3, backend="triton")


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
    assert torch.equal(select_pools(q, w, pk, P, K, backend="torch", chunk=6, q_offset=off), ref)


def test_twin_edges():
    q, w, pk = int_problem(1, 6, 2, 4, 3, lo=1, seed=0)
    assert torch.equal(kpool_topk_torch(q, w, pk, 2, 0), torch.zeros(1, 6, 0, dtype=torch.int32))
    empty = kpool_topk_torch(q, w, pk[:, :0], 2, 3)
    assert empty.shape == (1, 6, 3) and bool((empty == -1).all())
    with pytest.raises(ValueError, match="backend"):
        select_pools(q, w, pk, 2, 3, backend="cuda")
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
    pools = select_pools(q, w, pk, P, ind.topk // P, backend="torch", chunk=10)
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
