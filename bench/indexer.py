"""Benchmark: k-pool indexer selection (score + top-k pools), our Triton path vs plain torch, one GPU.

    python bench/indexer.py --out DIR [--quick] [--seqlens 8192,...] [--heads 16x64] [--budget-s 120] [--sweep] [--probe]
        [--select-widths 16384,...,1048576 [--compact-sweep]]
    python bench/indexer.py --cpu-smoke --out DIR    # tiny sizes, the kernels under TRITON_INTERPRET=1

Problem (the h200-ref indexer): q [1,S,16,64] bf16 (pre-scaled), w [1,S,16] fp32, pooled keys
[1,S/4,64] bf16, pool 4, top-512 pools (top-2048 tokens). Per S it times the Triton path
(`ops/indexer/triton.py`, "two_phase": a score kernel into an fp32 [1024, pools] buffer, then the default
selection by row width, the row kernel or "compact"; "two_phase_topk": the same with each row's k-th score
by torch.topk and an emit kernel that reads the row twice; "two_phase_rows", up to 128k: the row kernel on
every row), the chunked torch twin (256 queries per pass, up to
--torch-max) and the unchunked twin (an fp32 [S,H,NP] workspace) until it runs out of memory (recorded
as {"oom": true}), records each one's peak memory above the inputs, and checks the Triton path's picks
against the chunked twin (rows that differ, and whether every difference is a near-tie).

The default path also gets its GPU time without the host's: replayed from a CUDA graph (`graph_ms`) and
summed over its kernels under the profiler (`kernels_ms`); eager timing counts the host's launches where
the GPU waits for them.

Floor: the scoring matmul alone at the measured bf16 MMA rate, 2*H*D*S*(S/P)/2 flops (causal) /
778e12 flop/s; every implementation reports ms / floor. `--probe` times the Triton path's parts alone
(the scoring matmul, torch.topk, the buffer's HBM traffic); `--select-widths` each selection on 1,024 random
rows of each width (compact with its candidate counts, also on rows rising with the pool id; `--compact-sweep`
its kernel's step and warps); `--sweep` the score kernel's tile configs.
A time budget (--budget-s, about two minutes) skips the cases projected to overrun it (scaling
the last time by S^2), recorded as skipped. Writes DIR/indexer.json (indexer_cpu_smoke.json).
"""

from __future__ import annotations

import os
import sys

if "--cpu-smoke" in sys.argv:  # the interpreter must be on before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import env_record, kernel_times, timed, write_results  # bench/ is on sys.path when run as a script

from longctx.ops.indexer import kpool_scores_torch, kpool_topk_torch
from longctx.ops.indexer.triton import (
    GROUP,
    ROW_CAP,
    compact_candidates,
    compact_group,
    group_maxima,
    kpool_topk_triton,
    select_from_scores_triton,
)

P = 4
MMA_PEAK = 778e12  # the H200's dense bf16 matmul rate (docs/benchmarks.md, MFU)
GIB = 1 << 30


class Dev:
    """CUDA (events, allocator peaks) or, for the smoke run, the CPU (wall clock, no peaks)."""

    def __init__(self, cpu: bool):
        self.cpu = cpu
        self.name = "cpu" if cpu else "cuda"

    def sync(self):
        if not self.cpu:
            torch.cuda.synchronize()

    def first_call(self, fn):
        """Run fn once (compiles, warms up): (output, wall seconds, peak GiB above what was live)."""
        self.sync()
        if not self.cpu:
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        sec = time.perf_counter() - t0
        peak = None if self.cpu else (torch.cuda.max_memory_allocated() - base) / GIB
        return out, sec, peak

    def time_ms(self, fn, first_s: float, warmup: int, reps: int) -> tuple[float, int]:
        """Median ms; slow calls (> 2 s once warm) get one rep and no extra warm-up. A first call over 2 s
        (compiling) is followed by one more to see whether the call itself is slow."""
        if first_s > 2.0:
            t0 = time.perf_counter()
            fn()
            self.sync()
            if time.perf_counter() - t0 > 2.0:
                warmup, reps = 0, 1
        if self.cpu:
            ms = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                ms.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(ms), reps
        return timed(fn, warmup, reps), reps

    def free(self):
        if not self.cpu:
            torch.cuda.empty_cache()


