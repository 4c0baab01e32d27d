"""The automatic plan (longctx.memory.planner) and `longctx estimate`: the estimate grows with the length,
the cheapest plan that fits is picked, reuse_attention is given up in the documented order, whole-sequence
steps stay within 2^31 elements per tensor, and the CLI reports, exits and errs as documented."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from longctx.config import preset
from longctx.memory.model_bytes import ALLOCATOR_SLACK, GPU_FIT, estimate
from longctx.memory.plan import MemoryPlan
from longctx.memory.planner import auto_plan, plan_choices, whole_sequence_max, whole_sequence_warning, widest_activation

ROOT = Path(__file__).resolve().parents[2]


def test_estimate_monotone_and_baseline_far_below_full_plan():
    cfg = preset("h200-ref")
    lens = [2**k for k in range(12, 22)]
    for plan in (MemoryPlan.baseline(), MemoryPlan.from_dict({"recompute": "on", "offload": "0"}),
                 MemoryPlan.from_dict({"recompute": "off", "offload": "off"})):
        gb = [estimate(cfg, s, plan)["gpu_bytes"] for s in lens]
        assert all(b > a for a, b in itertools.pairwise(gb)), (plan.describe(), gb)

    def max_len(fits):
        best, s = 0, 4096
        while s <= 2**24 and fits(s):
            best, s = s, 2 * s
        return best

    base = max_len(lambda s: estimate(cfg, s, MemoryPlan.baseline())["fits"])
    full = max_len(lambda s: auto_plan(cfg, s, MemoryPlan())[1]["fits"])
    assert 4096 <= base and full >= 8 * base, (base, full)
    # auto picks the cheapest plan that fits: no recompute at 8k, recompute (+ offload) when needed
    assert auto_plan(cfg, 8192, MemoryPlan())[0].recompute == "off"
    p, e = auto_plan(cfg, full, MemoryPlan())
    assert p.recompute in ("on", str(cfg.num_layers - 1)) and e["fits"] and e["gpu_reserved_bytes"] <= GPU_FIT * e["gpu_capacity"]
    # the estimate is of the allocated peak; the fit rule adds the allocator's slack on top
    assert abs(e["gpu_reserved_bytes"] - ALLOCATOR_SLACK * e["gpu_bytes"]) <= 1
    big = estimate(cfg, 2 * full, p)
    assert not big["fits"] and big["gpu_reserved_bytes"] > GPU_FIT * big["gpu_capacity"]


def test_plan_choices_give_up_reuse_attention_after_offload_and_before_chunking():
    """The auto plan's order: no recompute, recompute of the first 1, 2, ... L - 1 blocks (the later ones
    keeping their activations), of every block, + offload of 1, 2, ... blocks, all keeping the attention
    output; then all but the last block and every block recomputed without it (more kept blocks are given
    up before it: it buys more time per byte); then the chunk lengths, all but the last block recomputed
    inside and then every block, each with it and then without. Forced off, it stays off. At 128k on the
    H200 the estimate keeps the last four blocks."""
    cfg = preset("h200-ref")
    L = cfg.num_layers
    got = [(c.recompute, c.offload, c.seq_chunk, c.reuse_attention) for c in plan_choices(cfg, 131072, MemoryPlan())]
    partial = [(str(n), "0", "off") for n in range(1, L)]
    blocks = [("on", str(i), "off") for i in range(L + 1)]
    chunks = [(r, "0", str(c)) for c in (65536, 32768, 16384, 8192, 4096, 2048, 1024) for r in (str(L - 1), "on")]
    assert got == ([("off", "0", "off", True)] + [(*b, True) for b in partial + blocks]
                   + [(*b, False) for b in partial[-1:] + blocks] + [(*c, r) for c in chunks for r in (True, False)])
    off = plan_choices(cfg, 131072, MemoryPlan.from_dict({"reuse_attention": False}))
    assert not any(c.reuse_attention for c in off) and len(off) == 1 + len(partial) + len(blocks) + len(chunks)
    p, e = auto_plan(cfg, 131072, MemoryPlan())
    assert (p.recompute, p.offload_blocks(), p.reuse_attention) == ("8", 0, True)
    # the choice before it (7 blocks recomputed, five kept) does not fit; full recompute would
    assert not estimate(cfg, 131072, dataclasses.replace(p, recompute="7"))["fits"]
    assert estimate(cfg, 131072, dataclasses.replace(p, recompute="on"))["gpu_bytes"] < e["gpu_bytes"]
    # a forced number: offload auto moves at most that many blocks' inputs
    forced = plan_choices(cfg, 131072, MemoryPlan.from_dict({"recompute": 3, "reuse_attention": False}))
    assert [(c.recompute, c.offload) for c in forced if not c.seq_chunk_tokens()] == [("3", str(i)) for i in range(4)]


def test_auto_plan_keeps_whole_sequence_tensors_within_int32_elements():
    """Past 2^31 elements in its widest activation the whole-sequence step is not a choice (a kernel with
    int32 offsets reads and writes out of bounds there: tests/ops/test_int32_gpu.py); the chunked step is, with chunks
    within the same bound. h200-ref's widest: a dense MLP's [gate | up] and a DSA layer's absorbed queries,
    8,192 elements a token, so 262,144 tokens (measured to run) is the last whole-sequence length."""
    cfg = preset("h200-ref")
    assert widest_activation(cfg) == 8192 and whole_sequence_max(cfg) == 262144
    assert all(not c.seq_chunk_tokens() or c.seq_chunk_tokens() <= 131072 for c in plan_choices(cfg, 262144, MemoryPlan()))
    assert any(not c.seq_chunk_tokens() for c in plan_choices(cfg, 262144, MemoryPlan()))
    for S in (262145, 327680, 524288):
        choices = plan_choices(cfg, S, MemoryPlan())
        assert choices and all(0 < c.seq_chunk_tokens() <= 131072 for c in choices), S
        assert auto_plan(cfg, S, MemoryPlan())[1]["fits"]
    # split over 2 GPUs the local length is what counts; a forced whole-sequence plan is the user's
    assert any(not c.seq_chunk_tokens() for c in plan_choices(cfg, 524288, MemoryPlan(), cp=2))
    forced = plan_choices(cfg, 524288, MemoryPlan.from_dict({"seq_chunk": "off"}))
    assert forced and all(c.seq_chunk == "off" for c in forced)
    # ... and the trainer tells them (on CUDA)
    assert "memory.seq_chunk=auto" in whole_sequence_warning(cfg, 524288, forced[0])
    assert whole_sequence_warning(cfg, 262144, forced[0]) is None
    assert whole_sequence_warning(cfg, 524288, auto_plan(cfg, 524288, MemoryPlan())[0]) is None


def test_estimate_cli():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "longctx", "estimate", "--preset", "h200-ref", "--seq-len", "1048576"],
                       check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode in (0, 1), r.stderr
    for word in ("static", "kept for backward", "working set", "GPU peak", "verdict:"):
        assert word in r.stdout, r.stdout
    verdict = r.stdout.strip().splitlines()[-1]
    assert r.returncode == (0 if verdict == "verdict: fits" else 1), (r.returncode, verdict)


@pytest.mark.parametrize("argv,needle", [
    (["--seq-len", "0"], "--seq-len"),
    (["--set", "recompte=on"], "memory.recompte"), (["--set", "offload"], "--set"),
    (["--gpu", "tpu"], "--gpu"), (["--cp", "0"], "--cp"), (["--preset", "huge"], "preset"),
    (["--set", "mhc_chunk=-3"], "memory.mhc_chunk")])
def test_estimate_cli_bad_input(argv, needle, capsys):
    from longctx.cli import main

    assert main(["estimate", "--seq-len", "4096", *argv]) == 2  # what `python -m longctx` exits with
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err


def test_estimate_cli_json(capsys):
    from longctx.cli import main

    rc = main(["estimate", "--preset", "tiny", "--seq-len", "4096", "--json", "--set", "recompute=on"])
    e = json.loads(capsys.readouterr().out)
    assert rc == 0 and e["fits"] and e["plan"]["recompute"] == "on" and e["seq_len"] == 4096
    # --phases: every phase of the step with its total, the peak marked on the largest (the GPU peak)
    assert main(["estimate", "--preset", "h200-ref", "--seq-len", "1048576", "--phases"]) == 0
    text = capsys.readouterr().out
    marked = [ln for ln in text.splitlines() if ln.endswith("<- peak")]
    gpu_peak = next(ln for ln in text.splitlines() if ln.startswith("GPU peak, allocated")).split()[-1]
    assert len(marked) == 1 and marked[0].split()[-3] == gpu_peak, (marked, gpu_peak)
    assert "last chunk: the backward of layer 11 (D)" in text and "the forward sweep" in text

    def peak(*argv):
        assert main(["estimate", "--seq-len", "262144", "--json", "--set", "recompute=on", "--set", "offload=0", *argv]) == 0
        return json.loads(capsys.readouterr().out)["gpu_bytes"]

    # liger's whole-sequence mHC Functions only cost where liger runs: --kernel follows the training setting
    assert peak("--set", "mhc_chunk=0", "--kernel", "mhc=liger") > peak("--set", "mhc_chunk=0", "--kernel", "mhc=torch") \
        == peak("--kernel", "mhc=torch")


def test_auto_plan_is_the_first_choice_that_fits():
    """auto_plan skips the partial-recompute choices, unestimated, where recomputing every block does not fit
    (keeping blocks only adds bytes); the plan it returns is still the first of plan_choices that fits."""
    for name, lengths in (("h200-ref", (8192, 65536, 131072, 262144, 1048576)), ("small", (4096, 4194304))):
        cfg = preset(name)
        for S in lengths:
            first = next(c for c in plan_choices(cfg, S, MemoryPlan()) if estimate(cfg, S, c)["fits"])
            assert auto_plan(cfg, S, MemoryPlan())[0] == first, (name, S)
    # where nothing fits (GLM-5.3-Flash on one GPU) it says so with the last choice, as before
    assert not auto_plan(preset("glm-5.3-flash"), 4096, MemoryPlan())[1]["fits"]
