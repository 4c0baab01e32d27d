"""Benchmark: the MoE router's fp32 logits from bf16 tokens, forward + backward, the fp32 twin (x cast to
fp32) against the split-weight bf16 matmuls (`kernels.router = "bf16x3"`), one GPU.

    python bench/router.py --out DIR [--tokens 131072]
    python bench/router.py --cpu-smoke --out DIR     # a few tokens on the CPU (the bf16 matmuls emulated)

Shapes: h200-ref's router (hidden 1536, 32 experts) and GLM-5.3-Flash's (4096, 288); x bf16 [tokens,
hidden] with its gradient, the fp32 weight with its gradient, an fp32 upstream gradient of the logits.
Times are CUDA-event medians of forward alone and of forward + backward, and on the GPU the forward +
backward's kernels summed under the profiler (`fwd_bwd_kernels_ms`: the GPU's own time, without the gaps
where it waits for the host's launches, which the events count for an op this short); the relative RMS of each path's
logits and gradients against fp64 is recorded beside them. Writes DIR/router.json (router_cpu_smoke.json).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import env_record, kernel_times, timed, write_results  # bench/ is on sys.path when run as a script

from longctx.ops.router.bf16x3 import router_logits_bf16x3
from longctx.ops.router.naive import router_logits_torch

IMPLS = {"torch": router_logits_torch, "bf16x3": router_logits_bf16x3}
SHAPES = {"h200-ref": (1536, 32), "glm-5.3-flash": (4096, 288)}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def case(t: int, hidden: int, E: int, device: str, reps: int) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(t, hidden, device=device, generator=g).bfloat16().requires_grad_(True)
    w = (torch.randn(E, hidden, device=device, generator=g) * 0.02).requires_grad_(True)
    dy = torch.randn(t, E, device=device, generator=g)
    xd, wd, dyd = x.detach().double(), w.detach().double(), dy.double()
    ref = {"y": xd @ wd.t(), "dx": dyd @ wd, "dw": dyd.t() @ xd}
    out = {}
    for name, fn in IMPLS.items():
        def fwd():
            with torch.no_grad():
                fn(x, w)

        def fwd_bwd():
            x.grad = w.grad = None
            fn(x, w).backward(dy)

        r = {"fwd_ms": timed(fwd, 2, reps, device), "fwd_bwd_ms": timed(fwd_bwd, 2, reps, device)}
        if device == "cuda":  # the GPU's own time: the per-call events above also count launch gaps
            r["fwd_bwd_kernels_ms"] = sum(kernel_times(fwd_bwd, reps).values())
        y = fn(x, w)
        x.grad = w.grad = None
        y.backward(dy)
        r["rel_rms_vs_fp64"] = {"y": _rel(y, ref["y"]), "dx": _rel(x.grad, ref["dx"]), "dw": _rel(w.grad, ref["dw"])}
        out[name] = r
    out["speedup_fwd_bwd"] = out["torch"]["fwd_bwd_ms"] / out["bf16x3"]["fwd_bwd_ms"]
    if device == "cuda":
        out["speedup_fwd_bwd_kernels"] = out["torch"]["fwd_bwd_kernels_ms"] / out["bf16x3"]["fwd_bwd_kernels_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args()
    device = "cpu" if a.cpu_smoke else "cuda"
    t = 64 if a.cpu_smoke else a.tokens
    res = {**env_record(), "tokens": t, "timing_note": "median of reps after 2 warm-up calls; fwd under no_grad; "
           "fwd_bwd_kernels_ms: the kernels' time per call under the profiler, over reps calls",
           "cases": {}}
    for name, (hidden, E) in SHAPES.items():
        res["cases"][name] = {"hidden": hidden, "experts": E, **case(t, hidden, E, device, 2 if a.cpu_smoke else a.reps)}
        c = res["cases"][name]
        print(f"{name}: torch {c['torch']['fwd_bwd_ms']:.3f} ms, bf16x3 {c['bf16x3']['fwd_bwd_ms']:.3f} ms "
              f"(fwd {c['torch']['fwd_ms']:.3f} / {c['bf16x3']['fwd_ms']:.3f}), {c['speedup_fwd_bwd']:.2f}x"
              + (f"; kernels {c['torch']['fwd_bwd_kernels_ms']:.3f} / {c['bf16x3']['fwd_bwd_kernels_ms']:.3f} ms, "
                 f"{c['speedup_fwd_bwd_kernels']:.2f}x" if "speedup_fwd_bwd_kernels" in c else ""), flush=True)
    print(write_results(a.out, "router_cpu_smoke.json" if a.cpu_smoke else "router.json", res))


if __name__ == "__main__":
    main()
