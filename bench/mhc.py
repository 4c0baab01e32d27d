"""Benchmark: one mHC connection (enter + exit), fwd+bwd, our torch mHC vs liger's mHC ops.

    python bench/mhc.py --out DIR [--quick] [--tokens 65536,262144]   # the connection: torch vs liger
    python bench/mhc.py --project --out DIR       # the coefficient projection alone: liger's kernels vs ours
    python bench/mhc.py --cpu-smoke --out DIR     # the torch side at tiny sizes on the CPU

h200-ref width: streams [1, S, 4, 1536] bf16, fp32 fn/base/scale, 20 Sinkhorn rounds. One step =
x, ctx = enter(streams); y = x * gain + noise (a stand-in sub-layer); out = exit(streams, ctx, y);
backward of (out * dout).sum() into the streams, the noise and the parameters. Implementations:
  torch            kernels.mhc "torch", recompute_cast on (the memory plan's default)
  torch_keep_cast  kernels.mhc "torch", recompute_cast off (the fp32 copy saved)
  liger            kernels.mhc "liger" (longctx.ops.mhc.liger; the coefficients' projection ours, for 4 streams;
                   the enter as one Function that sums the streams' gradients in its kernel, `liger_mhc_enter`)
  liger_separate   the same kernels with the enter as the separate coefficient and collapse Functions, the
                   streams' three gradients added by autograd (what the fused enter replaces)
Per case: median ms of fwd+bwd (CUDA events, after warm-up), the peak allocated above the inputs
during one step, and liger's relative RMS difference from torch on out and d_streams.
Writes DIR/mhc.json: the connection comparison under "connection", --project's under "projection",
each with its own command, date and commit; a run replaces its own part and keeps the other one
(DIR/mhc_cpu_smoke.json for --cpu-smoke).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import env_record, timed, write_results

from longctx.config import preset
from longctx.layers.residual import MHC
from longctx.ops.loss import liger as fused_loss
from longctx.ops.mhc import liger as mhc_liger

GIB = 1 << 30


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def setup(cfg, S: int, device):
    torch.manual_seed(0)
    mhc = MHC(cfg).to(device)
    with torch.no_grad():
        mhc.base.normal_(0.0, 0.5)
    n, D = cfg.hc_streams, cfg.hidden_size
    g = torch.Generator(device=device).manual_seed(1)
    streams = torch.randn(1, S, n, D, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    gain = (torch.randn(D, device=device, generator=g) * 0.5).to(torch.bfloat16)
    noise = torch.randn(1, S, D, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    dout = torch.randn(1, S, n, D, device=device, generator=g).to(torch.bfloat16)
    return mhc, streams, gain, noise, dout


def make_step(impl: str, mhc: MHC, streams, gain, noise, dout):
    mhc.kernels["mhc"] = "liger" if impl.startswith("liger") else "torch"
    mhc.recompute_cast = impl != "torch_keep_cast"
    fused = mhc_liger.fused_enter

    def step():
        streams.grad = noise.grad = None
        mhc.zero_grad(set_to_none=True)
        if impl == "liger_separate":
            mhc_liger.fused_enter = lambda streams, chunk: False
        try:
            x, ctx = mhc.enter(streams)
        finally:
            mhc_liger.fused_enter = fused
        out = mhc.exit(streams, ctx, x * gain + noise)
        out.backward(dout)
        return out.detach()

    return step


def run_gpu(args) -> dict:

    if not mhc_liger.liger_mhc_available():
        raise SystemExit(f"liger-kernel's mHC ops are not importable here ({mhc_liger.import_error()}); put "
                         "liger-kernel 0.8.5 on PYTHONPATH (pip install --no-deps --target /tmp/site liger_kernel-0.8.5-*.whl).")
    cfg = preset("h200-ref")
    tokens = [65536] if args.quick else [int(s) for s in args.tokens.split(",")]
    impls = args.impls.split(",")
    warmup, reps = (1, 3) if args.quick else (2, 5)
    res = {
        "streams": cfg.hc_streams, "hidden": cfg.hidden_size, "sinkhorn_iters": cfg.hc_sinkhorn_iters,
        "notes": "peak_extra_gib = max allocated during one fwd+bwd minus allocated before it (streams, noise, dout, "
                 "parameters); it includes the gradients.",
        "cases": [],
    }
    for S in tokens:
        row = {"tokens": S}
        ref = None
        for impl in impls:
            mhc, streams, gain, noise, dout = setup(cfg, S, "cuda")
            step = make_step(impl, mhc, streams, gain, noise, dout)
            try:
                out = step()
                torch.cuda.synchronize()
                streams.grad = noise.grad = None
                mhc.zero_grad(set_to_none=True)
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                step()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - before
                ms = timed(step, warmup, reps)
                r = {"fwd_bwd_ms": ms, "peak_extra_gib": peak / GIB, "impl": mhc.last_impl,
                     "gbytes_per_s_streams_rw": 4 * streams.numel() * 2 / ms / 1e6}
                if impl == "torch":
                    ref = (out, streams.grad.clone())
                elif ref is not None:
                    r["out_rel_rms_vs_torch"] = rel_rms(out, ref[0])
                    r["d_streams_rel_rms_vs_torch"] = rel_rms(streams.grad, ref[1])
            except torch.cuda.OutOfMemoryError as e:
                r = {"error": "oom: " + str(e)[:200]}
            row[impl] = r
            print(f"S={S} {impl}: {r}", flush=True)
            del mhc, streams, gain, noise, dout, step
            torch.cuda.empty_cache()
        t = row.get("torch", {}).get("fwd_bwd_ms")
        for impl in impls:
            if impl != "torch" and t and "fwd_bwd_ms" in row[impl]:
                row[impl]["speedup_vs_torch"] = t / row[impl]["fwd_bwd_ms"]
        res["cases"].append(row)
    return res


def run_project(args) -> dict:
    """mHC's coefficient projection alone (mix = RMSNorm(x) @ fn^T over the flattened streams, forward and
    backward) at h200-ref's width: liger's kernels (`mhc_mm_norm_fwd` / `_bwd`, what streams wider than 8
    run) against ours (longctx/ops/mhc/triton.py), median ms and the bytes each must move at
    least (forward: read x; backward: read x, write grad x), and ours' distance from liger's results."""
    from longctx.ops.mhc import triton as ours

    cfg = preset("h200-ref")
    K, M = cfg.hc_streams * cfg.hidden_size, (2 + cfg.hc_streams) * cfg.hc_streams
    res = {"K": K, "M": M,
           "ours_configs": {"fwd": ours.FWD, "bwd": ours.BWD}, "cases": []}
    for S in [int(s) for s in args.tokens.split(",")]:
        row = _project_case(S, K, M, cfg.rms_norm_eps)
        print(row, flush=True)
        res["cases"].append(row)
        torch.cuda.empty_cache()
    return res


def _project_case(S: int, K: int, M: int, eps: float) -> dict:
    from liger_kernel.ops.mhc import mhc_mm_norm_bwd, mhc_mm_norm_fwd

    from longctx.ops.mhc import triton as ours

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(S, K, device="cuda", generator=g).bfloat16()
    phi = (torch.randn(K, M, device="cuda", generator=g) * 0.02).contiguous()
    dmix = torch.randn(S, M, device="cuda", generator=g)
    lmix, linvr = mhc_mm_norm_fwd(x, phi, eps)
    omix, oinvr = ours.project_fwd(x, phi, eps)
    lgx, lgphi = mhc_mm_norm_bwd(x, phi, lmix, linvr, dmix)
    ogx, ogphi = ours.project_bwd(x, phi, omix, oinvr, dmix)
    row = {"tokens": S, "min_gbytes": {"fwd": x.numel() * 2 / 1e9, "bwd": 2 * x.numel() * 2 / 1e9},
           "ours_vs_liger_rel_rms": {"mix": rel_rms(omix, lmix), "invr": rel_rms(oinvr, linvr),
                                     "grad_x": rel_rms(ogx, lgx), "grad_fn": rel_rms(ogphi, lgphi)}}
    impls = {"liger": (lambda: mhc_mm_norm_fwd(x, phi, eps), lambda: mhc_mm_norm_bwd(x, phi, lmix, linvr, dmix)),
             "ours": (lambda: ours.project_fwd(x, phi, eps), lambda: ours.project_bwd(x, phi, omix, oinvr, dmix))}
    for name, (fwd, bwd) in impls.items():
        f_ms, b_ms = timed(fwd, 3, 20), timed(bwd, 3, 20)
        row[name] = {"fwd_ms": f_ms, "bwd_ms": b_ms, "fwd_tb_per_s": row["min_gbytes"]["fwd"] / f_ms,
                     "bwd_tb_per_s": row["min_gbytes"]["bwd"] / b_ms}
    return row


def run_cpu_smoke(args) -> dict:
    cfg = preset("tiny")
    res = {**env_record("cpu (smoke)"), "cpu_smoke": True, "cases": []}
    for S in (64, 256):
        row = {"tokens": S}
        for impl in ("torch", "torch_keep_cast"):
            mhc, streams, gain, noise, dout = setup(cfg, S, "cpu")
            step = make_step(impl, mhc, streams, gain, noise, dout)
            row[impl] = {"fwd_bwd_ms": timed(step, 1, 3, device="cpu"), "impl": mhc.last_impl}
            assert mhc.last_impl == "mhc:torch" and streams.grad is not None and mhc.fn.grad is not None
        print(row, flush=True)
        res["cases"].append(row)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="64k tokens only, fewer reps")
    ap.add_argument("--tokens", default="65536,262144")
    ap.add_argument("--impls", default="torch,torch_keep_cast,liger,liger_separate")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--project", action="store_true", help="the coefficient projection alone: liger's kernels vs ours "
                    "(--tokens, default here 65536,131072)")
    args = ap.parse_args()
    if args.project:
        if not torch.cuda.is_available() or not mhc_liger.liger_mhc_available():
            print("error: bench/mhc.py --project needs a CUDA GPU and liger-kernel (it times liger's kernels against ours).",
                  file=sys.stderr)
            sys.exit(2)
        if args.tokens == ap.get_default("tokens"):
            args.tokens = "65536,131072"
        write_part(args.out, "projection", run_project(args))
        return
    if args.cpu_smoke:
        write_results(args.out, "mhc_cpu_smoke.json", run_cpu_smoke(args))
        return
    write_part(args.out, "connection", run_gpu(args))


def write_part(out: str, part: str, body: dict) -> None:
    """OUT/mhc.json with `part` replaced: the file's head says this run's GPU and versions, the part its
    command, date and commit too (the other part, if the file has one, keeps its own)."""
    path = Path(out) / "mhc.json"
    res = json.loads(path.read_text()) if path.is_file() else {}
    env = env_record()
    res.update({k: env[k] for k in ("gpu", "torch", "triton")}, liger_kernel=fused_loss.liger_version())
    res[part] = {**env, **body}
    write_results(out, "mhc.json", res)


if __name__ == "__main__":
    main()
