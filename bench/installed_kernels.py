"""Benchmark: installed DSA kernels beside ours (issue 27), one GPU, one run.

    python bench/installed_kernels.py --out DIR [--quick] [--seqlens 32768,131072] [--heads 16,64]

Candidates, each run where it can be and otherwise recorded with the reason it cannot:

- FlashMLA's sparse prefill forward as SGLang packages it (`sgl-flash-mla`): the frozen SM90 kernels
  (`use_legacy=True`) take bf16 q [S, 64 or 128 heads, 512 or 576], one shared latent [S, 1, D] and
  int32 indices [S, 1, topk] with topk a multiple of 128 (the kernel walks two 64-slot blocks per step;
  -1 marks an unused slot). So our 16 heads are zero-padded to 64 and the 2,051 slots to 2,176.
  Forward only: its (o, lse) also feed our Triton backward, checked against the Triton pair.
- cuDNN frontend's DSA kernels (`nvidia-cudnn-frontend`, `cudnn.deepseek_sparse_attention`): CuTe DSL
  kernels, not cuDNN graph ops, so they need `nvidia-cutlass-dsl[cu13]` at run time. Its forward is
  SM100-only in 1.32; its backward and its radix top-k run on SM90. Tried only if importable.
- Static entries for what no run here can load or carry (sgl-kernel, sglang-kernel, the cuDNN
  frontend with its CuTe DSL runtime, FlashMLA's sparse decode).

Each runnable candidate is compared by relative error with the fp32 torch twin
(`longctx.ops.sparse_attention.naive`) on a sample of query rows of the same inputs, and timed with
CUDA events (warm-up, median) beside our Triton kernel on the same tensors. Problem as in
bench/sparse_attention.py: q [1,S,H,512] bf16, kv [1,S,512], K=2051 causal pool indices.

Wheels (the GPU machine has no network): on a CPU machine, once,
    ../shared/gpu/fetch-wheels.sh sgl-flash-mla==1.0.0
which adds sgl_flash_mla-1.0.0 (9.9 MB, torch stable ABI, libcudart.so.13) to the git-ignored .whl/;
the machine installs .whl/*.whl with --no-deps (its Requires-Dist says torch>=2.14.1; the stable ABI
is what decides whether torch 2.11 loads it, and this script records what happens).
Writes DIR/installed_kernels.json.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import env_record, timed, write_results  # bench/ is on sys.path when run as a script

from longctx.ops.sparse_attention import triton as tk
from longctx.ops.sparse_attention.naive import causal_pool_indices, sparse_attention_torch

D, K = 512, 2051
FLASHMLA_HEADS = (64, 128)  # the only head counts its SM90 sparse prefill dispatches
FLASHMLA_TOPK_MULTIPLE = 128
REL_OK = 5e-3  # the bound tests/ops/test_sparse_attention_gpu.py holds our bf16 kernel to
GRAD_OK = 2e-2

# What cannot be loaded on the GPU machine (torch 2.11.0+cu130, no network, 64 MiB carried), with why.
NOT_LOADABLE = {
    "sgl-kernel 0.3.21 (flash_mla ops)": (
        "wheel 536 MB; built against torch==2.9.1's C++ ABI (at::/c10:: symbols) and CUDA 12 "
        "(libcudart.so.12, libnvrtc.so.12): neither the carry limit nor torch 2.11 cu130 takes it"),
    "sglang-kernel 0.4.10 (flash_mla ops)": (
        "wheel 373 MB (its flashmla_ops.abi3.so alone is 24.7 MB) and pinned to torch==2.14.1; "
        "sgl-flash-mla is SGLang's standalone packaging of the same kernels and is tried instead"),
    "tokenspeed-flashmla 1.0.0.post20260924": "wheel 38 MB, over the ~20 MiB left for new wheels",
    "nvidia-cudnn-frontend 1.32.0 DSA kernels": (
        "not carried: CuTe DSL kernels compiled at run time by nvidia-cutlass-dsl[cu13] 4.8, whose libs-cu13 "
        "wheel is 92 MB (its MLIR compiler library is 193 MB, 52 MB even under xz -6), plus the frontend "
        "(11.6 MB) and apache-tvm-ffi (3.3 MB): past the 64 MiB a run carries. In 1.32 its sparse forward "
        "refuses SM90 (SM100 only, 64/128 heads); its backward (SM90, D 512/576) and radix top-k (SM90, "
        "k <= 2048) would run, and this script tries them when the packages are importable"),
    "FlashMLA sparse decode (flash_mla_with_kvcache with indices)": (
        "decoding kernel: FP8-quantized KV cache in its own 656-byte V3.2 layout, a few queries per "
        "sequence with split-KV scheduling, forward only; not the bf16 training forward measured here"),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _err(e: BaseException) -> str:
    """One line for the JSON: the exception and where it came from."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}: {str(e)[:400]}{where}"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_rows(S: int, n: int = 128) -> torch.Tensor:
    """Query rows the fp32 twin checks: the first n (short prefixes, -1 slots), n spread over the middle
    and the last n (full index lists, the largest kv offsets). The twin over every row of 128k x 64
    heads would take minutes; these rows cover each regime."""
    rows = torch.cat([torch.arange(min(n, S)), torch.linspace(0, S - 1, n).long(), torch.arange(max(0, S - n), S)])
    return torch.unique(rows).cuda()


