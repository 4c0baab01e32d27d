"""The Triton DSA kernel against the torch twin, on the CPU through the Triton interpreter.

`TRITON_INTERPRET=1` must be set before triton is first imported, and other test modules import
triton earlier in the same pytest process, so the checks run in a fresh subprocess (this file run
as a script) that prints one JSON line per case; the pytest side asserts on those numbers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

# (name, B, S, S_kv, H, D, K, p_unused)
CASES = [
    ("h2_d32_k13", 2, 19, 19, 2, 32, 13, 0.3),  # K below one tile
    ("h16_d64_k13_kvlong", 1, 19, 23, 16, 64, 13, 0.3),  # H = MMA minimum, S_kv != S
    ("h5_d48_k70", 1, 11, 17, 5, 48, 70, 0.4),  # D not a power of two, K over several tiles, ragged
    ("h72_d32_k21", 1, 6, 9, 72, 32, 21, 0.2),  # two head groups, the second partial
    ("h64_d256_k45", 1, 4, 9, 64, 256, 45, 0.2),  # the 8-warp config: look-ahead forward loop
]


KEPT_CASES = ("h2_d32_k13", "h16_d64_k13_kvlong")


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _run_cases() -> None:
    """Subprocess body: TRITON_INTERPRET=1 is already in the environment."""
    import torch

    from longctx.ops.sparse_attention.naive import sparse_attention_bwd_torch, sparse_attention_torch
    from longctx.ops.sparse_attention.triton import (
        kept_sparse_attention_triton,
        sparse_attention_fwd,
        sparse_attention_triton,
    )

    g = torch.Generator().manual_seed(1234)
    for name, B, S, Skv, H, D, K, p_unused in CASES:
        # q as a strided view (last dim contiguous, head stride padded) to exercise the strides
        q = torch.randn(B, S, H, D + 16, generator=g)[..., :D].requires_grad_(True)
        kv = torch.randn(B, Skv, D, generator=g).requires_grad_(True)
        idx = torch.randint(0, Skv, (B, S, K), generator=g, dtype=torch.int32)
        idx[torch.rand(B, S, K, generator=g) < p_unused] = -1
        idx[0, 1] = -1  # a query that selects nothing: zero output, zero grads
        scale = D**-0.5
        do = torch.randn(B, S, H, D, generator=g)

        o = sparse_attention_triton(q, kv, idx, scale)
        dq, dkv = torch.autograd.grad(o, (q, kv), do)
        _, lse = sparse_attention_fwd(q.detach(), kv.detach(), idx, scale)

        o_ref, lse_ref = sparse_attention_torch(q, kv, idx, scale, chunk=7, return_lse=True)
        dq_ref, dkv_ref = torch.autograd.grad(o_ref, (q, kv), do)

        fin = torch.isfinite(lse_ref)
        res = {
            "name": name,
            "o": _rel(o, o_ref),
            "dq": _rel(dq, dq_ref),
            "dkv": _rel(dkv, dkv_ref),
            "lse": _rel(lse[fin], lse_ref[fin]),
            "lse_inf_match": bool(torch.equal(torch.isinf(lse), ~fin)),
            "empty_zero": float(o[0, 1].abs().max() + dq[0, 1].abs().max()),
        }
        if name in KEPT_CASES:  # memory.reuse_attention: the backward from a kept (o, lse), and its torch twin
            o_k = kept_sparse_attention_triton(q, kv, idx, o.detach(), lse, scale)
            dq_k, dkv_k = torch.autograd.grad(o_k, (q, kv), do)
            res["kept_equal"] = bool(torch.equal(o_k, o) and torch.equal(dq_k, dq) and torch.equal(dkv_k, dkv))
            tq, tkv = sparse_attention_bwd_torch(q.detach(), kv.detach(), idx, o.detach(), lse, do, scale, chunk=5)
            res["twin_dq"], res["twin_dkv"] = _rel(tq, dq), _rel(tkv, dkv)
        print("RESULT " + json.dumps(res), flush=True)
    _run_head_major_past_int32()


def _run_head_major_past_int32() -> None:
    """q and dO head-major with (H - 1) x head stride past 2^31 elements, as torch's einsum hands the DSA layer
    its absorbed queries ([B, S, H, D] with head stride S x D) at 512k tokens: the kernel's head offsets must be
    int64 (with int32 offsets this case reads out of bounds, as the 512k step's backward on the GPU would). The
    views' storage is lazily committed (one torch.empty of 8.6 GB virtual, ~100 rows touched)."""
    import torch

    from longctx.ops.sparse_attention.naive import sparse_attention_torch
    from longctx.ops.sparse_attention.triton import sparse_attention_triton

    H, D, S, K = 16, 32, 3, 5
    hs = ((2**31) // (H - 1) + 127) // 64 * 64
    g = torch.Generator().manual_seed(7)
    try:  # one buffer for both views: q's rows at the start of each head's span, dO's after them
        base = torch.empty(H * hs, dtype=torch.float32)
    except RuntimeError as e:  # a machine that will not reserve 8.6 GB of address space
        print("RESULT " + json.dumps({"name": "head_major_past_int32", "skipped": f"{e}"[:200]}), flush=True)
        return
    q = base.as_strided((1, S, H, D), (0, D, hs, 1))
    do = base.as_strided((1, S, H, D), (0, D, hs, 1), S * D)
    q.copy_(torch.randn(1, S, H, D, generator=g))
    do.copy_(torch.randn(1, S, H, D, generator=g))
    q.requires_grad_(True)
    kv = torch.randn(1, S, D, generator=g).requires_grad_(True)
    idx = torch.randint(0, S, (1, S, K), generator=g, dtype=torch.int32)
    o = sparse_attention_triton(q, kv, idx, D**-0.5)
    dq, dkv = torch.autograd.grad(o, (q, kv), do)
    qr, kr = q.detach().contiguous().requires_grad_(True), kv.detach().clone().requires_grad_(True)
    o_ref = sparse_attention_torch(qr, kr, idx, D**-0.5)
    dq_ref, dkv_ref = torch.autograd.grad(o_ref, (qr, kr), do.contiguous())
    print("RESULT " + json.dumps({"name": "head_major_past_int32", "head_offset": (H - 1) * hs, "o": _rel(o, o_ref),
                                  "dq": _rel(dq, dq_ref), "dkv": _rel(dkv, dkv_ref)}), flush=True)


@pytest.fixture(scope="module")
def interp_results():
    from triton_interpreter import run_interpreted

    return run_interpreted(__file__)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_matches_torch_twin_fp32(interp_results, case):
    r = interp_results[case]
    assert r["o"] < 1e-4, r
    assert r["dq"] < 1e-4, r
    assert r["dkv"] < 1e-4, r
    assert r["lse"] < 1e-5, r
    assert r["lse_inf_match"], r
    assert r["empty_zero"] == 0.0, r
    if case in KEPT_CASES:
        assert r["kept_equal"] and r["twin_dq"] < 1e-4 and r["twin_dkv"] < 1e-4, r


def test_head_major_queries_past_int32(interp_results):
    r = interp_results["head_major_past_int32"]
    if "skipped" in r:
        pytest.skip(f"could not allocate the 8.6 GB (virtual) buffer: {r['skipped']}")
    assert r["head_offset"] > 2**31 and max(r["o"], r["dq"], r["dkv"]) < 1e-4, r


def test_rejects_unsupported_shapes():
    import torch

    from longctx.ops.sparse_attention.triton import sparse_attention_triton

    kv = torch.randn(1, 8, 32)
    idx = torch.zeros(1, 8, 4, dtype=torch.int32)
    bad = [
        (torch.randn(1, 8, 2, 24), torch.randn(1, 8, 24), idx, "D=24"),  # D not a multiple of 16
        (torch.randn(1, 8, 129, 32), kv, idx, "H=129"),
        (torch.randn(1, 8, 2, 1024), torch.randn(1, 8, 1024), idx, "D=1024"),
        (torch.randn(1, 8, 2, 32, dtype=torch.float64), kv.double(), idx, "float64"),
        (torch.randn(1, 8, 2, 32), kv.half(), idx, "float16"),
        (torch.randn(1, 8, 2, 32), kv, idx.float(), "idx dtype"),
        (torch.randn(1, 7, 2, 32), kv, idx, "shapes disagree"),
    ]
    for q, k, i, what in bad:
        with pytest.raises(ValueError, match="sparse_attention_triton"):
            sparse_attention_triton(q, k, i, 0.1)
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        with pytest.raises(ValueError, match="needs CUDA"):
            sparse_attention_triton(torch.randn(1, 8, 2, 32), kv, idx, 0.1)


def test_backward_rejects_mismatched_saved_tensors():
    """The backward (the kept-output path hands it o and lse from an earlier forward) raises, naming the shapes,
    where o, dO or lse do not belong to q, instead of launching a kernel that would read outside them."""
    import torch

    from longctx.ops.sparse_attention.triton import sparse_attention_bwd

    B, S, H, D = 1, 8, 2, 32
    q, kv, idx = torch.randn(B, S, H, D), torch.randn(B, S, D), torch.zeros(B, S, 4, dtype=torch.int32)
    o, do, lse = torch.randn(B, S, H, D), torch.randn(B, S, H, D), torch.zeros(B, S, H)
    for args in ((o[:, :4], lse, do), (o, lse[:, :4], do), (o, lse, do[..., :16]), (o, lse.double(), do),
                 (o, lse.transpose(1, 2).contiguous().transpose(1, 2), do)):
        with pytest.raises(ValueError, match="sparse_attention_bwd"):
            sparse_attention_bwd(q, kv, idx, args[0], args[1], args[2], 0.1)


def test_bench_sparse_atomics_cpu_smoke(tmp_path):
    """bench/sparse_atomics.py's probe under the interpreter: its compute role runs the backward's products (the
    same dq) and its atomics role adds to the rows the backward adds to, so its timings split the real kernel."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, str(root / "bench" / "sparse_atomics.py"), "--cpu-smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    smoke = json.loads((tmp_path / "sparse_atomics_cpu_smoke.json").read_text())["smoke"]
    assert smoke["dq_rel_err"] < 1e-6 and smoke["atomics_rows_match"]


if __name__ == "__main__":
    _run_cases()