def pairs(S: int) -> int:
    """Causal (query, pool) pairs: query t sees (t+1)//P complete pools."""
    t = torch.arange(S, dtype=torch.float64)
    return int(((t + 1) // P).sum())


def floor_ms(S: int, H: int, D: int) -> float:
    """The scoring matmul's flops, 2*H*D*S*(S/P)/2 (causal), at the bf16 MMA rate."""
    return 2.0 * H * D * S * (S / P) / 2 / MMA_PEAK * 1e3


def inputs(S, H, D, dev: Dev, seed=0):
    g = torch.Generator(device=dev.name).manual_seed(seed)
    q = (torch.randn(1, S, H, D, device=dev.name, generator=g) * D**-0.5).to(torch.bfloat16)
    w = torch.randn(1, S, H, device=dev.name, generator=g) * H**-0.5
    pk = torch.randn(1, S // P, D, device=dev.name, generator=g).to(torch.bfloat16)
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


def run_impl(fn, S, H, D, dev: Dev, warmup, reps) -> tuple[dict, torch.Tensor | None]:
    """Time one implementation: {ms, peak_gib, floor ratio, ...} or {"oom": True}; plus its output."""
    try:
        out, first_s, peak = dev.first_call(fn)
        ms, n = dev.time_ms(fn, first_s, warmup, reps)
    except torch.cuda.OutOfMemoryError as e:
        dev.free()
        return {"oom": True, "error": str(e).split("\n")[0][:200]}, None
    fl = floor_ms(S, H, D)
    res = {"ms": ms, "reps": n, "first_call_s": first_s, "peak_gib": peak, "floor_ms": fl, "x_floor": ms / fl,
           "tflops_single_sweep": pairs(S) * 2 * H * D / ms / 1e9}
    return res, out


def two_phase_probe(S, H, D, K, dev, chunk=1024, warmup=1, reps=3) -> dict:
    """The Triton path's parts timed on their own, per chunk of queries and its causal width (pools any of
    its queries sees): `score_mm` the bf16 scoring matmul [chunk*H, D] x [D, width] alone (cuBLAS, no ReLU
    or head sum: a lower bound for the score kernel), `topk` torch.topk(k_pools) of a random fp32
    [chunk, width] buffer (what finds each row's k-th score), `select_rows` the row kernel's whole selection
    of the same buffer (k-th score and emit; rows longer than its ROW_CAP left out), `select_by_width` the
    row kernel and topk + emit on 1,024 rows of one width each, `hbm_ms` the bytes of writing and reading
    that buffer once at 4.0 TB/s (computed)."""
    g = torch.Generator(device=dev.name).manual_seed(1)
    widths = [min(S, s0 + chunk) // P for s0 in range(0, S, chunk)]
    wmax = max(widths)
    qm = torch.randn(chunk * H, D, device=dev.name, generator=g).to(torch.bfloat16)
    kt = torch.randn(D, wmax, device=dev.name, generator=g).to(torch.bfloat16)
    buf = torch.randn(chunk, wmax, device=dev.name, generator=g)
    ks = [min(K, n) for n in widths]

    def score_all():
        for n in widths:
            if n:
                torch.mm(qm, kt[:, :n])

    def topk_all():
        for n, k in zip(widths, ks):
            if n and k:
                torch.topk(buf[:, :n], k, dim=-1, sorted=False)

    def rows_all():
        for n, k in zip(widths, ks):
            if n and k and triton.next_power_of_2(n) <= ROW_CAP:
                select_from_scores_triton(buf[None, :, :n], k, method="rows")

    out = {"chunk": chunk, "S": S, "heads": H, "head_dim": D, "k_pools": K}
    for name, fn in (("score_mm", score_all), ("topk", topk_all), ("select_rows", rows_all)):
        _, first_s, _ = dev.first_call(fn)
        out[f"{name}_ms"], _ = dev.time_ms(fn, first_s, warmup, reps)
    # the two selections by row width (1,024 rows of one width each): where the row kernel stops winning
    out["select_by_width"] = select_by_width(K, dev, chunk, [n for n in sorted({min(wmax, 1 << e) for e in range(11, 17)})
                                                             if n >= K], warmup, reps)
    out["hbm_ms"] = 2 * 4 * sum(widths) * chunk / 4.0e12 * 1e3
    fl = floor_ms(S, H, D)
    out["floor_ms"] = fl
    out["sum_x_floor"] = (out["score_mm_ms"] + out["topk_ms"] + out["hbm_ms"]) / fl
    return out


def select_by_width(K, dev, rows, widths, warmup=1, reps=3, sweep=False) -> list[dict]:
    """Each selection method on `rows` random fp32 rows of one width each (k = K): the row kernel (rows of
    up to ROW_CAP), "compact" given the group maxima the score kernel writes (`compact_ms`; torch's
    group maxima, which the score kernel saves, timed apart as `group_maxima_ms`) with its candidates a
    row, and torch.topk's k-th score + emit. "rising" rows add a ramp over the pool ids (the best pools
    packed into the row's last groups, as a strong recency bias would), which "compact" likes least."""
    import longctx.ops.indexer.triton as tri

    defaults = tri.COMPACT_BLOCK_S, tri.COMPACT_WARPS
    g = torch.Generator(device=dev.name).manual_seed(2)
    res = []
    for n in widths:
        buf = torch.randn(1, rows, n, device=dev.name, generator=g)
        r = {"width": n, "rows": rows}

        def timed_ms(fn):
            _, first_s, _ = dev.first_call(fn)
            return dev.time_ms(fn, first_s, warmup, reps)[0]

        if triton.next_power_of_2(n) <= ROW_CAP:
            r["rows_ms"] = timed_ms(lambda: select_from_scores_triton(buf, K, method="rows"))
        group = compact_group(n, K)
        if group is not None:
            gm = group_maxima(buf, GROUP)
            r["group"] = group
            r["group_maxima_ms"] = timed_ms(lambda: group_maxima(buf, GROUP))
            r["compact_ms"] = timed_ms(lambda: select_from_scores_triton(buf, K, method="compact", gmax=gm))
            cnt = compact_candidates(buf, K, gm).float()
            r["candidates_mean"], r["candidates_max"] = float(cnt.mean()), int(cnt.max())
            rising = buf + torch.linspace(0, 8, n, device=dev.name)
            gm_r = group_maxima(rising, GROUP)
            r["compact_rising_ms"] = timed_ms(lambda: select_from_scores_triton(rising, K, method="compact", gmax=gm_r))
            cnt = compact_candidates(rising, K, gm_r).float()
            r["candidates_rising_mean"], r["candidates_rising_max"] = float(cnt.mean()), int(cnt.max())
            if sweep:  # the compact kernel's step and warps
                r["compact_sweep"] = []
                for block_s, warps in ((4096, 4), (8192, 8), (16384, 8), (16384, 16)):
                    tri.COMPACT_BLOCK_S, tri.COMPACT_WARPS = block_s, warps
                    ms = timed_ms(lambda: select_from_scores_triton(buf, K, method="compact", gmax=gm))
                    r["compact_sweep"].append({"block_s": block_s, "warps": warps, "ms": ms})
                tri.COMPACT_BLOCK_S, tri.COMPACT_WARPS = defaults
            del rising, gm_r, gm
        r["topk_ms"] = timed_ms(lambda: select_from_scores_triton(buf, K, method="topk"))
        print(json.dumps(r), flush=True)
        res.append(r)
        del buf
        dev.free()
    return res


def gpu_time(fn, out, S, H, D, reps) -> dict:
    """The GPU's own time for fn, without the host's: `graph_ms`, fn captured once in a CUDA graph and
    replayed (its kernels and the gaps between them; eager timing also counts the host's launches wherever
    the GPU waits for them), checked to give `out`;
    `kernels_ms`, the sum of its kernels' times under the profiler, by kernel."""
    fl = floor_ms(S, H, D)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out = fn()
        graph.replay()
        torch.cuda.synchronize()
        ms = timed(graph.replay, 1, reps)
        res = {"graph_ms": ms, "graph_x_floor": ms / fl, "graph_same_ids": bool(torch.equal(g_out, out))}
        del graph, g_out
    except RuntimeError as e:  # recorded, so that the eager figures of the run still come back
        res = {"graph_error": str(e).split("\n")[0][:200]}
    kernels = kernel_times(fn)
    return {**res, "kernels_ms": sum(kernels.values()), "kernels_x_floor": sum(kernels.values()) / fl, "by_kernel": kernels}


def two_phase_case(S, H, D, K, dev, warmup, reps, chunk=1024, cfg=None, select="triton", gpu=False):
    """The Triton path (score kernel into an fp32 [chunk, pools] buffer, then `select`: "triton", the row
    kernel that finds the k-th score and emits from one read of the row; "topk", torch.topk's k-th score
    and the emit kernel): its timing, its output and its inputs; `gpu`: also its GPU time (`gpu_time`)."""
    q, w, pk = inputs(S, H, D, dev)
    fn = lambda: kpool_topk_triton(q, w, pk, P, K, chunk=chunk, cfg=cfg, select=select)  # noqa: E731
    res, out = run_impl(fn, S, H, D, dev, warmup, reps)
    res.update(chunk=chunk, select=select)
    if gpu and out is not None and not dev.cpu:
        res.update(gpu_time(fn, out, S, H, D, reps))
    return res, out, (q, w, pk)


def torch_case(S, H, D, K, chunk, dev, warmup, reps):
    q, w, pk = inputs(S, H, D, dev)
    res, out = run_impl(lambda: kpool_topk_torch(q, w, pk, P, K, chunk=chunk), S, H, D, dev, warmup, reps)
    dev.free()
    return res, out


SWEEP = [  # overrides of the score kernel's tile config (ops/indexer/triton.py `_cfg`)
    {},
    {"TILES": 4},
    {"TILES": 16},
    {"BLOCK_N": 128, "num_warps": 8},
    {"BLOCK_N": 128, "num_warps": 8, "maxnreg": 128},
    {"BLOCK_M": 16},
    {"num_stages": 3},
    {"num_warps": 8},
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--quick", action="store_true", help="S in {32k, 128k}, fewer reps")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU, the kernels interpreted")
    ap.add_argument("--seqlens", default="8192,32768,131072,524288,1048576")
    ap.add_argument("--heads", default="16x64", help="HxD list; 16x64 is h200-ref's indexer, 32x128 the large one")
    ap.add_argument("--topk", type=int, default=2048, help="tokens kept per query (pools of 4)")
    ap.add_argument("--torch-max", type=int, default=131072, help="largest S for the chunked torch twin")
    ap.add_argument("--unchunked-max", type=int, default=131072, help="largest S to try the unchunked twin at")
    ap.add_argument("--budget-s", type=float, default=120.0, help="skip cases projected to end after this")
    ap.add_argument("--sweep", action="store_true", help="the score kernel's tile configs (16x64) at --sweep-seqlens")
    ap.add_argument("--sweep-seqlens", default="32768,131072", type=lambda v: [int(x) for x in v.split(",")])
    ap.add_argument("--probe", action="store_true",
                    help="time the Triton path's parts (scoring matmul, torch.topk) at each S, 16x64")
    ap.add_argument("--select-widths", default="",
                    help="comma list of row widths (pools): each selection method on 1,024 rows of each")
    ap.add_argument("--compact-sweep", action="store_true", help="with --select-widths: the compact kernel's configs")
    args = ap.parse_args()

    dev = Dev(args.cpu_smoke)
    if args.cpu_smoke:
        seqlens, heads, K, warmup, reps = [48, 101], [(4, 16)], 4, 0, 1
        args.torch_max = args.unchunked_max = 1 << 30
    else:
        if not torch.cuda.is_available():
            sys.exit("bench/indexer.py needs a CUDA GPU (or --cpu-smoke)")
        seqlens = [32768, 131072] if args.quick else [int(s) for s in args.seqlens.split(",")]
        heads = [tuple(int(v) for v in h.split("x")) for h in args.heads.split(",")]
        K = args.topk // P
        warmup, reps = (1, 3) if args.quick else (1, 5)
    t_start = time.perf_counter()
    results = {
        **env_record("cpu (TRITON_INTERPRET=1 smoke)" if dev.cpu else None),
        "problem": {"pool": P, "k_pools": K, "topk_tokens": K * P, "dtype": "bf16 q/pk, fp32 w", "batch": 1},
        "floor_note": f"scoring matmul 2*H*D*S*(S/P)/2 flops at {MMA_PEAK:.0f} flop/s; x_floor = ms / floor_ms",
        "timing_note": "median of reps after a warm first call (1 rep when a call takes > 2 s); peak_gib above "
                       "the inputs, from the first call",
        "cases": [],
    }

    def over_budget(last: dict | None, last_S: int, S: int, calls: int) -> str | None:
        """Projected end past the budget: the reason, else None."""
        if last is None or "ms" not in last:
            return None
        one = last["ms"] / 1e3 * (S / last_S) ** 2
        proj = one * (2 if one > 2.0 else calls)  # slow calls get one timed rep after the first
        end = time.perf_counter() - t_start + proj
        if end > args.budget_s:
            return f"skipped: projected {proj:.0f} s would end at {end:.0f} s > --budget-s {args.budget_s:.0f}"
        return None

    chunk = 32 if dev.cpu else 1024
    for H, D in heads:
        # compile the kernels first (S and NP are run-time arguments: one variant serves every S)
        qw = inputs(min(seqlens[0], 2048), H, D, dev)
        t0 = time.perf_counter()
        kpool_topk_triton(*qw, P, K, chunk=chunk)
        dev.sync()
        results.setdefault("compile_s", {})[f"{H}x{D}"] = time.perf_counter() - t0
        del qw
        unchunked_alive = True
        last = {"two_phase": (None, 0), "torch_chunk256": (None, 0), "torch_unchunked": (None, 0)}
        for S in seqlens:
            case = {"S": S, "H": H, "D": D, "pairs": pairs(S), "floor_ms": floor_ms(S, H, D)}
            skip = over_budget(*last["two_phase"], S, 1 + reps)
            kout = kin = None
            if skip:
                case["two_phase"] = skip
            else:
                case["two_phase"], kout, kin = two_phase_case(S, H, D, K, dev, warmup, reps, chunk=chunk, gpu=True)
                last["two_phase"] = (case["two_phase"], S)
                # the same path with torch.topk's k-th score and the two-read emit kernel, in the same run
                case["two_phase_topk"], tk_out, _ = two_phase_case(S, H, D, K, dev, warmup, reps, chunk=chunk,
                                                                   select="topk")
                if kout is not None and tk_out is not None:
                    case["two_phase_topk"]["rows_differ_from_two_phase"] = int((tk_out != kout).any(-1).sum())
                del tk_out
                if triton.next_power_of_2(S // P) <= ROW_CAP:  # every row through the row kernel
                    case["two_phase_rows"], r_out, _ = two_phase_case(S, H, D, K, dev, warmup, reps, chunk=chunk,
                                                                      select="rows")
                    if kout is not None and r_out is not None:
                        case["two_phase_rows"]["rows_differ_from_two_phase"] = int((r_out != kout).any(-1).sum())
                    del r_out
            if S > args.torch_max:
                case["torch_chunk256"] = f"skipped: S > --torch-max {args.torch_max}"
            elif skip := over_budget(*last["torch_chunk256"], S, 1 + reps):
                case["torch_chunk256"] = skip
            else:
                case["torch_chunk256"], tout = torch_case(S, H, D, K, 256, dev, warmup, reps)
                last["torch_chunk256"] = (case["torch_chunk256"], S)
                if kout is not None and tout is not None:
                    case["two_phase"]["check_vs_chunked"] = agreement(kout, tout, *kin)
                del tout
            if not unchunked_alive:
                case["torch_unchunked"] = "skipped: out of memory at a smaller S"
            elif S > args.unchunked_max:
                case["torch_unchunked"] = f"skipped: S > --unchunked-max {args.unchunked_max}"
            elif skip := over_budget(*last["torch_unchunked"], S, 1 + reps):
                case["torch_unchunked"] = skip
            else:
                case["torch_unchunked"], _ = torch_case(S, H, D, K, None, dev, warmup, reps)
                last["torch_unchunked"] = (case["torch_unchunked"], S)
                unchunked_alive = not case["torch_unchunked"].get("oom", False)
            del kout, kin
            dev.free()
            case["elapsed_s"] = time.perf_counter() - t_start
            print(json.dumps(case), flush=True)
            results["cases"].append(case)
    if args.sweep and not dev.cpu:
        results["sweep"] = []
        for S in args.sweep_seqlens:
            for cfg in SWEEP:
                try:
                    r, _, _ = two_phase_case(S, 16, 64, K, dev, warmup, reps, chunk=chunk, cfg=cfg)
                except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is a result too
                    r = {"error": repr(e)[:300]}
                r.update(S=S, override=cfg)
                print(json.dumps(r), flush=True)
                results["sweep"].append(r)
    if args.select_widths and not dev.cpu:
        results["select_by_width"] = select_by_width(K, dev, chunk, [int(n) for n in args.select_widths.split(",")],
                                                     warmup, reps, sweep=args.compact_sweep)
    if args.probe:
        results["two_phase_probe"] = []
        for S in seqlens:
            r = two_phase_probe(S, *heads[0], K, dev, chunk=chunk, **({"warmup": warmup, "reps": reps} if dev.cpu else {}))
            dev.free()  # its buffers went with the call
            print(json.dumps(r), flush=True)
            results["two_phase_probe"].append(r)
    results["total_s"] = time.perf_counter() - t_start
    write_results(args.out, "indexer_cpu_smoke.json" if dev.cpu else "indexer.json", results)


if __name__ == "__main__":
    main()