def twin_on_rows(q, kv, idx, scale, rows):
    """fp32 torch twin (o, lse) for the query rows `rows` of the same inputs."""
    o, lse = sparse_attention_torch(q[:, rows].float(), kv.float(), idx[:, rows], scale, chunk=32, return_lse=True)
    return o, lse


def make_case(S: int, H: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(1, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = causal_pool_indices(S, K, generator=g)[None]
    return q, kv, idx


def fwd_flops(S: int, H: int) -> float:
    """Nominal useful flops of the forward (as bench/sparse_attention.py counts them): K slots, H heads."""
    return 2.0 * K * H * (D + D) * S


# --- FlashMLA (sgl-flash-mla) ---------------------------------------------------------------------------

def flashmla_load() -> dict:
    """Import flash_mla and say which of its two extensions loaded (the SM90 kernels live in the legacy one)."""
    import flash_mla
    from flash_mla import _loader

    info = {"version": getattr(flash_mla, "__version__", None), "dist": _version("sgl-flash-mla"),
            "legacy_loaded": bool(_loader.has_legacy())}
    if not info["legacy_loaded"]:
        info["legacy_error"] = str(getattr(_loader, "_LEGACY_UNAVAILABLE", ""))[:400]
    return info


def flashmla_inputs(q, kv, idx):
    """Our [1,S,H,D] / [1,S,D] / [1,S,K] as FlashMLA's [S,Hp,D] / [S,1,D] / [S,1,Kp]: heads zero-padded
    to 64 or 128, slots padded with -1 to a multiple of 128 (copies only where padding is needed)."""
    B, S, H, _ = q.shape
    if B != 1:
        raise ValueError("one sequence at a time (FlashMLA's prefill is flat over tokens)")
    Hp = next((h for h in FLASHMLA_HEADS if h >= H), None)
    if Hp is None:
        raise ValueError(f"H={H}: FlashMLA's SM90 sparse prefill takes 64 or 128 heads")
    q3 = q[0] if Hp == H else F.pad(q[0], (0, 0, 0, Hp - H))
    Kp = math.ceil(idx.shape[-1] / FLASHMLA_TOPK_MULTIPLE) * FLASHMLA_TOPK_MULTIPLE
    i3 = F.pad(idx[0], (0, Kp - idx.shape[-1]), value=-1)[:, None, :]
    return q3, kv[0][:, None, :], i3, Hp, Kp


def flashmla_call(q3, kv3, i3, scale, legacy: bool):
    from flash_mla import flash_mla_sparse_fwd

    out, _max_logits, lse = flash_mla_sparse_fwd(q3, kv3, i3, scale, d_v=D, use_legacy=legacy)
    return out, lse


def flashmla_case(q, kv, idx, scale, rows, ref, warmup, reps, bwd_check):
    """Correctness against the twin on `rows`, kernel-only and padded end-to-end times; with bwd_check,
    our Triton backward from FlashMLA's (o, lse) against the same backward from ours."""
    H = q.shape[2]
    legacy = torch.cuda.get_device_capability()[0] == 9  # the current kernels are SM100-only
    q3, kv3, i3, Hp, Kp = flashmla_inputs(q, kv, idx)
    r = {"heads_run": Hp, "slots_run": Kp, "use_legacy": legacy}
    out, lse = flashmla_call(q3, kv3, i3, scale, legacy)
    o = out[:, :H][None]
    lse = lse[:, :H][None]
    r["rel_err_o"] = _rel(o[:, rows], ref[0])
    r["rel_err_lse"] = _rel(lse[:, rows], ref[1])
    r["correct"] = r["rel_err_o"] <= REL_OK and r["rel_err_lse"] <= REL_OK
    r["kernel_ms"] = timed(lambda: flashmla_call(q3, kv3, i3, scale, legacy), warmup, reps)

    def padded():  # what a backend would run per call: pad, kernel, slice back
        a, b, c, _, _ = flashmla_inputs(q, kv, idx)
        out_, lse_ = flashmla_call(a, b, c, scale, legacy)
        return out_[:, :H], lse_[:, :H]

    r["end_to_end_ms"] = timed(padded, warmup, reps)
    r["useful_tflops"] = fwd_flops(q.shape[1], H) / r["end_to_end_ms"] / 1e9
    if bwd_check:
        g = torch.Generator(device="cuda").manual_seed(1)
        do = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=g)
        o_t, lse_t = tk.sparse_attention_fwd(q, kv, idx, scale)
        dq_t, dkv_t = tk.sparse_attention_bwd(q, kv, idx, o_t, lse_t, do, scale)
        dq_f, dkv_f = tk.sparse_attention_bwd(q, kv, idx, o, lse.contiguous(), do, scale)
        r["triton_bwd_from_flashmla"] = {"rel_dq_vs_triton_pair": _rel(dq_f, dq_t),
                                         "rel_dkv_vs_triton_pair": _rel(dkv_f, dkv_t)}
        del do, o_t, lse_t, dq_t, dkv_t, dq_f, dkv_f
    return r


# --- cuDNN frontend DSA ---------------------------------------------------------------------------------

def cudnn_load() -> tuple[dict, object]:
    """Import the frontend and its DSA module; touching a wrapper imports the CuTe DSL (cutlass) it needs."""
    import cudnn

    info = {"version": getattr(cudnn, "__version__", None), "dist": _version("nvidia-cudnn-frontend"),
            "cutlass_dsl": _version("nvidia-cutlass-dsl")}
    from cudnn import deepseek_sparse_attention as dsa

    dsa.sparse_attention_backward_wrapper  # noqa: B018 (the lazy import of the CuTe DSL kernels)
    return info, dsa


def cudnn_case(dsa, q, kv, idx, scale, warmup, reps):
    """Its forward (expected to refuse SM90 in 1.32) and its SM90 backward beside ours."""
    r = {}
    try:
        dsa.sparse_attention_forward_wrapper(q[0], kv[0], idx[0], softmax_scale=scale)
        r["fwd"] = "ran (not timed: this script expects the SM100-only forward of 1.32 to refuse)"
    except Exception as e:  # noqa: BLE001 - an unsupported arch or shape is a result
        r["fwd"] = "not runnable: " + _err(e)
    try:
        H = q.shape[2]
        g = torch.Generator(device="cuda").manual_seed(1)
        do = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=g)
        o, lse = tk.sparse_attention_fwd(q, kv, idx, scale)
        sink = torch.full((H,), float("-inf"), device="cuda")  # no sink: the softmax is ours
        lse2 = lse[0].contiguous()

        def run():
            res = dsa.sparse_attention_backward_wrapper(q[0], kv[0], o[0], do[0], lse2, sink, idx[0],
                                                        softmax_scale=scale)
            return res["dq"], res["dkv"]

        dq_c, dkv_c = run()
        dq_t, dkv_t = tk.sparse_attention_bwd(q, kv, idx, o, lse, do, scale)
        b = {"rel_dq_vs_triton": _rel(dq_c, dq_t[0]), "rel_dkv_vs_triton": _rel(dkv_c, dkv_t[0])}
        b["correct"] = b["rel_dq_vs_triton"] <= GRAD_OK and b["rel_dkv_vs_triton"] <= GRAD_OK
        b["ms"] = timed(run, warmup, reps)
        r["bwd"] = b
    except Exception as e:  # noqa: BLE001
        r["bwd"] = "failed: " + _err(e)
    return r


