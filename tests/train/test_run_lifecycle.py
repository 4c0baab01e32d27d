"""A run folder's life: refusing to clobber it, --force, --resume from its own config, a resume that
rebuilds the stage's memory plan, and SIGINT / SIGTERM / Ctrl-C under `tee` that leave a
checkpoint from which the resumed run reproduces the uninterrupted losses."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from longctx import checkpoint as ckpt
from longctx.cli import main
from longctx.config import preset
from longctx.model import LongCtxModel
from longctx.config.loading import load_train_config
from longctx.train.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread for the runs in this process: a busy 2-core host oversubscribed by torch's
    default threads runs these tiny steps many times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_sets(corpus, steps0=4, steps1=2, extra=()):
    return ["preset=tiny", "model.vocab_size=256", f"data.path={corpus}", "data.eval_docs=1", "data.eval_windows=1",
            "stages.0.seq_len=32", f"stages.0.steps={steps0}", "stages.0.batch_size=2", "stages.0.warmup=1",
            "stages.1.seq_len=64", f"stages.1.steps={steps1}", "stages.1.warmup=1", *extra]


def as_flags(sets):
    return [a for s in sets for a in ("--set", s)]


def losses(out):
    return [r["loss"] for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "loss" in r]


# ------------------------------------------------------------------------------ checkpoint pruning
def test_pruning_keeps_the_previous_checkpoint_by_step_number(tmp_path):
    """Past step 999999 the names grow a digit: ckpt-1000000 sorts before ckpt-999999 as text."""
    model = LongCtxModel(preset("tiny"))
    for step in (999999, 1000000, 1000001):
        ckpt.save(str(tmp_path), step, model, None, {}, {})
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("ckpt-")) == ["ckpt-1000000", "ckpt-1000001"]
    assert os.readlink(tmp_path / "checkpoint") == "ckpt-1000001"


# ------------------------------------------------------------------------------ an existing run folder
def _only_error(err, *needles):
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("error: "), err
    assert "Traceback" not in err
    msg = lines[-1]
    assert msg.count(". ") == 0 and msg.endswith("."), msg  # one sentence
    for n in needles:
        assert n in msg, msg
    return msg


@pytest.mark.parametrize("marker", ["config.json", "checkpoint", "ckpt-000003", "metrics.jsonl"])
def test_train_into_a_run_folder_is_refused(tmp_path, corpus, capsys, marker):
    out = tmp_path / "run"
    out.mkdir()
    if marker == "checkpoint":
        os.symlink("ckpt-000003", out / marker)
    elif marker.startswith("ckpt-"):
        (out / marker).mkdir()
        (out / marker / "model.safetensors").write_bytes(b"weights")
    else:
        (out / marker).write_text("{}")
    before = sorted(os.listdir(out))
    assert main(["train", *as_flags(tiny_sets(corpus)), "--out", str(out), "--quiet"]) == 2
    _only_error(capsys.readouterr().err, marker, "--resume", "--force")
    assert sorted(os.listdir(out)) == before


def test_force_removes_what_longctx_wrote_and_nothing_else(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert main(["train", *as_flags(tiny_sets(corpus, steps0=5, steps1=2)), "--out", str(out), "--quiet"]) == 0
    old = set(os.listdir(out))
    assert {"config.json", "metrics.jsonl", "summary.json", "loss.png", "per_position_loss.png", "checkpoint",
            "ckpt-000005", "ckpt-000007"} <= old
    old_events = {f for f in os.listdir(out / "tb") if f.startswith("events.out.tfevents")} if (out / "tb").exists() else set()
    (out / "ckpt-000009.partial").mkdir()  # a write cut short
    mine = ["notes.txt", "ckpt-notes.txt", "checkpoints", "data/corpus.txt", "tb/my_events.txt"]
    for m in mine:
        (out / m).parent.mkdir(exist_ok=True)
        (out / m).write_text("keep me") if not m.endswith("checkpoints") else (out / m).mkdir()
    assert main(["train", *as_flags(tiny_sets(corpus, steps0=2, steps1=1)), "--out", str(out), "--quiet",
                 "--force"]) == 0
    now = set(os.listdir(out))
    assert sorted(d for d in now if d.startswith("ckpt-0")) == ["ckpt-000002", "ckpt-000003"]
    assert os.readlink(out / "checkpoint") == "ckpt-000003"
    for m in mine:
        assert (out / m).exists(), m
    assert not old_events & set(os.listdir(out / "tb"))
    assert [r["step"] for r in map(json.loads, open(out / "metrics.jsonl")) if "loss" in r] == [1, 2, 3]
    assert json.load(open(out / "config.json"))["stages"][0]["steps"] == 2


def test_force_with_resume_is_refused(tmp_path, corpus, capsys):
    assert main(["train", *as_flags(tiny_sets(corpus)), "--out", str(tmp_path), "--resume", "--force"]) == 2
    _only_error(capsys.readouterr().err, "--resume", "--force")


# ------------------------------------------------------------------------------ resume rebuilds the stage
_PLAIN = (bool, int, float, str, type(None), torch.dtype)


def _switches(obj, depth=0):
    """An object's plain settings (and those of the policy objects it holds), for comparing plans."""
    if isinstance(obj, _PLAIN):
        return obj
    if isinstance(obj, (list, tuple)) and all(isinstance(x, _PLAIN) for x in obj):
        return list(obj)
    if depth > 2 or isinstance(obj, (torch.Tensor, torch.nn.Module)) or not hasattr(obj, "__dict__"):
        return type(obj).__name__
    out = {"type": type(obj).__name__}
    for k, v in vars(obj).items():
        if isinstance(v, _PLAIN) or (hasattr(v, "__dict__") and type(v).__module__.startswith("longctx")
                                     and not isinstance(v, torch.nn.Module)):
            out[k] = _switches(v, depth + 1)
    return out


