"""Compile the indexer's (score and selection), the sparse attention's (the backward per query, union
mode both ways), the fused RMSNorm's and SwiGLU's and the mHC projection's (ours and liger's) Triton
kernels for the H200 (sm_90) without a GPU and print what ptxas says, with the MMA and atomic instructions the PTX uses.

    python dev/compile_sm90.py

Registers per thread, spilled bytes and shared memory decide how many programs fit on an SM, and they
can be read before any device time is spent: triton compiles to PTX for a named target and its own
bundled ptxas assembles it. The configs are the defaults at h200-ref's indexer width (16 heads x 64) and, for the sparse backward,
16 heads x 512 with K = 2051 (its default loop, docs/design/sparse_attention.md).
Numbers from a real launch (`LAST_LAUNCH["n_regs"]` on the H200) can differ by a few registers: the
driver's ptxas there may be another version.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from longctx.ops.mhc import triton as mhc_project  # noqa: E402
from longctx.ops.indexer.triton import (  # noqa: E402
    _compact_kernel, _emit_from_scores_kernel, _kpool_score_kernel, _select_candidates_kernel, _select_rows_kernel,
)
from longctx.ops.indexer.triton import _cfg as score_cfg, _select_warps  # noqa: E402
from longctx.ops.rms_norm.triton import _rms_norm_bwd, _rms_norm_fwd  # noqa: E402
from longctx.ops.sparse_attention.triton import _cfg as sparse_cfg  # noqa: E402
from longctx.ops.sparse_attention.triton import _sparse_attn_bwd, _union_attn_bwd, _union_attn_fwd  # noqa: E402
from longctx.ops.swiglu.triton import BLOCK as SWIGLU_BLOCK  # noqa: E402
from longctx.ops.swiglu.triton import _swiglu_bwd, _swiglu_fwd  # noqa: E402


def _specialize(kernel, pointers: dict, consts: dict, ints: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) as a real launch specializes them: every pointer 16-byte aligned
    (torch's allocations are), and each integer argument by the launcher's own rule on its value
    (`native_specialize_impl`: 1 becomes the constant 1, a multiple of 16 gets tt.divisibility=16).
    `ints` names the values at the documented shape that are not multiples of 16; every other integer
    argument is one there. Without this the PTX holds scalar loads and atomics where the launch's
    build has vector ones (v4 loads, `atom...add.v4.f32`)."""
    sig, constexprs, attrs = {}, dict(consts), {}
    for i, n in enumerate(kernel.arg_names):
        if n in consts:
            sig[n] = "constexpr"
        elif n in pointers and pointers[n].startswith("*"):
            sig[n], attrs[(i,)] = pointers[n], [["tt.divisibility", 16]]
        elif n in pointers:  # float scalars
            sig[n] = pointers[n]
        else:
            ty, spec = native_specialize_impl(BaseBackend, ints.get(n, 16), False, True, True)
            sig[n] = ty
            if ty == "constexpr":
                constexprs[n] = spec
            elif spec == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, constexprs, attrs


def compile_one(name, kernel, pointers, consts, num_warps, num_stages=2, ints=None, maxnreg=None) -> dict:
    sig, constexprs, attrs = _specialize(kernel, pointers, consts, ints or {})
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg:  # the PTX then carries .maxnreg, which the ptxas below obeys
        options["maxnreg"] = maxnreg
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as d:
        ptx = Path(d) / "k.ptx"
        ptx.write_text(k.asm["ptx"])
        out = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(d) / "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    ops = Counter(m.split(".aligned")[0].replace(".sync", "") for m in
                  re.findall(r"(?:wgmma\.mma_async\.sync\.aligned\.\w+|mma\.sync\.aligned\.\w+|atom\.global[\w.]*add[\w.]*|red\.global\.add[\w.]*)",
                             k.asm["ptx"]))
    # instructions in the PTX (a static count: unrolled loops count every copy, branches both ways)
    n_instr = sum(1 for line in k.asm["ptx"].splitlines()
                  if line.strip() and not line.strip().startswith((".", "//", "{", "}", "$", ")"))
                  and not line.strip().endswith(":"))
    return {"kernel": name, "registers": int(regs.group(1)) if regs else None, "instructions": n_instr,
            "spill_store_bytes": int(spill.group(1)) if spill else None, "shared_bytes": k.metadata.shared,
            "wgmma": "wgmma" in k.asm["ptx"], "num_warps": num_warps, "ops": dict(ops)}