def cudnn_topk_case(dsa, S: int, warmup: int, reps: int):
    """Its radix top-k on one block of the indexer's fp32 pool scores (1,024 queries at the end of the
    sequence: the longest rows) against our selection (torch.topk's k-th score + the emit kernel), both
    with ties to the lower pool id and ascending ids, so the picks compare id for id."""
    from longctx.ops.indexer.triton import select_from_scores_triton

    P, k, c = 4, 512, 1024
    n = S // P
    t = torch.arange(S - c, S, device="cuda")
    valid = (t[:, None] + 1) // P  # complete pools visible to each query: a prefix of the columns
    g = torch.Generator(device="cuda").manual_seed(2)
    score = torch.randn(c, n, device="cuda", generator=g)
    score = score.masked_fill(torch.arange(n, device="cuda")[None, :] >= valid, float("-inf")).contiguous()
    seq_lens = valid[:, 0].to(torch.int32).contiguous()
    ours = select_from_scores_triton(score[None], k)[0]

    def run():
        return dsa.indexer_top_k_wrapper(score, seq_lens, top_k=k, return_val=False, tie_break=1,
                                         deterministic=True)["indices"]

    theirs = run()
    r = {"rows": c, "cols": n, "k": k, "rows_differing": int((theirs != ours).any(-1).sum())}
    r["correct"] = r["rows_differing"] == 0
    r["ms"] = timed(run, warmup, reps)
    r["ours_ms"] = timed(lambda: select_from_scores_triton(score[None], k), warmup, reps)
    r["speedup_vs_ours"] = r["ours_ms"] / r["ms"]
    return r