def applied_plan(tr: Trainer) -> dict:
    """What the stage's memory plan and data mix set: every module's plain attributes (block_fn,
    recompute / offload policies, chunk sizes, kernels), the trainer's step policy, the stream's shape."""
    mods = {}
    for name, m in tr.model.named_modules():
        attrs = {k: _switches(v) for k, v in vars(m).items() if isinstance(v, _PLAIN)}
        attrs["block_fn"] = _switches(getattr(m, "block_fn", None))
        mods[name or "model"] = attrs
    stream = {"seq_len": tr.stream.seq_len, "batch_size": tr.stream.batch_size,
              "probs": [float(p) for p in getattr(tr.stream, "probs", [])]}
    return {"modules": mods, "memory_policy": _switches(tr.memory_policy), "stream": stream}


def test_resume_mid_stage_rebuilds_the_stage_memory_plan_and_data_mix(tmp_path, corpus):
    """A fresh run at step 3 (stage 0 runs steps 0..4) against one stopped at 2 and resumed: the same
    recompute policy, chunk settings and mixture, so the same losses."""
    extra = ["memory.recompute=on", "memory.offload=off", "memory.loss_chunk=16", "memory.moe_chunk=24",
             f"data.sources.more={corpus}", "stages.0.data_mix.main=1.0", "stages.1.data_mix.more=1.0"]
    sets = tiny_sets(corpus, steps0=5, steps1=2, extra=extra)
    fresh = Trainer(load_train_config(None, None, sets), out_dir=str(tmp_path / "fresh"), quiet=True)
    fresh.run(stop_after=3)
    Trainer(load_train_config(None, None, sets), out_dir=str(tmp_path / "resumed"), quiet=True).run(stop_after=2)
    resumed = Trainer(load_train_config(None, None, sets), out_dir=str(tmp_path / "resumed"), quiet=True)
    resumed.run(resume=True, stop_after=3)
    a, b = applied_plan(fresh), applied_plan(resumed)
    assert a["modules"]["model"]["block_fn"]["type"] == "RecomputePolicy"  # the plan is not the default
    assert a["stream"]["probs"] == [1.0, 0.0]
    assert a == b
    assert max(abs(x - y) for x, y in zip(losses(tmp_path / "fresh"), losses(tmp_path / "resumed"))) <= 1e-6


