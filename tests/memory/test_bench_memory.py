"""bench/memory.py, the GPU benchmark of the memory switches, run the way a user runs it (a subprocess),
at tiny sizes on the CPU with `--cpu-smoke`: every part and code path, the JSON it writes, --resume,
--peak and --plan."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "memory.py"

# A kernel fault at 1,024 tokens, injected into the package (every step goes through one of these two)
# before the script runs as __main__, as `python bench/memory.py` would run it.
FAULT_AT_1024 = """
import runpy, sys, torch
from longctx.memory.sequence_chunks import SequenceChunker
from longctx.model import LongCtxModel

def faulting(real):
    def run(self, *args, **kwargs):
        ids = next(a for a in args if isinstance(a, torch.Tensor))
        if ids.shape[-1] >= 1024:
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        return real(self, *args, **kwargs)
    return run

LongCtxModel.forward = faulting(LongCtxModel.forward)
SequenceChunker.forward_backward = faulting(SequenceChunker.forward_backward)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def bench(*argv, fault: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *(["-c", FAULT_AT_1024] if fault else []), str(SCRIPT), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)


def exits_0(r: subprocess.CompletedProcess) -> bool:
    assert r.returncode == 0, r.stderr[-3000:]
    return True


def test_bench_memory_cpu_smoke(tmp_path):
    # the flag's own lengths (256, 1024) with one switch off: every part and code path in a dozen steps
    argv = ["--cpu-smoke", "--out", str(tmp_path), "--quiet", "--configs", "recompute_off",
            "--host-steps", "2"]
    assert exits_0(bench(*argv))
    res = json.loads((tmp_path / "memory.json").read_text())
    assert (tmp_path / "memory.png").stat().st_size > 1000
    assert res["device"] == "cpu" and res["preset"] == "tiny" and res["command"] and res["date"]
    runs = res["runs"]
    names = {r["config"] for r in runs}
    assert names == {"all_on", "recompute_off"}
    assert {r["seq_len"] for r in runs} == {256, 1024}
    ok = [r for r in runs if r["status"] == "ok"]
    assert ok and all(r["peak_allocated_gib"] > 0 and r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["mfu"] > 0
                      and r["estimate_gib"] > 0 for r in ok)
    assert any(r["status"] == "oom" for r in runs)  # the smoke capacity makes the plain configs run out
    assert any(r["status"] == "same_as_all_on" for r in runs)  # 256 tokens fit without recompute
    assert all(r["status"] in ("ok", "oom", "same_as_all_on", "skipped_after_oom") for r in runs)
    bl = res["baseline_max_context"]
    assert bl["max_ok"] is not None and bl["attempts"][-1]["status"] == "oom"
    off = res["offload_pinned_vs_pageable"]
    assert off["pinned"]["status"] == "ok" and off["pageable"]["status"] == "ok"
    assert off["pinned"]["offloaded_gib"] > 0  # the smoke forces the offloader to copy CPU tensors
    assert set(off["step_over_no_offload"]) == {"pinned", "pinned_kept", "pageable"}
    host = res["host_memory_with_offload"]
    assert len(host["rss_gib"]) == host["steps"] == 2 and host["status"] == "ok"
    # a second invocation with --resume keeps what is there and measures nothing again
    before = json.loads((tmp_path / "memory.json").read_text())
    assert exits_0(bench(*argv, "--resume", "--parts", "runs"))
    after = json.loads((tmp_path / "memory.json").read_text())
    assert after["runs"] == before["runs"] and after["baseline_max_context"] == bl
    # the peak timeline of one offloaded step: where its maximum was reached, counted by LiveBytes here
    assert exits_0(bench(*argv, "--resume", "--parts", "none", "--no-warmup", "--peak", "1024:offload_all"))
    pk = json.loads((tmp_path / "memory.json").read_text())["peaks"]["1024:offload_all"]
    labels = [m[0] for m in pk["marks"]]
    assert "fwd start layers.0" in labels and "recompute start layers.0.mixer" in labels and "bwd end layers.0" in labels
    assert pk["peak_between"][1] in labels and abs(max(m[2] for m in pk["marks"]) - pk["peak_allocated_gib"]) < 1e-3
    assert "reached after" in (tmp_path / "peak_1024_offload_all.txt").read_text()
    # each phase's own peak (the counter restarts at every mark), beside the estimate's phase of that name
    ph = pk["phases_gib"]
    assert abs(max(ph.values()) - pk["peak_allocated_gib"]) < 1e-6 and "the backward of layer 0 (K)" in ph
    assert "the backward of layer 0 (K)" in (tmp_path / "peak_1024_offload_all.txt").read_text().split("phase")[-1]
    # --plan fixes settings before the automatic plan resolves the rest (e.g. a whole-sequence 512k step's)
    fixed = tmp_path / "fixed"
    assert exits_0(bench("--cpu-smoke", "--out", str(fixed), "--quiet", "--parts", "runs", "--seqlens", "256",
                    "--no-warmup", "--plan", "recompute=on", "offload=1", "reuse_attention=false"))
    plan = json.loads((fixed / "memory.json").read_text())["runs"][0]["plan"]
    assert (plan["recompute"], plan["offload"], plan["reuse_attention"]) == ("on", "1", False)
    for bad, needle in (("recompte=on", "memory.recompte"), ("offload", "--plan")):
        r = bench("--cpu-smoke", "--out", str(fixed), "--plan", bad)
        err = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(err) == 1 and err[0].startswith("error:") and needle in err[0], r.stderr


def test_bench_memory_records_a_cuda_error_and_stops(tmp_path):
    """A kernel fault (an illegal memory access, say) is a recorded run, "cuda_error" with its message, and
    the invocation stops there (the CUDA context is unusable), not a traceback that loses it."""
    r = bench("--cpu-smoke", "--out", str(tmp_path), "--quiet", "--parts", "runs", "--configs", "all_on,loss_chunk_off",
              "--no-warmup", fault=True)
    assert r.returncode == 1 and "illegal memory access" in r.stderr.strip().splitlines()[-1], r.stderr[-3000:]
    runs = json.loads((tmp_path / "memory.json").read_text())["runs"]
    assert [(r["config"], r["seq_len"], r["status"]) for r in runs][-1] == ("all_on", 1024, "cuda_error")
    assert "illegal memory access" in runs[-1]["error"] and all(r["status"] != "cuda_error" for r in runs[:-1])