# --- the run: one child process per candidate ------------------------------------------------------------
#
# A library loaded against another torch can abort the process at load time (its op registration runs in
# static initialisation) and a kernel fault poisons the CUDA context for everything after it, so each
# candidate runs in its own process and writes its rows as it goes; the parent keeps whatever came back.

def child_triton(S, H, warmup, reps, first):
    q, kv, idx = make_case(S, H)
    scale = D**-0.5
    rows = check_rows(S)
    ref = twin_on_rows(q, kv, idx, scale, rows)
    o, lse = tk.sparse_attention_fwd(q, kv, idx, scale)
    r = {"rel_err_o": _rel(o[:, rows], ref[0]), "rel_err_lse": _rel(lse[:, rows], ref[1])}
    r["fwd_ms"] = timed(lambda: tk.sparse_attention_fwd(q, kv, idx, scale), warmup, reps)
    r["fwd_tflops"] = fwd_flops(S, H) / r["fwd_ms"] / 1e9
    if first:  # the backward beside cuDNN's (bench/sparse_attention.py times it at every S)
        do = torch.randn_like(o)
        r["bwd_ms"] = timed(lambda: tk.sparse_attention_bwd(q, kv, idx, o, lse, do, scale), warmup, reps)
    return r


def child_flashmla(S, H, warmup, reps, first):
    q, kv, idx = make_case(S, H)
    scale = D**-0.5
    rows = check_rows(S)
    ref = twin_on_rows(q, kv, idx, scale, rows)
    return flashmla_case(q, kv, idx, scale, rows, ref, warmup, reps, bwd_check=first)


def child_cudnn(S, H, warmup, reps, first, dsa=None):
    if not first:
        return "skipped: compared at the first S only (time budget)"
    q, kv, idx = make_case(S, H)
    return cudnn_case(dsa, q, kv, idx, D**-0.5, warmup, reps)


CHILDREN = {"triton": (None, child_triton), "flashmla_sparse_prefill": (flashmla_load, child_flashmla),
            "cudnn_dsa": (cudnn_load, child_cudnn)}


