"""Benchmark: Triton DSA sparse attention (fwd, bwd) vs dense causal SDPA, one GPU.

    python bench/sparse_attention.py --out DIR [--quick] [--seqlens 32768,131072] [--heads 16,64] [--sweep]
    python bench/sparse_attention.py --out DIR --union-only     # today's kernel (G = 1) vs the union mode
    python bench/sparse_attention.py --out DIR --union-tiles    # the G = 4 union kernels' tiles at 16 heads
    TRITON_INTERPRET=1 python bench/sparse_attention.py --out DIR --union-tiles --cpu-smoke   # small, fp32, CPU

Sparse problem: q [1,S,H,512] bf16, kv [1,S,512], K=2051 DSA-like causal indices (512 pools of 4
earlier tokens + the visible tail). TFLOP/s use the nominal count 2*K*H*(512+512) per query for the
forward (slots that are -1 in the first 2k queries are counted too: <1% of queries at 32k) and 2.5x
that for the backward. Dense comparison (the SPEC's): causal SDPA, H heads of 128 for qk and v, fwd+bwd.
Union mode (`--union` / `--union-only`, longctx/ops/sparse_attention/union.py): today's per-query kernel
(G = 1) against G neighbouring queries over the union of their selections, at H = 16 and 64, S = 32k and
128k, on three workloads: `random` (causal_pool_indices: independent older pools), `indexer` (the k-pool
indexer of a random-init h200-ref DSA layer on embedded stdlib text) and `trained_like`
(persistent_pool_indices with the redraw rate fitted to a trained small model's selections,
bench/results/union_size.json). Each row records U_G/k, the cost model's G and its prediction, and the
measured build, fwd and bwd ms of every G timed. Writes DIR/sparse_attention.json (or
DIR/sparse_attention_union.json with --union-only).
`--union-tiles`: the G = 4 union forward and backward at 16 heads under each tile config of UNION_TILES
(rows a program, slots an iteration, warps; fewer rows than G x H means several programs a group) on the
trained-like and random selections, beside the per-query kernels, each checked against them (relative
difference of o, dq, dkv) with its registers and spills: DIR/sparse_attention_union_tiles.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import env_record, timed, write_results

from longctx.ops.sparse_attention import triton as tk
from longctx.ops.sparse_attention import union as un
from longctx.ops.sparse_attention.naive import causal_pool_indices, persistent_pool_indices

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


DEV = "cuda"  # the union comparison's device ("cpu" under TRITON_INTERPRET=1 for a smoke run)
TRAINED_LIKE_REDRAW = 0.1  # used when bench/results/union_size.json is missing


def trained_like_redraw() -> float:
    """The redraw rate whose U_4/k matches the trained small model's (bench/union_size.py's fit)."""
    import json

    f = ROOT / "bench" / "results" / "union_size.json"
    try:
        return float(json.loads(f.read_text())["trained_like_fit"]["redraw"])
    except (OSError, KeyError, ValueError):
        return TRAINED_LIKE_REDRAW


def indexer_selection(S: int, seed: int = 0) -> torch.Tensor:
    """int32 [1, S, 2051]: the k-pool indexer of a random-init h200-ref DSA layer (bf16, the Triton path) on
    stdlib text, its bytes through a random-init embedding and the block's RMSNorm."""
    from longctx.config.model import preset
    from longctx.data.sources import stdlib_corpus
    from longctx.layers.dsa import SparseMLA
    from longctx.layers.norms import RMSNorm

    cfg = preset("h200-ref")
    torch.manual_seed(seed)
    layer = SparseMLA(cfg, cfg.layer_kinds().index("D"))
    for m in layer.modules():  # the model's init (LongCtxModel.init_weights)
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, 0.0, cfg.init_std)
    layer = layer.to(DEV, torch.bfloat16)
    _, held = stdlib_corpus()
    data = torch.frombuffer(bytearray("".join(d.text for d in held).encode()), dtype=torch.uint8)
    ids = data[torch.arange(S) % data.numel()].long().to(DEV)
    emb = torch.randn(256, cfg.hidden_size, device=DEV) * cfg.init_std
    x = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(DEV)(emb[ids][None]).bfloat16()
    with torch.no_grad():
        q_latent = layer.q_a_norm(layer.q_a_proj(x))
        return layer.indexer.select(x, q_latent)


