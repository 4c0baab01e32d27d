"""bench/memory.py --report: merging per-call result files on the CPU (no model is run)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from longctx.config import preset
from longctx.memory.estimate import auto_plan
from longctx.memory.plan import MemoryPlan

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "bench" / "memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _header(command: str) -> dict:
    """The keys every memory.json starts with (as bench/results/memory_runs/*.json)."""
    return {"gpu": "NVIDIA H200", "device": "cuda", "capacity_gib": 139.8,
            "versions": {"python": "3.12.3", "torch": "2.11.0", "cuda": "13.0", "triton": "3.6.0", "fla": "0.6.0"},
            "command": command, "date": "2026-11-30T10:00:00+00:00", "preset": "h200-ref",
            "params": {"total": 1530025716, "active": 440030964}, "autocast": "bfloat16", "peak_tflops": 778.0,
            "model": {}, "invocations": [{"command": command, "date": "2026-11-30T10:00:00+00:00"}]}


def _run(config: str, S: int, status: str, peak: float | None = None, **extra) -> dict:
    plan = auto_plan(preset("h200-ref"), S, MemoryPlan(), 1, "h200", 2)[0]
    r = {"config": config, "seq_len": S, "plan": plan.to_dict(), "estimate_gib": 50.0, "estimate_host_gib": 0.0,
         "estimate_fits": True, "status": status}
    if status == "ok":
        r.update(peak_allocated_gib=peak, peak_reserved_gib=peak + 2, step_s=0.5, step_s_all=[0.5],
                 tokens_per_s=S / 0.5, mfu=0.05, model_tflop={"total": 20.0}, host_rss_gib=2.5, loss=10.0,
                 impl="dsa:triton x3")
    elif status == "oom":
        r.update(error="CUDA out of memory.", host_rss_gib=2.5)
    r.update(extra)
    return r


def _rows(md: str) -> dict:
    """The main table's rows: (config, tokens) -> cells."""
    rows = {}
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 12 and cells[1].replace(",", "").isdigit():
            rows[(cells[0], int(cells[1].replace(",", "")))] = cells
    return rows


def test_report_merges_later_file_wins(tmp_path, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    first = {**_header("bench/memory.py --seqlens 8192,32768"),
             "runs": [_run("all_on", 8192, "ok", 40.0), _run("all_on", 32768, "ok", 90.0),
                      _run("loss_chunk_off", 8192, "ok", 42.0)],
             "baseline_max_context": {"max_ok": 8192, "estimate_max": 16384, "attempts": [
                 {"seq_len": 8192, "estimate_gib": 60.0, "estimate_host_gib": 0.0, "estimate_fits": True,
                  "status": "ok", "peak_allocated_gib": 77.0, "peak_reserved_gib": 80.0, "step_s": 1.0},
                 {"seq_len": 16384, "estimate_gib": 100.0, "estimate_host_gib": 0.0, "estimate_fits": True,
                  "status": "oom", "error": "CUDA out of memory."}]}}
    second = {**_header("bench/memory.py --seqlens 8192"),
              "runs": [_run("all_on", 8192, "ok", 39.0, note="warm second step"),
                       _run("loss_chunk_off", 8192, "ok", 41.0, superseded="the switch did nothing"),
                       _run("sparse_kernel_off", 32768, "oom"),
                       _run("recompute_off", 8192, "same_as_all_on")],
              "host_memory_with_offload": {"seq_len": 8192, "steps": 2, "status": "ok", "rss_gib": [2.5, 2.6],
                                           "pinned_gib": [{"owned": 0.0, "active": 1.0}, {"owned": 0.0, "active": 2.0}],
                                           "step_s": [3.0, 1.0], "plan": {"offload": "12", "pin_memory": True},
                                           "offloaded_gib_per_step": 1.5, "rss_growth_gib": 0.1}}
    f1, f2 = runs / "1_first.json", runs / "2_second.json"
    f1.write_text(json.dumps(first))
    f2.write_text(json.dumps(second))
    out = tmp_path / "out"
    # given in reverse: the files are merged in the order of their names
    assert _bench().main(["--report", str(f2), str(f1), "--out", str(out)]) == 0

    res = json.loads((out / "memory.json").read_text())
    assert res["merged_from"] == ["1_first.json", "2_second.json"]
    assert [i["source"] for i in res["invocations"]] == ["1_first.json", "2_second.json"]
    by_key = {(r["config"], r["seq_len"]): r for r in res["runs"]}
    assert len(res["runs"]) == 5
    assert by_key["all_on", 8192]["peak_allocated_gib"] == 39.0  # the later file's run wins
    assert by_key["all_on", 8192]["source"] == "2_second.json"
    assert by_key["all_on", 8192]["replaces"] == ["1_first.json"]
    assert by_key["all_on", 32768]["source"] == "1_first.json"  # only in the first file: kept
    assert "superseded" in by_key["loss_chunk_off", 8192]  # superseded: kept in the JSON
    assert res["baseline_max_context"]["source"] == "1_first.json"
    assert res["host_memory_with_offload"]["source"] == "2_second.json"

    md = (out / "memory_table.md").read_text()
    assert capsys.readouterr().out.strip() == md.strip()  # the table is printed as written
    rows = _rows(md)
    assert set(rows) == {("all_on", 8192), ("recompute_off", 8192), ("all_on", 32768), ("sparse_kernel_off", 32768)}
    assert list(rows) == [("all_on", 8192), ("recompute_off", 8192), ("all_on", 32768), ("sparse_kernel_off", 32768)]
    assert rows["all_on", 8192][3] == "39.00" and rows["all_on", 8192][10] == "2"
    assert rows["all_on", 32768][3] == "90.00" and rows["all_on", 32768][10] == "1"
    assert rows["recompute_off", 8192][2] == "= all_on"
    assert rows["sparse_kernel_off", 32768][2] == "oom" and rows["sparse_kernel_off", 32768][3] == ""
    est = float(rows["all_on", 8192][5])
    assert est > 0 and rows["all_on", 8192][6] == f"{100 * (est - 39.0) / 39.0:+.1f}%"
    # the superseded run is left out of the table and listed below it, with its reason
    assert "- loss_chunk_off at 8,192 (call 2): the switch did nothing" in md
    # the note's footnote: a marker in the row, the text once below the table
    assert rows["all_on", 8192][11] == "[1]" and rows["all_on", 32768][11] == ""
    assert md.count("warm second step") == 1 and "- [1] warm second step" in md
    assert "max_ok 8,192 tokens" in md and "first 2.50 GiB, last 2.60 GiB" in md
    assert "median 2.00 s" in md
    assert "Max context, all_on / baseline: 32,768 / 8,192 = 4x" in md
    assert (out / "memory.png").stat().st_size > 1000


def test_call_labels_and_order():
    """A results file's call is its leading number plus an optional one-letter part of that call; files
    are taken in call order (10 after 9, 12_a before 12_b), whatever order they are named in."""
    bench = _bench()
    assert bench._call_number("8_offload_256k.json") == "8"
    assert bench._call_number("12_b_two_phase_128k.json") == "12b"
    assert bench._call_number("12_all_on.json") == "12" and bench._call_number("memory.json") is None
    names = ["12_b_x.json", "10_y.json", "9_z.json", "12_a_w.json", "1_v.json"]
    assert [p.name for p in sorted(map(Path, names), key=bench._call_order)] == [
        "1_v.json", "9_z.json", "10_y.json", "12_a_w.json", "12_b_x.json"]


def test_report_lists_peak_timelines_with_the_estimate_of_what_ran(tmp_path):
    """`--peak` entries are merged by key (a later file's wins) and listed with the current estimator's
    figure for the mHC path, KDA norm, RMSNorm form and mhc_chunk the step ran (a plan recorded before
    mhc_chunk existed ran liger's whole-sequence Functions)."""
    from longctx.memory.estimate import estimate

    cfg, S = preset("h200-ref"), 262144
    plan = MemoryPlan.from_dict({"recompute": "on", "offload": "0", "seq_chunk": "off"})
    old_plan = {k: v for k, v in plan.to_dict().items() if k != "mhc_chunk"}
    entry = lambda peak, p, impl: {"peak_allocated_gib": peak, "estimate_gib": 1.0, "plan": p, "impl": impl,  # noqa: E731
                                   "peak_between": ["bwd start layers.11", "bwd start layers.11.mlp"],
                                   "allocated_between_gib": [112.0, 115.0], "marks": []}
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "1_a.json").write_text(json.dumps({**_header("a"), "runs": [], "peaks": {
        f"{S}:all_on": entry(100.0, old_plan, "mhc:liger x24"), f"{S}:torch": entry(110.0, old_plan, "mhc:torch x24")}}))
    (runs / "2_b.json").write_text(json.dumps({**_header("b"), "runs": [], "peaks": {
        f"{S}:all_on": entry(129.5, old_plan, "mhc:liger x24")}}))
    out = tmp_path / "out"
    assert _bench().main(["--report", str(runs / "1_a.json"), str(runs / "2_b.json"), "--out", str(out)]) == 0
    md = (out / "memory_table.md").read_text()
    G = 2**30
    # calls 1 and 2: our KDA norm (no "+fla-norm" in the impl record) and the plain-autograd RMSNorms
    old = {"kda_norm": "torch", "plain_ops": True}
    whole = estimate(cfg, S, MemoryPlan.from_dict(dict(old_plan, mhc_chunk=0)), 1, "h200", 2, residual_impl="liger", **old)
    torch_path = estimate(cfg, S, MemoryPlan.from_dict(dict(old_plan, mhc_chunk=0)), 1, "h200", 2, residual_impl="torch",
                          **old)
    assert whole["gpu_bytes"] > torch_path["gpu_bytes"]
    assert f"| all_on | 262,144 | 129.50 | {whole['gpu_bytes'] / G:.2f} |" in md  # the later file's entry
    assert f"| torch | 262,144 | 110.00 | {torch_path['gpu_bytes'] / G:.2f} |" in md
    assert "'bwd start layers.11' .. 'bwd start layers.11.mlp' | 2 |" in md


def test_profile_copies_are_attributed_to_a_line_or_an_autograd_node():
    """--profile-stacks: each cast or copy of a profiled step is named by the innermost longctx frame
    above it (forward) or its autograd node (backward), with the op that asked for it."""
    import torch

    from longctx.model import LongCtxModel

    torch.manual_seed(0)
    m = LongCtxModel(preset("tiny"))
    ids = torch.randint(0, m.cfg.vocab_size, (1, 64))
    acts = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts, record_shapes=True, with_stack=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(ids, labels=ids)
        out.loss.backward()
    bench = _bench()
    table = bench._copies_by_line(prof.events(), limit=10_000)
    rows = table.splitlines()[1:]
    assert rows and table.startswith("copies and casts by line")
    assert any("longctx/layers/norms.py" in r for r in rows)  # _RMSNormFn's fp32 cast, in the forward
    assert any("Backward" in r for r in rows)
    assert sum(int(r.split()[2]) for r in rows) == sum(
        1 for e in prof.events() if e.name == "aten::_to_copy"
        or (e.name == "aten::copy_" and (e.cpu_parent is None or e.cpu_parent.name != "aten::_to_copy")))
    # the elementwise table: every top-level elementwise op once, each row naming its op
    ew = bench._elementwise_by_line(prof.events(), limit=10_000)
    rows = ew.splitlines()[1:]
    assert ew.startswith("elementwise ops by line") and rows and all("aten::" in r for r in rows)
    assert any("longctx/layers/" in r for r in rows) and any("Backward" in r for r in rows)
    top = [e for e in prof.events() if e.name in bench.ELEMENTWISE_OPS
           and (e.cpu_parent is None or e.cpu_parent.name not in bench.ELEMENTWISE_OPS)]
    assert sum(int(r.split()[2]) for r in rows) == len(top) > 0


def test_runs_from_before_reuse_attention_became_a_default_are_renamed_by_their_plan():
    """A run recorded as reuse_attention_on is today's all_on; a recorded all_on whose plan recomputed
    without it is today's reuse_attention_off; an all_on without recompute, and every run whose plan has
    it on, keep their names."""
    bench = _bench()
    old = MemoryPlan(reuse_attention=False)
    runs = [
        {"config": "reuse_attention_on", "seq_len": 131072, "plan": {**old.to_dict(), "recompute": "on", "reuse_attention": True}},
        {"config": "all_on", "seq_len": 131072, "plan": {**old.to_dict(), "recompute": "on"}},
        {"config": "all_on", "seq_len": 1 << 20, "plan": {**old.to_dict(), "recompute": "on", "seq_chunk": "131072"}},
        {"config": "all_on", "seq_len": 8192, "plan": {**old.to_dict(), "recompute": "off", "seq_chunk": "off"}},
        {"config": "all_on", "seq_len": 131072, "plan": {**MemoryPlan().to_dict(), "recompute": "on"}},
        {"config": "mhc_chunk_off", "seq_len": 131072, "plan": {**old.to_dict(), "recompute": "on"}},
    ]
    names = [bench._renamed_for_today(r)["config"] for r in runs]
    assert names == ["all_on", "reuse_attention_off", "reuse_attention_off", "all_on", "all_on", "mhc_chunk_off"]
    assert bench._renamed_for_today(runs[1])["recorded_as"] == "all_on" and "recorded_as" not in bench._renamed_for_today(runs[4])
