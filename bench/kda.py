"""Benchmark: KDA chunked forward + backward, fla `chunk_kda` vs our plain-torch twin, one GPU.

    python bench/kda.py --out DIR [--seqlens 8192,32768,131072] [--torch-max-s 20] [--budget-s 100]
    python bench/kda.py --cpu-smoke --out DIR     # tiny S on the CPU, the torch twin only

Problem (the h200-ref KDA layer): q, k, v, g_raw [1,S,12,128] bf16 (q, k raw: the L2 norm is part
of the op), beta [1,S,12] bf16 (through its sigmoid), A_log [12] and dt_bias [12*128] fp32
parameters, the bounded gate (lower bound -5: fla's safe_gate path), chunk 64, scale 128^-1/2. The
two sides compute the same function (longctx/ops/kda/fla.py):

    fla:   fla_chunk_kda(q, k, v, g_raw, beta, A_log=, dt_bias=, lower_bound=-5, scale=)
    torch: kda_chunk(l2norm(q), l2norm(k), v, kda_gate(g_raw, A_log, dt_bias, -5), beta, scale)

Each case times forward + backward (gradients of every input and of A_log, dt_bias; an upstream
gradient for o), and the forward alone under no_grad; tokens/s = S / (fwd+bwd time); peak memory
above the inputs from the second call
(the first one compiles and autotunes fla's kernels). The torch twin runs only while its projected forward +
backward stays under --torch-max-s (it scales linearly in S); skipped cases are recorded as such.
At the first S both outputs and gradients are compared (relative RMS). Writes DIR/kda.json
(kda_cpu_smoke.json).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import env_record, timed, write_results  # bench/ is on sys.path when run as a script

from longctx.ops.kda import fla_available, fla_chunk_kda, kda_chunk, kda_gate, l2norm

H, K, LOWER_BOUND, CHUNK = 12, 128, -5.0, 64
GIB = 1 << 30


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def sync(dev: str):
    if dev == "cuda":
        torch.cuda.synchronize()


def make_inputs(S: int, dev: str, seed: int = 0) -> dict:
    g = torch.Generator(device=dev).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=dev, generator=g)
    bf = lambda x: x.to(torch.bfloat16)
    x = {"q": bf(r(1, S, H, K)), "k": bf(r(1, S, H, K)), "v": bf(r(1, S, H, K)), "g_raw": bf(r(1, S, H, K)),
         "beta": bf(torch.sigmoid(r(1, S, H))), "A_log": torch.zeros(H, device=dev), "dt_bias": 0.5 * r(H * K)}
    for t in x.values():
        t.requires_grad_()
    return x


def forward(x: dict, impl: str):
    scale = K**-0.5
    if impl == "fla":
        o, _ = fla_chunk_kda(x["q"], x["k"], x["v"], x["g_raw"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                             lower_bound=LOWER_BOUND, scale=scale, chunk_size=CHUNK)
    else:
        gate = kda_gate(x["g_raw"], x["A_log"], x["dt_bias"], LOWER_BOUND)
        o, _ = kda_chunk(l2norm(x["q"]), l2norm(x["k"]), x["v"], gate, x["beta"], scale, chunk_size=CHUNK)
    return o


def step(x: dict, impl: str, do: torch.Tensor):
    for t in x.values():
        t.grad = None
    o = forward(x, impl)
    torch.autograd.backward(o, do.to(o.dtype))
    return o


def time_ms(fn, dev: str, warmup: int, reps: int) -> float:
    return timed(fn, warmup, reps, device=dev)


def run_case(S: int, impl: str, dev: str, warmup: int, reps: int) -> tuple[dict, dict | None]:
    """{fwd_bwd_ms, fwd_ms, tokens_per_s, peak_gib, ...} or {"oom": True}; plus outputs and grads for the check."""
    x = make_inputs(S, dev)
    do = torch.randn(1, S, H, K, device=dev, generator=torch.Generator(device=dev).manual_seed(1))
    try:
        t0 = time.perf_counter()
        step(x, impl, do)  # first call: compiles (and autotunes) fla's kernels
        sync(dev)
        first_s = time.perf_counter() - t0
        if dev == "cuda":
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        o = step(x, impl, do)  # second call: the peak memory, and how slow one call is
        sync(dev)
        second_s = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated() - base) / GIB if dev == "cuda" else None
        got = {"o": o.detach(), **{"d" + n: t.grad.detach().clone() for n, t in x.items()}}
        del o
        if second_s > 5.0:  # slow (the twin at large S): that call is the measurement
            fb, reps = second_s * 1e3, 1
        else:
            fb = time_ms(lambda: step(x, impl, do), dev, warmup, reps)
        with torch.no_grad():
            fw = time_ms(lambda: forward(x, impl), dev, 0 if second_s > 5.0 else min(warmup, 1), reps)
    except torch.cuda.OutOfMemoryError as e:
        if dev == "cuda":
            torch.cuda.empty_cache()
        return {"oom": True, "error": str(e).split("\n")[0][:200]}, None
    res = {"fwd_bwd_ms": fb, "fwd_ms": fw, "bwd_ms_est": fb - fw, "tokens_per_s": S / (fb / 1e3), "peak_gib": peak,
           "first_call_s": first_s, "reps": reps}
    return res, got


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny S on the CPU, torch twin only")
    ap.add_argument("--seqlens", default="8192,32768,131072")
    ap.add_argument("--torch-max-s", type=float, default=20.0,
                    help="skip the twin where one fwd+bwd is projected above this")
    ap.add_argument("--budget-s", type=float, default=100.0, help="skip cases projected to end after this")
    args = ap.parse_args()

    if args.cpu_smoke:
        dev, seqlens, impls, warmup, reps = "cpu", [100, 192], ["torch"], 0, 1
    else:
        if not torch.cuda.is_available():
            sys.exit("bench/kda.py needs a CUDA GPU (or --cpu-smoke)")
        if not fla_available():
            sys.exit("bench/kda.py needs fla-core 0.6.0 (pip install -e .[gpu]); fla's KDA kernels are not importable")
        dev, seqlens, impls, warmup, reps = "cuda", [int(s) for s in args.seqlens.split(",")], ["fla", "torch"], 1, 5
    t_start = time.perf_counter()
    res = {
        **env_record("cpu (smoke)" if dev == "cpu" else None), "fla_core": _version("fla-core"),
        "problem": {"batch": 1, "heads": H, "head_dim": K, "gate_lower_bound": LOWER_BOUND, "chunk_size": CHUNK,
                    "dtype": "bf16 q/k/v/g_raw/beta, fp32 A_log/dt_bias", "scale": K**-0.5},
        "timing_note": "fwd+bwd: forward, then backward of o against a fixed upstream gradient (all inputs and "
                       "A_log, dt_bias get gradients); fwd: no_grad forward; median of reps after a warm-up call "
                       "and a peak-memory call (that one is the measurement when it takes > 5 s); peak_gib above "
                       "the inputs, from the peak-memory call",
        "cases": [],
    }
    last: dict[str, tuple[float, int] | None] = {i: None for i in impls}  # (fwd+bwd ms, S) of the last run
    for i, S in enumerate(seqlens):
        row = {"S": S}
        outs = {}
        for impl in impls:
            proj = None if last[impl] is None else last[impl][0] / 1e3 * S / last[impl][1]
            if impl == "torch" and proj is not None and proj > args.torch_max_s:
                row[impl] = f"skipped: projected {proj:.0f} s per fwd+bwd > --torch-max-s {args.torch_max_s:.0f}"
                continue
            n_calls = 3 + (1 if proj is not None and proj > 5 else 2 * reps)  # warm-up, peak, timed reps, fwd
            if proj is not None and time.perf_counter() - t_start + proj * n_calls > args.budget_s:
                row[impl] = f"skipped: projected {proj * n_calls:.0f} s would overrun --budget-s {args.budget_s:.0f}"
                continue
            print(f"S={S} {impl} ...", flush=True)
            row[impl], got = run_case(S, impl, dev, warmup, reps)
            if "fwd_bwd_ms" in row[impl]:
                last[impl] = (row[impl]["fwd_bwd_ms"], S)
            if i == 0 and got is not None:
                outs[impl] = got
            del got
            if dev == "cuda":
                torch.cuda.empty_cache()
        if len(outs) == 2:
            row["check_rel_rms_fla_vs_torch"] = {n: rel_rms(outs["fla"][n], outs["torch"][n]) for n in outs["torch"]}
        if isinstance(row.get("fla"), dict) and isinstance(row.get("torch"), dict) and "fwd_bwd_ms" in row["torch"] \
                and "fwd_bwd_ms" in row["fla"]:
            row["speedup_fla_vs_torch"] = row["torch"]["fwd_bwd_ms"] / row["fla"]["fwd_bwd_ms"]
        del outs
        row["elapsed_s"] = time.perf_counter() - t_start
        print(json.dumps(row), flush=True)
        res["cases"].append(row)
    res["total_s"] = time.perf_counter() - t_start
    write_results(args.out, "kda_cpu_smoke.json" if dev == "cpu" else "kda.json", res)


if __name__ == "__main__":
    main()