# ------------------------------------------------------------------------------ --resume takes the run's config
def test_resume_with_no_flags_continues_with_the_runs_config(tmp_path, corpus, capsys):
    sets = tiny_sets(corpus, steps0=4, steps1=2, extra=["stages.1.seq_len=48"])
    assert main(["train", *as_flags(sets), "--out", str(tmp_path / "whole"), "--quiet"]) == 0
    assert main(["train", *as_flags(sets), "--out", str(tmp_path / "run"), "--quiet", "--max-steps", "3"]) == 0
    saved = json.load(open(tmp_path / "run" / "config.json"))
    assert main(["train", "--out", str(tmp_path / "run"), "--resume", "--quiet"]) == 0
    assert json.load(open(tmp_path / "run" / "config.json")) == saved
    recs = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "loss" in r]
    assert [r["seq_len"] for r in recs] == [32] * 4 + [48] * 2
    a, b = losses(tmp_path / "whole"), losses(tmp_path / "run")
    assert len(a) == len(b) == 6 and max(abs(x - y) for x, y in zip(a, b)) <= 1e-6


@pytest.fixture(scope="module")
def stopped_run(corpus, tmp_path_factory):
    """A run of 4 + 2 steps stopped after step 5: in stage 1, one step in."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", *as_flags(tiny_sets(corpus)), "--out", str(out), "--quiet", "--max-steps", "5"]) == 0
    finally:
        torch.set_num_threads(n)
    return out


@pytest.mark.parametrize("flags,setting", [(["--set", "stages.0.seq_len=48"], "stages.0.seq_len"),
                                           (["--set", "model.hidden_size=48"], "model.hidden_size"),
                                           (["--preset", "small"], "preset"),
                                           (["--set", "stages.2.seq_len=96", "--set", "stages.2.steps=1",
                                             "--set", "stages.2.lr=1e-3"], "stages.2"),
                                           (["--set", "stages.0.steps=5"], "stages.0.steps")])
def test_resume_refuses_a_setting_that_differs_from_the_run(tmp_path, stopped_run, capsys, flags, setting):
    out = tmp_path / "run"
    shutil.copytree(stopped_run, out, symlinks=True)
    before = {n: open(out / n, "rb").read() for n in ("config.json", "metrics.jsonl")}
    assert main(["train", "--out", str(out), "--resume", *flags]) == 2
    _only_error(capsys.readouterr().err, setting, "--resume")
    assert {n: open(out / n, "rb").read() for n in before} == before


def test_resume_applies_and_logs_the_settings_that_may_change(tmp_path, stopped_run, capsys):
    out = tmp_path / "run"
    shutil.copytree(stopped_run, out, symlinks=True)
    assert main(["train", "--out", str(out), "--resume", "--set", "stages.1.steps=4", "--set", "log_every=2",
                 "--set", "ckpt_every=2", "--set", "eval_every=3"]) == 0
    said = capsys.readouterr().out
    for change in ("stages.1.steps: 2 -> 4", "log_every: 1 -> 2", "ckpt_every: 0 -> 2", "eval_every: 0 -> 3"):
        assert change in said, said
    saved = json.load(open(out / "config.json"))
    assert (saved["stages"][1]["steps"], saved["log_every"], saved["ckpt_every"], saved["eval_every"]) == (4, 2, 2, 3)
    recs = list(map(json.loads, open(out / "metrics.jsonl")))
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, 9))
    assert [r["step"] for r in recs if r.get("eval", "").startswith("step")] == [6]
    assert [ln.split("|")[0].split()[1] for ln in said.splitlines() if ln.startswith("step ")] == ["6/8", "8/8"]


def test_a_checkpoint_of_another_shape_is_a_checkpoint_error(tmp_path):
    from longctx.errors import CheckpointError

    ckpt.save(str(tmp_path), 1, LongCtxModel(preset("tiny")), None, {}, {})
    other = LongCtxModel(preset("tiny").replace(hidden_size=2 * preset("tiny").hidden_size))
    with pytest.raises(CheckpointError, match="does not match the model"):
        ckpt.load(str(tmp_path), other)


# ------------------------------------------------------------------------------ SIGINT, SIGTERM, Ctrl-C under tee
SIGNAL_STEPS = (40, 10)  # ~50 ms a step on 2 cores: the run outlasts the time a signal takes to land
HINT = re.compile(r"interrupted at step (\d+); resume with: longctx train --out (\S+) --resume")


def _env():
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")  # one thread: no oversubscription on a busy CI host
    env.pop("PYTHONUNBUFFERED", None)  # the step lines must reach a pipe promptly on their own
    return env


def _signal_sets(corpus):
    return as_flags(tiny_sets(corpus, *SIGNAL_STEPS))


def _live_sigint():
    """In the child: SIGINT handled by default. A pytest started as a background job of a
    non-interactive shell (`pytest &`, nohup) ignores SIGINT, its children inherit that, and the
    trainer rightly leaves an ignored signal ignored; these tests are about a signal that is live."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cmd(corpus, out):
    return [sys.executable, "-m", "longctx", "train", *_signal_sets(corpus), "--out", str(out)]