def _q_kv_do(S, H, d, dtype, g):
    """The union comparisons' random q [1,S,H,d], kv [1,S,d] and dO on DEV."""
    return (torch.randn(1, S, H, d, device=DEV, dtype=dtype, generator=g),
            torch.randn(1, S, d, device=DEV, dtype=dtype, generator=g),
            torch.randn(1, S, H, d, device=DEV, dtype=dtype, generator=g))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def union_case(S, H, idx, groups, warmup, reps):
    """Today's kernel (G = 1) and each union G in `groups` on one selection: ms of build/fwd/bwd, U_G/k
    (exact, from the built union) and the model's choice (from its sampled estimate) and prediction."""
    g = torch.Generator(device=DEV).manual_seed(1)
    q, kv, do = _q_kv_do(S, H, D, torch.bfloat16, g)
    scale = D**-0.5
    k = float(((idx >= 0) & (idx < S)).sum()) / S
    sampled = un.union_sizes(idx, S)
    out = {"k_mean": k, "sampled_ratio": sampled,
           "choose_ms": timed(lambda: un.resolve_group(idx, H, S, "auto"), 1, 3, DEV),
           "chosen_G": un.resolve_group(idx, H, S, "auto"), "variants": {}}
    o1, lse1 = tk.sparse_attention_fwd(q, kv, idx, scale, group=1)
    base = {"fwd_ms": timed(lambda: tk.sparse_attention_fwd(q, kv, idx, scale, group=1), warmup, reps, DEV),
            "bwd_ms": timed(lambda: tk.sparse_attention_bwd(q, kv, idx, o1, lse1, do, scale, group=1), warmup, reps, DEV)}
    base["total_ms"] = base["fwd_ms"] + base["bwd_ms"]
    base["predicted_ms"] = un.predicted_ns_per_query(1, H, 1.0, k) * S / 1e6
    out["variants"]["1"] = base
    dq1, dkv1 = tk.sparse_attention_bwd(q, kv, idx, o1, lse1, do, scale, group=1)
    for G in groups:
        u = un.build_union(idx, G, S)
        ratio = float(u.length.sum()) * G / (k * S)
        r = {"ratio": ratio, "U_max": u.packed.shape[2],
             "build_ms": timed(lambda: un.build_union(idx, G, S), warmup, reps, DEV)}
        o, lse = tk.union_attention_fwd(q, kv, u, scale)
        r["fwd_ms"] = timed(lambda: tk.union_attention_fwd(q, kv, u, scale), warmup, reps, DEV)
        r["fwd_kernel"] = dict(tk.LAST_LAUNCH.get("fwd", {}))
        r["bwd_ms"] = timed(lambda: tk.union_attention_bwd(q, kv, u, o, lse, do, scale), warmup, reps, DEV)
        r["bwd_kernel"] = dict(tk.LAST_LAUNCH.get("bwd", {}))
        dq, dkv = tk.union_attention_bwd(q, kv, u, o, lse, do, scale)
        r["rel_vs_G1"] = {"o": _rel(o, o1), "dq": _rel(dq, dq1), "dkv": _rel(dkv, dkv1)}
        r["total_ms"] = r["build_ms"] + r["fwd_ms"] + r["bwd_ms"]
        r["speedup"] = base["total_ms"] / r["total_ms"]
        r["predicted_ms"] = un.predicted_ns_per_query(G, H, ratio, k) * S / 1e6
        out["variants"][str(G)] = r
        del u, o, lse, dq, dkv
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return out


def union_comparison(seqlens, heads, warmup, reps) -> list:
    rows = []
    redraw = trained_like_redraw()
    for S in seqlens:
        g = torch.Generator(device=DEV).manual_seed(0)
        work = {"random": causal_pool_indices(S, K, generator=g)[None],
                "indexer": indexer_selection(S),
                "trained_like": persistent_pool_indices(S, K, redraw, generator=g)[None]}
        for H in heads:
            for name, idx in work.items():
                # the union Gs worth timing: every G of <= 64 rows at 16 heads; at 64 heads G = 2 (two programs
                # a group, the model says slower) only at the first length
                groups = [G for G in (2, 4) if G * H <= 64] if H <= 32 else ([2] if S == seqlens[0] else [])
                print(f"union S={S} H={H} {name} G={groups} ...", flush=True)
                r = {"S": S, "H": H, "workload": name, **({"redraw": redraw} if name == "trained_like" else {}),
                     **union_case(S, H, idx, groups, warmup, reps)}
                chosen = r["variants"].get(str(r["chosen_G"]))
                if chosen is not None:
                    r["chosen_total_ms"] = chosen["total_ms"]
                    r["chosen_speedup"] = r["variants"]["1"]["total_ms"] / chosen["total_ms"]
                print(f"  {r}", flush=True)
                rows.append(r)
            if DEV == "cuda":
                torch.cuda.empty_cache()
        del work
    return rows


# (BLOCK_H, BLOCK_N, num_warps) for the G = 4 x 16-head union kernels; None = the launch config (`triton._cfg`)
UNION_TILES = {"fwd": [None, (32, 32, 4), (64, 16, 8)],
               "bwd": [None, (64, 16, 8), (32, 32, 8), (32, 16, 8), (16, 16, 4)]}


