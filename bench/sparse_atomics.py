"""Benchmark: what the 16-head sparse backward's fp32 dKV atomics cost on their own, and whether they overlap
the rest of its work when other warps issue them, one GPU.

    python bench/sparse_atomics.py --out DIR [--seqlens 32768,131072]
    TRITON_INTERPRET=1 python bench/sparse_atomics.py --cpu-smoke --out DIR   # a few queries on the CPU

One probe kernel (one program a query, h200-ref's 16 heads, kv_lora 512, 2,051 slots ascending as the
indexer lists them, `causal_pool_indices`' pools) in three roles, beside the backward itself
(`sparse_attention_bwd`):

- compute: the backward's gathers and five products, dKV summed in registers instead of added out;
- atomics: the backward's dKV atomics alone, at the same addresses, of a tile that costs nothing to compute;
- split: both in one grid, even programs computing and odd ones adding, so that every SM runs the two side
  by side, as a warp-specialised kernel would run them in one program.

If "split" takes about as long as the longer of "compute" and "atomics", the two overlap when different
warps issue them, and a warp-specialised backward would approach that; if it takes about their sum, or
"atomics" alone takes as long as the backward, the atomics are the floor of any kernel that adds dKV per
(query, selected row). docs/design/sparse_attention.md has the measured answer. Times are CUDA-event
medians; writes DIR/sparse_atomics.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import env_record, timed, write_results  # bench/ is on sys.path when run as a script

from longctx.ops.sparse_attention import triton as sparse
from longctx.ops.sparse_attention.naive import causal_pool_indices

H, D, K, BLOCK_N = 16, 512, 2051, 16
ROLES = {"compute": 0, "atomics": 1, "split": 2}
_LOG2E = 1.4426950408889634


@triton.jit
def _probe(Q, KV, IDX, O, DO, LSE, DQ, DKV, SINK, qk_scale, scale, K: tl.constexpr, H: tl.constexpr,
           D: tl.constexpr, BLOCK_N: tl.constexpr, ROLE: tl.constexpr):
    """Contiguous [S, H, D] q, o, dO, dq; [S, D] kv; fp32 [S, H] lse and [S, D] dkv; [S, K] slots."""
    pid = tl.program_id(0)
    if ROLE == 2:
        t = (pid // 2).to(tl.int64)
        adds = pid % 2 == 1
    else:
        t = pid.to(tl.int64)
        adds = ROLE == 1
    offs_h = tl.arange(0, H).to(tl.int64)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    idx_base = IDX + t * K
    if adds:
        for n0 in range(0, K, BLOCK_N):
            slot = n0 + offs_n
            j = tl.load(idx_base + slot, mask=slot < K, other=-1).to(tl.int64)
            tile = tl.zeros([D, BLOCK_N], tl.float32) + (j + 1).to(tl.float32)[None, :] * 1e-9
            tl.atomic_add(DKV + j[None, :] * D + offs_d[:, None], tile, mask=(j >= 0)[None, :], sem="relaxed")
    else:
        hd = t * H * D + offs_h[:, None] * D + offs_d[None, :]
        q = tl.load(Q + hd)
        do = tl.load(DO + hd)
        delta = tl.sum(tl.load(O + hd).to(tl.float32) * do.to(tl.float32), 1)
        lse2 = tl.load(LSE + t * H + offs_h) * 1.4426950408889634
        dq = tl.zeros([H, D], tl.float32)
        dkv_sum = tl.zeros([D, BLOCK_N], tl.float32)
        for n0 in range(0, K, BLOCK_N):
            slot = n0 + offs_n
            j = tl.load(idx_base + slot, mask=slot < K, other=-1).to(tl.int64)
            valid = j >= 0
            k = tl.load(KV + j[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k))
            dp = tl.dot(do, tl.trans(k))
            p = tl.where(valid[None, :], tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(k.dtype), k, dq)
            dkv_t = tl.dot(tl.trans(do), p.to(k.dtype))
            dkv_sum += tl.dot(tl.trans(q), (ds * scale).to(k.dtype), dkv_t)
        tl.store(DQ + hd, (dq * scale).to(DQ.dtype.element_ty))
        # the summed tiles go out once, so that the compiler keeps every product
        tl.store(SINK + (pid % 1024) * D * BLOCK_N + offs_d[:, None] * BLOCK_N + offs_n[None, :], dkv_sum)


def inputs(S: int, device: str, k: int = K):
    g = torch.Generator(device=device).manual_seed(0)
    idx = causal_pool_indices(S, k, device=device, generator=g)
    idx = torch.where(idx >= 0, idx, S).sort(1).values  # rows ascending (the indexer's order), unused slots last
    idx = torch.where(idx == S, -1, idx).to(torch.int32).contiguous()
    q = torch.randn(S, H, D, device=device, generator=g).bfloat16()
    kv = torch.randn(S, D, device=device, generator=g).bfloat16()
    do = torch.randn(S, H, D, device=device, generator=g).bfloat16()
    scale = 192 ** -0.5  # h200-ref's qk_nope_head_dim
    o, lse = sparse.sparse_attention_fwd(q[None], kv[None], idx[None], scale)
    return q, kv, idx, o[0].contiguous(), lse[0].contiguous(), do, scale


def launch(role: str, q, kv, idx, o, lse, do, scale, dq, dkv, sink):
    S, k = idx.shape
    grid = (2 * S if role == "split" else S,)
    _probe[grid](q, kv, idx, o, do, lse, dq, dkv, sink, scale * _LOG2E, scale, K=k, H=H, D=D, BLOCK_N=BLOCK_N,
                 ROLE=ROLES[role], num_warps=4, num_stages=2)


def case(S: int, device: str, reps: int) -> dict:
    q, kv, idx, o, lse, do, scale = inputs(S, device)
    dq = torch.empty_like(q)
    dkv = torch.zeros(S, D, device=device, dtype=torch.float32)
    sink = torch.empty(1024, D, BLOCK_N, device=device, dtype=torch.float32)
    row = {"S": S, "heads": H, "slots": K}
    row["backward_ms"] = timed(lambda: sparse.sparse_attention_bwd(q[None], kv[None], idx[None], o[None], lse[None],
                                                                    do[None], scale), 1, reps, device)
    for role in ROLES:
        row[f"{role}_ms"] = timed(lambda: launch(role, q, kv, idx, o, lse, do, scale, dq, dkv, sink), 1, reps, device)
    row["atomic_adds"] = int((idx >= 0).sum().item()) * D
    row["atomics_adds_per_s"] = row["atomic_adds"] / (row["atomics_ms"] / 1e3)
    print(" ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    return row


def smoke(device: str) -> dict:
    """A few queries: the compute role's dq is the backward's (it runs the same products), the atomics role
    adds to exactly the rows the backward adds to."""
    S, k = 48, 35
    q, kv, idx, o, lse, do, scale = inputs(S, device, k)
    dq_ref, dkv_ref = sparse.sparse_attention_bwd(q[None], kv[None], idx[None], o[None], lse[None], do[None], scale)
    dq = torch.empty_like(q)
    dkv = torch.zeros(S, D, device=device, dtype=torch.float32)
    sink = torch.empty(1024, D, BLOCK_N, device=device, dtype=torch.float32)
    launch("compute", q, kv, idx, o, lse, do, scale, dq, dkv, sink)
    dq_err = ((dq.float() - dq_ref[0].float()).norm() / dq_ref.float().norm()).item()
    launch("atomics", q, kv, idx, o, lse, do, scale, dq, dkv, sink)
    rows = torch.zeros(S, dtype=torch.bool, device=device)
    rows[idx[idx >= 0].long()] = True
    same_rows = bool(torch.equal(dkv.abs().sum(1) > 0, rows))
    return {"S": S, "slots": k, "dq_rel_err": dq_err, "atomics_rows_match": same_rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqlens", default="32768,131072")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cpu-smoke", action="store_true", help="a few queries on the CPU under TRITON_INTERPRET=1")
    args = ap.parse_args()
    if args.cpu_smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("error: --cpu-smoke runs the Triton kernels in the interpreter; set TRITON_INTERPRET=1.", file=sys.stderr)
            return 2
        res = dict(env_record(), smoke=smoke("cpu"))
        write_results(args.out, "sparse_atomics_cpu_smoke.json", res)
        return 0
    if not torch.cuda.is_available():
        print("error: the benchmark times CUDA kernels and this machine has no GPU; use --cpu-smoke.", file=sys.stderr)
        return 2
    res = dict(env_record(), cases=[case(int(s), "cuda", args.reps) for s in args.seqlens.split(",")])
    write_results(args.out, "sparse_atomics.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