def _wait_for_a_step_line(stream):
    for line in stream:
        if line.startswith("step "):
            return
    raise AssertionError("the run printed no step line")


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    r = subprocess.run([*_cmd(corpus, out), "--quiet"], env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    a = losses(out)
    assert len(a) == sum(SIGNAL_STEPS)
    return a


def _resume_and_compare(out, err, rc, expected_rc, uninterrupted):
    assert rc == expected_rc, (rc, err[-3000:])
    m = HINT.search(err)
    assert m, err[-3000:]
    step = int(m.group(1))
    assert 0 < step < sum(SIGNAL_STEPS), step
    assert m.group(2) == str(out)
    assert os.readlink(os.path.join(out, "checkpoint")) == f"ckpt-{step:06d}"
    r = subprocess.run([sys.executable, "-m", "longctx", "train", "--out", str(out), "--resume", "--quiet"],
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    b = losses(out)
    assert len(b) == len(uninterrupted)
    assert max(abs(x - y) for x, y in zip(uninterrupted, b)) <= 1e-6


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_mid_run_leaves_a_checkpoint_that_resumes_exactly(tmp_path, corpus, uninterrupted, sig, code):
    out = tmp_path / "run"
    with open(tmp_path / "err", "w") as err:
        p = subprocess.Popen(_cmd(corpus, out), env=_env(), stdout=subprocess.PIPE, stderr=err, text=True,
                             preexec_fn=_live_sigint)
        try:
            _wait_for_a_step_line(p.stdout)
            p.send_signal(sig)
            p.stdout.read()
            p.wait(timeout=120)
        finally:
            p.kill()
    _resume_and_compare(out, open(tmp_path / "err").read(), p.returncode, code, uninterrupted)


def test_ctrl_c_with_the_output_through_tee_leaves_a_checkpoint(tmp_path, corpus, uninterrupted):
    """Ctrl-C reaches the whole foreground process group: `tee` dies at once, so each later print
    of the run meets a closed pipe."""
    out, err, rc, log = (tmp_path / n for n in ("run", "err", "rc", "log"))
    train = " ".join(f"'{a}'" for a in _cmd(corpus, out))
    p = subprocess.Popen(["bash", "-c", f"({train} 2>'{err}'; echo $? > '{rc}') | tee '{log}'"], env=_env(),
                         stdout=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_live_sigint)
    try:
        _wait_for_a_step_line(p.stdout)
        os.killpg(p.pid, signal.SIGINT)
        p.stdout.read()
        p.wait(timeout=120)
        for _ in range(100):  # the subshell writes the exit code after bash's tee is gone
            if rc.exists() and rc.read_text().strip():
                break
            time.sleep(0.1)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _resume_and_compare(out, err.read_text(), int(rc.read_text()), 130, uninterrupted)


def test_no_step_is_checkpointed_twice(tmp_path, corpus, monkeypatch):
    """Writing ckpt-N again removes the only checkpoint of that step before its copy is in place."""
    import longctx.train.trainer as trainer_mod

    steps = []
    real = ckpt.save

    def recording(out, step, *a, **k):
        steps.append(step)
        return real(out, step, *a, **k)

    monkeypatch.setattr(trainer_mod.ckpt, "save", recording)
    cfg = load_train_config(None, None, tiny_sets(corpus, steps0=4, steps1=2, extra=["ckpt_every=3"]))
    Trainer(cfg, out_dir=str(tmp_path / "run"), quiet=True).run()
    Trainer(load_train_config(None, None, tiny_sets(corpus)), out_dir=str(tmp_path / "stop"), quiet=True).run(stop_after=4)
    assert steps == [3, 4, 6, 4]