def main() -> int:
    # the score kernel at its launch config for h200-ref's indexer (16 heads x 64)
    sc = score_cfg(16, 64)
    common = dict(D=64, BLOCK_D=sc["BLOCK_D"], BLOCK_H=sc["BLOCK_H"], BLOCK_M=sc["BLOCK_M"], BLOCK_N=sc["BLOCK_N"],
                  PREC="tf32", DOT_F32=False)
    rows = [
        compile_one("indexer score (_kpool_score_kernel)", _kpool_score_kernel,
                    {"Q": "*bf16", "W": "*fp32", "PK": "*bf16", "OUT": "*fp32", "GM": "*fp32"},
                    dict(common, TILES=sc["TILES"], GROUP=16), num_warps=sc["num_warps"], num_stages=sc["num_stages"],
                    ints={"stride_wh": 1, "P": 4}, maxnreg=sc.get("maxnreg")),
        # the selections at k = 512: the row kernel on 8,192 pools, "compact" and its candidates' selection
        # on rows of up to 32,768 pools (128k tokens)
        compile_one("indexer rows (_select_rows_kernel)", _select_rows_kernel, {"SC": "*fp32", "OUT": "*i32"},
                    dict(BLOCK_N=8192, BLOCK_K=512), num_warps=_select_warps(8192)),
        compile_one("indexer compact (_compact_kernel)", _compact_kernel,
                    {"SC": "*fp32", "GM": "*fp32", "GS": "*i32", "CS": "*fp32", "CI": "*i32", "CNT": "*i32"},
                    dict(BLOCK_G=2048, BLOCK_S=8192, GP=16), num_warps=8),
        compile_one("indexer candidates (_select_candidates_kernel)", _select_candidates_kernel,
                    {"CS": "*fp32", "CI": "*i32", "CNT": "*i32", "OUT": "*i32"},
                    dict(SMALL=1024, MID=4096, BIG=8192, BLOCK_K=512), num_warps=_select_warps(8192)),
        compile_one("indexer emit (_emit_from_scores_kernel)", _emit_from_scores_kernel,
                    {"SC": "*fp32", "KTH": "*fp32", "OUT": "*i32"}, dict(BLOCK_M=4, BLOCK_N=256, BLOCK_K=128), num_warps=4),
    ]
    sparse_ptrs = {n: "*bf16" for n in ("Q", "KV", "O", "DO", "DQ")}
    sparse_ptrs.update(IDX="*i32", LSE="*fp32", DKV="*fp32", scale="fp32", qk_scale="fp32")
    sparse = dict(K=2051, D=512, BLOCK_D=512, BLOCK_H=16, PREC="tf32")
    sb = sparse_cfg(16, 512, True)
    rows += [
        compile_one("sparse bwd, heads-major (default, H=16)", _sparse_attn_bwd, sparse_ptrs,
                    dict(sparse, BLOCK_N=sb["BLOCK_N"]), sb["num_warps"], sb["num_stages"], ints={"stride_is": 2051}),
    ]
    # union mode, G = 4 queries x 16 heads = 64 rows a program, at its launch configs
    uf, ub = sparse_cfg(64, 512, False), sparse_cfg(64, 512, True)
    union_ptrs = dict(sparse_ptrs, UN="*i32", ULEN="*i32")
    union = dict(G=4, U_LOOP=-1, D=512, BLOCK_D=512, BLOCK_M=64, PREC="tf32")
    rows += [
        compile_one("sparse union fwd (G=4, H=16)", _union_attn_fwd, union_ptrs,
                    dict(union, BLOCK_N=uf["BLOCK_N"], LOOKAHEAD=uf["LOOKAHEAD"]), uf["num_warps"], uf["num_stages"],
                    ints={"U_pad": 2051}),
        compile_one("sparse union bwd (G=4, H=16)", _union_attn_bwd, union_ptrs, dict(union, BLOCK_N=ub["BLOCK_N"]),
                    ub["num_warps"], ub["num_stages"], ints={"U_pad": 2051}),
    ]
    # the fused RMSNorm at h200-ref's width (rows of 1536 in blocks of 2048, 8 warps: ops/rms_norm/triton.py _warps)
    norm_ptrs = {"X": "*bf16", "W": "*fp32", "Y": "*bf16", "DY": "*bf16", "DX": "*bf16", "RSTD": "*fp32",
                 "DW_PART": "*fp32", "eps": "fp32"}
    rows += [
        compile_one("RMSNorm fwd (bf16 x, fp32 weight)", _rms_norm_fwd, norm_ptrs, dict(BLOCK_D=2048), num_warps=8),
        compile_one("RMSNorm bwd (256 rows a program)", _rms_norm_bwd, norm_ptrs,
                    dict(ROWS=256, BLOCK_D=2048, WANT_DW=True), num_warps=8),
    ]
    # the fused clamped SwiGLU (bf16, blocks of 1024 columns, 4 warps: ops/swiglu/triton.py)
    swiglu_ptrs = {n: "*bf16" for n in ("G", "U", "Y", "DY", "DG", "DU")}
    swiglu_ptrs["limit"] = "fp32"
    rows += [
        compile_one("SwiGLU fwd (bf16)", _swiglu_fwd, swiglu_ptrs, dict(BLOCK=SWIGLU_BLOCK), num_warps=4),
        compile_one("SwiGLU bwd (bf16)", _swiglu_bwd, swiglu_ptrs, dict(BLOCK=SWIGLU_BLOCK), num_warps=4),
    ]
    # mHC's coefficient projection at h200-ref's width (K = 4 x 1536, M = 24): ours at its launch configs,
    # and liger's (what streams wider than 8 run) at its defaults, where liger-kernel is importable
    proj_ptrs = {"X": "*bf16", "PHI": "*fp32", "MIX": "*fp32", "INVR": "*fp32", "GZ": "*fp32", "FAC": "*fp32",
                 "GX": "*bf16", "GPHI": "*fp32", "HPRE": "*fp32", "GO": "*bf16", "GIN": "*bf16", "GH": "*fp32",
                 "eps": "fp32"}
    f, b, pg = mhc_project.FWD, mhc_project.BWD, mhc_project.PRE_GRAD
    bwd = dict(K=6144, D=1536, NS=4, BLOCK_N=b["BLOCK_N"], BLOCK_K=b["BLOCK_K"], BLOCK_M=32, ROW_BLOCKS=b["ROW_BLOCKS"],
               PREC="tf32")
    rows += [
        compile_one("mHC projection fwd (ours)", mhc_project._project_fwd, proj_ptrs,
                    dict(K=6144, BLOCK_N=f["BLOCK_N"], BLOCK_K=f["BLOCK_K"], BLOCK_M=32, PREC="tf32"), f["num_warps"],
                    f["num_stages"], ints={"M": 24}),
        compile_one("mHC projection bwd (ours)", mhc_project._project_bwd, proj_ptrs,
                    dict(bwd, HAS_PRE=False, HAS_IN=False), b["num_warps"], b["num_stages"], ints={"M": 24}),
        # the entering connection's backward: the collapse's and the expand's gradients of x summed in
        compile_one("mHC projection bwd + pre + expand (ours)", mhc_project._project_bwd, proj_ptrs,
                    dict(bwd, HAS_PRE=True, HAS_IN=True), b["num_warps"], b["num_stages"], ints={"M": 24}),
        compile_one("mHC pre coefficient grad (ours)", mhc_project._pre_grad, proj_ptrs,
                    dict(D=1536, NS=4, BLOCK_N=pg["BLOCK_N"], BLOCK_D=pg["BLOCK_D"], BLOCK_S=4), pg["num_warps"]),
    ]
    try:
        from liger_kernel.ops.mhc import _mhc_mm_norm_bwd_fused_kernel, _mhc_mm_norm_fwd_kernel
    except ImportError:
        print("(liger-kernel not importable: its mHC projection kernels are not compiled)")
    else:
        N, K, M = 131072, 6144, 24
        lg = dict(N=N, K=K, M=M, stride_xn=K, stride_xk=1, stride_phik=M, stride_phim=1, stride_mn=M, stride_mm=1,
                  BLOCK_N=32, BLOCK_K=256, BLOCK_M=32, CAST_FP32=True)
        lg_ptrs = {"x_ptr": "*bf16", "phi_ptr": "*fp32", "mix_ptr": "*fp32", "invr_ptr": "*fp32",
                   "grad_mix_ptr": "*fp32", "grad_x_ptr": "*bf16", "grad_phi_ptr": "*fp32"}
        rows += [
            compile_one("mHC projection fwd (liger 0.8.5)", _mhc_mm_norm_fwd_kernel, lg_ptrs, dict(lg, eps=1e-5), 4),
            compile_one("mHC projection bwd (liger 0.8.5)", _mhc_mm_norm_bwd_fused_kernel, lg_ptrs,
                        dict(lg, stride_invr=1, stride_gmn=M, stride_gmm=1, stride_gxn=K, stride_gxk=1, stride_gpk=M,
                             stride_gpm=1), 4),
        ]
    print(f"triton {triton.__version__}, target sm_90a")
    for r in rows:
        print(f"{r['kernel']:<44} {r['registers']:>4} registers  {r['spill_store_bytes']} B spilled  "
              f"{r['instructions']} PTX instructions  "
              f"{r['shared_bytes'] / 1024:.0f} KiB shared  wgmma {r['wgmma']}  ({r['num_warps']} warps)")
        print(f"{'':<44} {r['ops']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
