"""What a run shows while it trains: the step line (step N/total, loss, tokens/s, eta, memory first),
the `kernels:` line on the first step and on each change, metrics.jsonl keeping the report every step,
and TensorBoard: train and eval scalars read back from the event files, or one note when it is absent."""

from __future__ import annotations

import json
import os
import re
import sys
from types import SimpleNamespace

import pytest

from longctx.config.loading import load_train_config
from longctx.train.progress import NOT_INSTALLED, Eta, TensorBoard, format_duration, format_tokens, step_line
from longctx.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

STEP = re.compile(r"step (\d+)/(\d+) \| loss \d+\.\d{4} \| [\d,]+ tok/s \| eta (-|\d+:\d\d:\d\d) \| peak \d+\.\d\d GiB")


# ------------------------------------------------------------------------------ the line itself
def test_step_line_leads_with_progress_loss_speed_eta_and_memory():
    rec = {"step": 7, "total_steps": 120, "stage": 1, "seq_len": 4096, "loss": 2.25917, "grad_norm": 0.951,
           "tokens_per_s": 18147.2, "peak_gib": 1.561, "moe_max_over_mean": 1.214, "eta_s": 3725.4,
           "impl": "dsa:torch-sparse x1, kda:torch-chunk x3, loss:torch-chunked x1, mhc:torch x8, moe:loop x3"}
    line = step_line(rec)
    assert line == ("step   7/120 | loss 2.2592 | 18,147 tok/s | eta 1:02:05 | peak 1.56 GiB | stage 1 seq 4k | "
                    "gnorm 0.95 | moe 1.21")
    assert "dsa:" not in line and len(line) <= 120
    assert "| eta - |" in step_line(dict(rec, eta_s=None))
    assert "moe" not in step_line(dict(rec, moe_max_over_mean=None))


def test_step_line_shows_the_estimate_beside_the_measured_peak():
    """On CUDA each step's line carries the stage plan's estimate next to the measured peak; without
    one (the CPU: its peak is the process RSS, not the estimate's GPU bytes) the line has none."""
    import torch

    from longctx.memory.model_bytes import device_gpu_key

    rec = {"step": 3, "total_steps": 10, "stage": 1, "seq_len": 1048576, "loss": 2.5, "grad_norm": 0.9,
           "tokens_per_s": 6491.0, "peak_gib": 84.56, "moe_max_over_mean": None, "eta_s": None,
           "impl": "dsa:triton-sparse x3"}
    assert "(est" not in step_line(rec)
    line = step_line(dict(rec, estimate_gib=90.65))
    assert "peak 84.56 GiB (est 90.7) |" in line and "seq 1M" in line
    assert device_gpu_key(torch.device("cpu")) == "cpu"


def test_durations_and_lengths_read_as_people_say_them():
    assert [format_duration(s) for s in (0, 59.6, 61, 3600, 191532)] == ["0:00:00", "0:01:00", "0:01:01", "1:00:00",
                                                                         "53:12:12"]
    assert [format_tokens(n) for n in (32, 1000, 1024, 8192, 262144, 1048576, 1536)] == \
        ["32", "1000", "1k", "8k", "256k", "1M", "1536"]


# ------------------------------------------------------------------------------ the time left
def _stages(*specs):
    return [SimpleNamespace(steps=n, seq_len=L, batch_size=b) for n, L, b in specs]


def test_eta_is_unknown_on_the_first_step_then_the_stages_mean_without_its_first():
    eta = Eta(_stages((10, 1024, 2)))
    eta.add(0, 5.0)  # the warm-up step: autotuning, compilation
    assert eta.remaining_s(1) is None
    eta.add(0, 1.0)
    assert eta.remaining_s(2) == pytest.approx(8 * 1.0)
    eta.add(0, 2.0)
    assert eta.remaining_s(3) == pytest.approx(7 * 1.5)
    for _ in range(7):
        eta.add(0, 1.5)
    assert eta.remaining_s(10) == 0


def test_eta_scales_later_stages_by_their_tokens_per_step():
    """Stage 1 has 4x the tokens per step (2 rows of 1k -> 1 row of 8k, /2 -> 4x): its 3 steps count as 12."""
    eta = Eta(_stages((4, 1024, 2), (3, 8192, 1)))
    for s in (9.0, 1.0):
        eta.add(0, s)
    assert eta.remaining_s(2) == pytest.approx(1.0 * (2 + 3 * 4))
    eta.add(0, 1.0)
    eta.add(0, 1.0)
    eta.add(1, 6.0)  # stage 1's first step: the only time it has so far
    assert eta.remaining_s(5) == pytest.approx(6.0 * 2)
    eta.add(1, 4.0)
    assert eta.remaining_s(6) == pytest.approx(4.0 * 1)


# ------------------------------------------------------------------------------ a real run


