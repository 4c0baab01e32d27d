"""Benchmark: k-pool indexer selection (score + top-k pools), fused Triton kernel vs plain torch, one GPU.

    python bench/indexer.py --out DIR [--quick] [--seqlens 8192,...] [--heads 16x64,32x128] [--sweep]

Problem (the SPEC's): q [1,S,H,D] bf16 (pre-scaled), w [1,S,H] fp32, pooled keys [1,S/4,D] bf16, pool
4, top-512 pools (2048 tokens). Per S it times the kernel, the chunked torch twin (256 queries per
pass) and the unchunked twin (an fp32 [S,H,NP] workspace) until the unchunked one runs out of
memory, records each one's peak memory above the inputs, and checks the kernel's picks against the
chunked twin (rows that differ, and whether every difference is a near-tie). TFLOP/s are on the
single-sweep count 2*H*D per causal (query, pool) pair; the kernel sweeps the keys 1 + passes times
(passes are reported), so its executed rate is that times the mean sweep count.
Writes DIR/indexer.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import triton

from timing import timed  # noqa: E402  (bench/ is on sys.path when run as a script)
from longctx.ops.indexer import kpool_scores_torch, kpool_topk_torch
from longctx.ops.indexer import triton_kernel as tk

P, K = 4, 512
GIB = 1 << 30


def peak_gib(fn) -> float:
    """Peak memory one call allocates above what is live before it, GiB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / GIB


def pairs(S: int) -> int:
    """Causal (query, pool) pairs: query t sees (t+1)//P complete pools."""
    t = torch.arange(S, dtype=torch.float64)
    return int(((t + 1) // P).sum())


def inputs(S, H, D, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(1, S, H, D, device="cuda", generator=g) * D**-0.5).to(torch.bfloat16)
    w = torch.randn(1, S, H, device="cuda", generator=g) * H**-0.5
    pk = torch.randn(1, S // P, D, device="cuda", generator=g).to(torch.bfloat16)
    return q, w, pk


def agreement(out, ref, q, w, pk, max_rows=64) -> dict:
    """Rows whose picks differ, and the worst relative gap to the k-th score among sampled ones."""
    rows = (out != ref).any(-1).nonzero().tolist()
    worst = 0.0
    for b, t in rows[:max_rows]:
        sc = kpool_scores_torch(q[b : b + 1, t : t + 1], w[b : b + 1, t : t + 1], pk[b : b + 1])[0, 0].double()
        a, c = set(out[b, t].tolist()) - {-1}, set(ref[b, t].tolist()) - {-1}
        kth, scale = sc[sorted(c)].min(), sc.abs().max().clamp_min(1e-30)
        worst = max([worst] + [float((sc[p] - kth).abs() / scale) for p in a ^ c])
    return {"rows_differ": len(rows), "worst_rel_gap": worst}


def kernel_case(S, H, D, warmup, reps, cfg=None, check=True, torch_max=131072):
    q, w, pk = inputs(S, H, D)
    run = lambda: tk.kpool_topk_triton(q, w, pk, P, K, cfg=cfg)
    ms = timed(run, warmup, reps)
    mem = peak_gib(run)
    out = run()
    stats = {k: tk.LAST_LAUNCH.get(k) for k in ("n_regs", "n_spills")}
    passes = tk.LAST_LAUNCH["passes"].float()
    res = {
        "ms": ms, "peak_gib": mem, "tflops_single_sweep": pairs(S) * 2 * H * D / ms / 1e9,
        "passes_mean": float(passes.mean()), "passes_max": int(passes.max()),
        "deferred_row_frac": float(tk.LAST_LAUNCH["deferred"].sum()) / S,
        "cfg": {k: v for k, v in tk.LAST_LAUNCH.items() if k not in ("passes", "deferred")}, **stats,
    }
    res["tflops_executed"] = res["tflops_single_sweep"] * (1 + res["passes_mean"])
    if check and S <= torch_max:
        ref = kpool_topk_torch(q, w, pk, P, K, chunk=256)
        res["check"] = agreement(out, ref, q, w, pk)
    return res


def torch_case(S, H, D, chunk, warmup, reps):
    q, w, pk = inputs(S, H, D)
    run = lambda: kpool_topk_torch(q, w, pk, P, K, chunk=chunk)
    try:
        mem = peak_gib(run)
        ms = timed(run, warmup, reps)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"oom": True}
    torch.cuda.empty_cache()
    return {"ms": ms, "peak_gib": mem, "tflops_single_sweep": pairs(S) * 2 * H * D / ms / 1e9}


SWEEP = [
    {},
    {"CAND": 0},
    {"CAND": 128},
    {"RBITS": 5},
    {"RBITS": 6},
    {"HIST_TL": False},
    {"BLOCK_N": 32},
    {"BLOCK_N": 128},
    {"num_warps": 4},
    {"num_stages": 3},
    {"BLOCK_M": 8},
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--quick", action="store_true", help="S in {32k, 128k}, 16x64 only, fewer reps")
    ap.add_argument("--seqlens", default="8192,32768,131072,524288,1048576")
    ap.add_argument("--heads", default="16x64,32x128")
    ap.add_argument("--torch-max", type=int, default=131072, help="largest S for the chunked torch twin")
    ap.add_argument("--sweep", action="store_true", help="kernel configs at S=32k and 128k (16x64)")
    args = ap.parse_args()

    seqlens = [32768, 131072] if args.quick else [int(s) for s in args.seqlens.split(",")]
    heads = [(16, 64)] if args.quick else [tuple(int(v) for v in h.split("x")) for h in args.heads.split(",")]
    warmup, reps = (1, 3) if args.quick else (2, 5)
    results = {
        "when": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "problem": {"pool": P, "k_pools": K, "dtype": "bf16 q/pk, fp32 w"},
        "cases": [],
    }
    for H, D in heads:
        unchunked_alive = True
        for S in seqlens:
            case = {"S": S, "H": H, "D": D, "pairs": pairs(S)}
            case["kernel"] = kernel_case(S, H, D, warmup, reps, torch_max=args.torch_max)
            if S <= args.torch_max:
                case["torch_chunk256"] = torch_case(S, H, D, 256, warmup, reps)
            if unchunked_alive:
                case["torch_unchunked"] = torch_case(S, H, D, None, warmup, reps)
                unchunked_alive = not case["torch_unchunked"].get("oom", False)
            print(json.dumps(case), flush=True)
            results["cases"].append(case)
    if args.sweep:
        results["sweep"] = []
        for S in (32768, 131072):
            for cfg in SWEEP:
                try:
                    r = kernel_case(S, 16, 64, warmup, reps, cfg=cfg, check=S <= 32768)
                except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is a result too
                    r = {"error": repr(e)[:300]}
                r.update(S=S, override=cfg)
                print(json.dumps(r), flush=True)
                results["sweep"].append(r)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "indexer.json").write_text(json.dumps(results, indent=1))
    print("wrote", out / "indexer.json")


if __name__ == "__main__":
    main()