def run_child(name, seqlens, heads, warmup, reps, out_path):
    """Load the candidate, run every case, rewrite `out_path` after each step."""
    import json

    res = {"loaded": None, "cases": []}

    def save():
        Path(out_path).write_text(json.dumps(res))

    load, case = CHILDREN[name]
    mod = None
    if load is not None:
        try:
            got = load()
            info, mod = got if isinstance(got, tuple) else (got, None)
            res["loaded"] = {"ok": True, **info}
        except Exception as e:  # noqa: BLE001 - not installed / wrong ABI / missing dependency: that is the result
            res["loaded"] = {"ok": False, "reason": _err(e)}
            save()
            return
    save()
    for S in seqlens:
        for H in heads:
            try:
                kw = {"dsa": mod} if name == "cudnn_dsa" else {}
                r = case(S, H, warmup, reps, S == seqlens[0], **kw)
            except Exception as e:  # noqa: BLE001
                r = {"failed": _err(e)}
            print(f"{name} S={S} H={H}: {r}", flush=True)
            res["cases"].append({"S": S, "H": H, "result": r})
            save()
            torch.cuda.empty_cache()
    if name == "cudnn_dsa":
        res["indexer_top_k"] = []
        for S in seqlens:
            try:
                res["indexer_top_k"].append({"S": S, **cudnn_topk_case(mod, S, warmup, reps)})
            except Exception as e:  # noqa: BLE001
                res["indexer_top_k"].append({"S": S, "failed": _err(e)})
            save()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="S=32k only, fewer reps")
    ap.add_argument("--seqlens", default="32768,131072")
    ap.add_argument("--heads", default="16,64")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--child-timeout-s", type=int, default=170,
                    help="per candidate (three of them fit the device machine's 10-minute limit on one command)")
    args = ap.parse_args()
    seqlens = [32768] if args.quick else [int(s) for s in args.seqlens.split(",")]
    heads = [int(h) for h in args.heads.split(",")]
    warmup, reps = (1, 3) if args.quick else (2, 5)
    if args.child:
        run_child(args.child, seqlens, heads, warmup, reps, args.child_out)
        return

    import json
    import subprocess
    import tempfile

    t0 = time.perf_counter()
    res = {**env_record(), "D": D, "K": K, "cudnn_bundled_with_torch": torch.backends.cudnn.version(),
           "capability": list(torch.cuda.get_device_capability()), "check_rows": "first 128, 128 spread, last 128",
           "rel_ok": REL_OK, "grad_ok": GRAD_OK, "not_loadable": NOT_LOADABLE,
           "dists": {d: _version(d) for d in ("sgl-flash-mla", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl",
                                               "apache-tvm-ffi", "cuda-bindings", "nvidia-cudnn-cu13")},
           "candidates": {}}
    passthrough = ["--seqlens", args.seqlens, "--heads", args.heads] + (["--quick"] if args.quick else [])
    with tempfile.TemporaryDirectory() as tmp:
        for name in CHILDREN:
            path = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, __file__, "--out", tmp, "--child", name, "--child-out", str(path), *passthrough]
            t1 = time.perf_counter()
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout_s)
                rc, tail = p.returncode, (p.stdout + p.stderr)[-1500:]
            except subprocess.TimeoutExpired as e:
                rc, tail = "timeout", ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
                                       else (e.stdout or ""))[-1500:]
            got = json.loads(path.read_text()) if path.exists() else {"loaded": None, "cases": []}
            got["exit"] = rc
            got["wall_s"] = round(time.perf_counter() - t1, 1)
            if rc != 0:
                got["output_tail"] = tail
            res["candidates"][name] = got
            print(f"{name}: exit {rc}, {got['wall_s']} s", flush=True)
            print(tail if rc != 0 else json.dumps(got, indent=None)[:3000], flush=True)
    _ratios(res)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    write_results(args.out, "installed_kernels.json", res)


def _ratios(res):
    """Each candidate's speed beside ours, from the same run: ours_ms / theirs_ms (> 1: theirs is faster)."""
    ours = {(c["S"], c["H"]): c["result"] for c in res["candidates"]["triton"]["cases"]
            if isinstance(c["result"], dict)}
    for c in res["candidates"]["flashmla_sparse_prefill"].get("cases", []):
        o, r = ours.get((c["S"], c["H"]), {}), c["result"]
        if isinstance(r, dict) and "fwd_ms" in o and "end_to_end_ms" in r:
            r["speedup_vs_ours_fwd"] = o["fwd_ms"] / r["end_to_end_ms"]
            r["speedup_vs_ours_fwd_kernel_only"] = o["fwd_ms"] / r["kernel_ms"]
            r["faster"] = r.get("correct", False) and r["speedup_vs_ours_fwd"] > 1.0
    for c in res["candidates"]["cudnn_dsa"].get("cases", []):
        o, r = ours.get((c["S"], c["H"]), {}), c["result"]
        b = r.get("bwd") if isinstance(r, dict) else None
        if isinstance(b, dict) and "ms" in b and "bwd_ms" in o:
            b["speedup_vs_ours_bwd"] = o["bwd_ms"] / b["ms"]
            b["faster"] = b.get("correct", False) and b["speedup_vs_ours_bwd"] > 1.0


if __name__ == "__main__":
    main()