def tiny(corpus, *extra):
    return load_train_config(None, None, [
        "preset=tiny", "model.vocab_size=256", f"data.path={corpus}", "data.eval_docs=1", "data.eval_windows=1",
        "stages.0.seq_len=32", "stages.0.steps=4", "stages.0.batch_size=2", "stages.0.warmup=1",
        "stages.1.seq_len=64", "stages.1.steps=2", "stages.1.warmup=1", *extra])


# The impl report each step returns: a change at step 3 (say, a plan that recomputes), none after it.
REPORTS = ["dsa:A x1", "dsa:A x1", "dsa:B x1", "dsa:B x1", "dsa:B x1", "dsa:B x1"]


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    """6 steps (4 + 2), logged every 1000 steps (so only the last, and what a kernel change forces),
    evaluated every 2, with the impl report changing once at step 3."""
    out = tmp_path_factory.mktemp("progress") / "run"
    logged = []
    tr = Trainer(tiny(corpus, "log_every=1000", "eval_every=2"), out_dir=str(out), log=logged.append)
    reports = iter(REPORTS)
    tr.model.impl_report = lambda: next(reports)
    tr.run()
    return SimpleNamespace(out=out, logged=logged, recs=[json.loads(ln) for ln in open(out / "metrics.jsonl")])


def test_the_first_step_line_has_the_total_and_the_eta_field(run):
    steps = [ln for ln in run.logged if ln.startswith("step ")]
    m = STEP.match(steps[0])
    assert m, steps[0]
    assert (m.group(1), m.group(2), m.group(3)) == ("1", "6", "-")  # the first step's time is a warm-up's
    assert [STEP.match(ln).group(1, 2) for ln in steps] == [("1", "6"), ("3", "6"), ("6", "6")]
    assert STEP.match(steps[-1]).group(3) == "0:00:00"
    assert all(len(ln) <= 120 for ln in steps), steps


def test_the_kernels_line_comes_on_the_first_step_and_again_only_when_it_changes(run):
    said = [ln for ln in run.logged if ln.startswith(("step ", "kernels:"))]
    assert said == [said[0], "kernels: dsa:A x1", said[2], "kernels: dsa:B x1", said[4]], said
    assert said[2].startswith("step 3/6 ") and said[4].startswith("step 6/6 ")


def test_metrics_keep_the_report_total_and_eta_every_step(run):
    steps = [r for r in run.recs if "loss" in r]
    assert [r["impl"] for r in steps] == REPORTS
    assert [r["total_steps"] for r in steps] == [6] * 6
    assert steps[0]["eta_s"] is None and all(r["eta_s"] >= 0 for r in steps[1:])
    assert steps[-1]["eta_s"] == 0


def test_train_and_eval_losses_reach_tensorboard(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = [f for f in os.listdir(run.out / "tb") if f.startswith("events.out.tfevents.")]
    assert len(events) == 1, events
    acc = EventAccumulator(str(run.out / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for t in ("train/loss", "train/grad_norm", "train/tokens_per_s", "train/lr", "train/peak_gib", "eval/loss"):
        assert t in tags, (t, tags)
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    train = [r["loss"] for r in run.recs if "loss" in r]
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(train, rel=1e-6)
    evals = [r for r in run.recs if "eval_loss" in r]  # before (0), steps 2 and 4, after (6)
    assert [e.step for e in acc.Scalars("eval/loss")] == [r["step"] for r in evals] == [0, 2, 4, 6]
    assert [e.value for e in acc.Scalars("eval/loss")] == pytest.approx([r["eval_loss"] for r in evals], rel=1e-6)
    buckets = sorted(t for t in tags if t.startswith("eval_loss_by_position/"))
    assert len(buckets) == len(evals[0]["buckets"]) == 8
    first = evals[-1]["buckets"][0]
    assert buckets[0] == f"eval_loss_by_position/{first['start']:02d}-{first['end']:02d}"
    assert acc.Scalars(buckets[0])[-1].value == pytest.approx(first["loss"], rel=1e-6)
    assert "kernels/text_summary" in acc.Tags()["tensors"]
    assert [e.step for e in acc.Tensors("kernels/text_summary")] == [1, 3]


def test_without_tensorboard_the_run_says_so_once_and_writes_no_events(corpus, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # `from torch.utils.tensorboard import` fails
    logged = []
    Trainer(tiny(corpus, "stages.0.steps=2", "stages.1.steps=1", "data.eval_windows=0"), out_dir=str(tmp_path),
            log=logged.append).run()
    assert [ln for ln in logged if "tensorboard " in ln.lower()] == [f"note: {NOT_INSTALLED}"]
    assert logged.index(f"note: {NOT_INSTALLED}") < min(i for i, ln in enumerate(logged) if ln.startswith("step "))
    assert not (tmp_path / "tb").exists()
    assert len([ln for ln in open(tmp_path / "metrics.jsonl")]) == 3


def test_with_tensorboard_there_is_no_note(tmp_path):
    tb = TensorBoard(str(tmp_path / "tb"))
    try:
        assert tb.note is None and tb.writer is not None
    finally:
        tb.close()