def union_tiles(seqlens, warmup, reps, G=4, H=16, k=K, d=D, dtype=torch.bfloat16) -> list:
    """Each tile config of the union kernels on one selection: ms, registers, spills, and the difference from
    the per-query kernel's o, dq and dkv (the config changes only the order of the sums). k, d, dtype: the
    CPU smoke's small fp32 problem."""
    rows = []
    for S in seqlens:
        g = torch.Generator(device=DEV).manual_seed(0)
        work = {"trained_like": persistent_pool_indices(S, k, trained_like_redraw(), device=DEV, generator=g)[None],
                "random": causal_pool_indices(S, k, device=DEV, generator=g)[None]}
        q, kv, do = _q_kv_do(S, H, d, dtype, g)
        scale = d**-0.5
        for name, idx in work.items():
            o1, lse1 = tk.sparse_attention_fwd(q, kv, idx, scale, group=1)
            dq1, dkv1 = tk.sparse_attention_bwd(q, kv, idx, o1, lse1, do, scale, group=1)
            u = un.build_union(idx, G, S)
            r = {"S": S, "H": H, "G": G, "workload": name,
                 "ratio": float(u.length.sum()) * G / float(((idx >= 0) & (idx < S)).sum()),
                 "per_query_fwd_ms": timed(lambda: tk.sparse_attention_fwd(q, kv, idx, scale, group=1), warmup, reps, DEV),
                 "per_query_bwd_ms": timed(lambda: tk.sparse_attention_bwd(q, kv, idx, o1, lse1, do, scale, group=1),
                                           warmup, reps, DEV),
                 "tiles": []}
            for which, tiles in UNION_TILES.items():
                for tile in tiles:
                    cfg = None if tile is None else dict(zip(("BLOCK_H", "BLOCK_N", "num_warps"), tile))
                    if which == "fwd":
                        run = lambda: tk.union_attention_fwd(q, kv, u, scale, cfg)  # noqa: E731
                        diff = {"o": _rel(run()[0], o1)}
                    else:
                        run = lambda: tk.union_attention_bwd(q, kv, u, o1, lse1, do, scale, cfg)  # noqa: E731
                        dq, dkv = run()
                        diff = {"dq": _rel(dq, dq1), "dkv": _rel(dkv, dkv1)}
                    t = {"which": which, "ms": timed(run, warmup, reps, DEV), "rel_vs_per_query": diff,
                         "kernel": {k: v for k, v in tk.LAST_LAUNCH[which].items()
                                    if k in ("BLOCK_H", "BLOCK_N", "num_warps", "n_regs", "n_spills")}}
                    print(f"union tiles S={S} {name} {which} {t}", flush=True)
                    r["tiles"].append(t)
            rows.append(r)
            del u
            if DEV == "cuda":
                torch.cuda.empty_cache()
    return rows


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
    global DEV  # --cpu-smoke runs the union comparison's helpers on the CPU
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
    ap.add_argument("--union", action="store_true", help="also compare today's kernel with the union mode")
    ap.add_argument("--union-only", action="store_true", help="only the union comparison (S=32k,128k; H=16,64)")
    ap.add_argument("--union-seqlens", default="32768,131072")
    ap.add_argument("--union-tiles", action="store_true", help="only the union kernels' tile configs (G = 4, H = 16)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="with --union-tiles: a tiny fp32 problem on the CPU under TRITON_INTERPRET=1")
    args = ap.parse_args()
    if args.cpu_smoke:
        if not args.union_tiles or os.environ.get("TRITON_INTERPRET") != "1":
            print("error: --cpu-smoke runs --union-tiles' kernels in the interpreter; pass --union-tiles and set "
                  "TRITON_INTERPRET=1.", file=sys.stderr)
            return 2
        DEV = "cpu"
        res = {**env_record("cpu (TRITON_INTERPRET=1 smoke)"),
               "union_tiles": union_tiles([40], 0, 1, k=11, d=32, dtype=torch.float32)}
        write_results(args.out, "sparse_attention_union_tiles_cpu_smoke.json", res)
        return 0
    if not torch.cuda.is_available():
        print("error: the benchmark times CUDA kernels and this machine has no GPU; on a CPU, "
              "TRITON_INTERPRET=1 ... --union-tiles --cpu-smoke runs the union kernels' tiles small.", file=sys.stderr)
        return 2
    if args.union_tiles:
        res = {**env_record(), "D": D, "K": K, "union_tiles": union_tiles([int(s) for s in args.union_seqlens.split(",")], 1, 3)}
        write_results(args.out, "sparse_attention_union_tiles.json", res)
        return 0
    if args.union_only:
        res = {**env_record(), "D": D, "K": K, "cost_model": {"fwd_ns": un.COST_FWD, "bwd_ns": un.COST_BWD,
                                                              "build_ns": un.COST_BUILD, "margin": un.MARGIN}}
        res["union"] = union_comparison([int(s) for s in args.union_seqlens.split(",")],
                                        [int(h) for h in args.heads.split(",")], 1, 3)
        write_results(args.out, "sparse_attention_union.json", res)
        return 0

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

    if args.union:
        res["union"] = union_comparison([int(s) for s in args.union_seqlens.split(",")], heads, 1, 3)
    write_results(args.out, "sparse_attention.json", res)


if __name__ == "__main__":
    sys.exit(main())
