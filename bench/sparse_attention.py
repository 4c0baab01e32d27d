"""Benchmark: Triton DSA sparse attention (fwd, bwd) vs dense causal SDPA, one GPU.

    python bench/sparse_attention.py --out DIR [--quick] [--seqlens 32768,131072] [--heads 16,64] [--sweep]

Sparse problem: q [1,S,H,512] bf16, kv [1,S,512], K=2051 DSA-like causal indices (512 pools of 4
earlier tokens + the visible tail). TFLOP/s use the nominal count 2*K*H*(512+512) per query for the
forward (slots that are -1 in the first 2k queries are counted too: <1% of queries at 32k) and 2.5x
that for the backward. Dense comparison (the SPEC's): causal SDPA, H heads of 128 for qk and v, fwd+bwd.
Writes DIR/sparse_attention.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import env_record, timed, write_results

from longctx.ops.sparse_attention import triton as tk
from longctx.ops.sparse_attention.naive import causal_pool_indices

D, K = 512, 2051
GIB = 1 << 30


def fwd_flops(S: int, H: int) -> float:
    return 2.0 * K * H * (D + D) * S


def sparse_case(S, H, warmup, reps, do_bwd=True, cfg_f=None, cfg_b=None):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(1, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = causal_pool_indices(S, K, generator=g)[None]
    scale = D**-0.5
    out = {}
    o, lse = tk.sparse_attention_fwd(q, kv, idx, scale, cfg=cfg_f)
    out["fwd_ms"] = timed(lambda: tk.sparse_attention_fwd(q, kv, idx, scale, cfg=cfg_f), warmup, reps)
    out["fwd_tflops"] = fwd_flops(S, H) / out["fwd_ms"] / 1e9
    out["fwd_kernel"] = dict(tk.LAST_LAUNCH.get("fwd", {}))
    if do_bwd:
        do = torch.randn_like(o)
        out["bwd_ms"] = timed(lambda: tk.sparse_attention_bwd(q, kv, idx, o, lse, do, scale, cfg=cfg_b), warmup, reps)
        out["bwd_tflops"] = 2.5 * fwd_flops(S, H) / out["bwd_ms"] / 1e9
        out["bwd_kernel"] = dict(tk.LAST_LAUNCH.get("bwd", {}))
        out["fwd_bwd_ms"] = out["fwd_ms"] + out["bwd_ms"]
    return out


def dense_case(S, H, warmup, reps):
    """Causal SDPA fwd+bwd, H heads of 128, with the flash and the cuDNN backends (cuDNN is
    faster on Hopper); the comparison uses the faster one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(1, H, S, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(1, H, S, 128, device="cuda", dtype=torch.bfloat16)

    def step():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.backward(o, do)

    out = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                out[f"{name}_fwd_bwd_ms"] = timed(step, warmup, reps)
        except RuntimeError as e:  # backend not available for this build/shape: record it
            out[f"{name}_error"] = repr(e)[:200]
    times = [v for k, v in out.items() if k.endswith("_ms")]
    out["fwd_bwd_ms"] = min(times) if times else float("nan")
    flops = 3.5 * 4 * (S * S / 2) * 128 * H
    out["tflops_best"] = flops / out["fwd_bwd_ms"] / 1e9
    return out


def sparse_bytes(S, H, bwd):
    b = 2 * S * H * D * 2 + S * D * 2 + S * K * 4  # q, o, kv, idx
    if bwd:
        b += 2 * S * H * D * 2 + S * D * (4 + 2)  # do, dq, dkv fp32 + cast
    return b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="S=32k only, few reps (< 60 s)")
    ap.add_argument("--seqlens", default="32768,131072,524288")
    ap.add_argument("--heads", default="16,64")
    ap.add_argument("--max-seqlen", type=int, default=None)
    ap.add_argument("--dense-max-seqlen", type=int, default=131072, help="dense SDPA is O(S^2): skip above this")
    ap.add_argument("--mem-gib", type=float, default=120.0, help="skip cases whose tensors exceed this")
    ap.add_argument("--sweep", action="store_true", help="also time tile configs at the first S")
    ap.add_argument("--sweep-only", default=None, metavar="H:WHICH,...",
                    help="with --sweep, only these rows of the grid, e.g. 16:bwd (default: all)")
    args = ap.parse_args()

    seqlens = [32768] if args.quick else [int(s) for s in args.seqlens.split(",")]
    if args.max_seqlen:
        seqlens = [s for s in seqlens if s <= args.max_seqlen]
    heads = [int(h) for h in args.heads.split(",")]
    warmup, reps = (1, 3) if args.quick else (2, 5)

    res = {
        **env_record(),
        "D": D,
        "K": K,
        "flops_note": "fwd 2*K*H*(D+D) per query (nominal K, -1 slots counted), bwd 2.5x fwd",
        "cases": [],
    }
    for S in seqlens:
        for H in heads:
            row = {"S": S, "H": H}
            need_f, need_b = sparse_bytes(S, H, False), sparse_bytes(S, H, True)
            if need_f > args.mem_gib * GIB:
                row["sparse"] = f"skipped: needs {need_f / GIB:.0f} GiB"
            else:
                do_bwd = need_b <= args.mem_gib * GIB
                print(f"S={S} H={H}: sparse ...", flush=True)
                row["sparse"] = sparse_case(S, H, warmup, reps, do_bwd=do_bwd)
                torch.cuda.empty_cache()
                if not do_bwd:
                    row["sparse"]["bwd"] = f"skipped: needs {need_b / GIB:.0f} GiB"
                print(f"  {row['sparse']}", flush=True)
            if S <= args.dense_max_seqlen:
                print(f"S={S} H={H}: dense SDPA ...", flush=True)
                row["dense_sdpa_h128"] = dense_case(S, H, 1, 3 if S > 65536 else reps)
                torch.cuda.empty_cache()
                print(f"  {row['dense_sdpa_h128']}", flush=True)
                if isinstance(row["sparse"], dict) and "fwd_bwd_ms" in row["sparse"]:
                    row["speedup_vs_dense"] = row["dense_sdpa_h128"]["fwd_bwd_ms"] / row["sparse"]["fwd_bwd_ms"]
            res["cases"].append(row)

    if args.sweep:
        S = seqlens[0]
        res["sweep"] = []
        grid = [
            (64, "fwd", [(32, 8, 3), (32, 8, 2), (64, 8, 2)]),
            (16, "fwd", [(64, 4, 2), (32, 4, 3), (32, 8, 3)]),
            (16, "bwd", [(16, 4, 2), (32, 8, 2), (64, 8, 2)]),
        ]
        only = set(args.sweep_only.split(",")) if args.sweep_only else None
        for H, which, cfgs in grid:
            if only is not None and f"{H}:{which}" not in only:
                continue
            for n, w, st in cfgs:
                c = {"BLOCK_N": n, "num_warps": w, "num_stages": st}
                bwd = which == "bwd"
                try:
                    r = sparse_case(S, H, 1, 3, do_bwd=bwd, cfg_f=None if bwd else c, cfg_b=c if bwd else None)
                    r = {k: v for k, v in r.items() if k.startswith("bwd" if bwd else "fwd")}
                except Exception as e:  # noqa: BLE001 (out of resources etc.: record and go on)
                    r = {"error": repr(e)[:300]}
                print(f"sweep H={H} {which} {c}: {r}", flush=True)
                res["sweep"].append({"H": H, "which": which, "cfg": c, **r})

    write_results(args.out, "sparse_attention.json", res)


if __name__ == "__main__":
    main()
