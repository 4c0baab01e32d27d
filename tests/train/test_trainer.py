"""The main job end to end on the CPU: learning, resume, decode agreement, overfit, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from longctx.config import preset
from longctx.model import LongCtxModel
from longctx.config.loading import load_train_config
from longctx.train.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The demo, shrunk to a CI budget: the same model and corpus, shorter stages.
SHORT = ["stages.0.seq_len=256", "stages.0.steps=30", "stages.0.batch_size=4", "stages.0.warmup=5",
         "stages.1.seq_len=512", "stages.1.steps=6", "stages.1.warmup=1", "data.eval_windows=4", "log_every=1000"]


def test_default_run_learns_and_writes_its_outputs(tmp_path):
    cfg = load_train_config(None, None, SHORT)
    summary = Trainer(cfg, out_dir=str(tmp_path), quiet=True).run()
    assert summary["after"]["loss"] < summary["before"]["loss"]
    assert len(summary["after"]["buckets"]) == 8 and "positions" in summary["table"]
    for f in ("config.json", "metrics.jsonl", "loss.png", "per_position_loss.png", "summary.json", "checkpoint"):
        assert os.path.exists(tmp_path / f), f
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in recs if "loss" in r]
    assert len(steps) == 36 and {r["seq_len"] for r in steps} == {256, 512}
    assert all("dsa:" in r["impl"] and "kda:" in r["impl"] for r in steps)


def test_stop_and_resume_reproduces_the_loss_curve(tmp_path):
    sets = ["stages.0.seq_len=128", "stages.0.steps=6", "stages.0.warmup=2", "stages.0.batch_size=2", "stages.1.seq_len=256",
            "stages.1.steps=4", "stages.1.warmup=1", "data.eval_windows=2", "preset=tiny", "model.vocab_size=256"]
    cfg = load_train_config(None, None, sets)
    Trainer(cfg, out_dir=str(tmp_path / "a"), quiet=True).run()
    Trainer(load_train_config(None, None, sets), out_dir=str(tmp_path / "b"), quiet=True).run(stop_after=7)
    Trainer(load_train_config(None, None, sets), out_dir=str(tmp_path / "b"), quiet=True).run(resume=True)

    def losses(d):
        return [r["loss"] for r in map(json.loads, open(d / "metrics.jsonl")) if "loss" in r]

    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(a) == len(b) == 10
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-6


def test_decode_path_logprobs_equal_training_forward():
    from longctx.generate import decode_logprobs

    torch.manual_seed(0)
    # No exact ties in any top-k: init_std 0.2 keeps router scores apart (at 0.02 every expert
    # scores ~0.5), and 16 indexer heads make an all-ReLU-zero pool score (an exact tie at 0, which
    # the shorter decode rows may break differently) vanishingly rare; tiny's 2 heads give 1 in 4.
    cfg = preset("tiny").replace(init_std=0.2, index_heads=16)
    model = LongCtxModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 3 * cfg.index_topk + 5))  # longer than top-k
    with torch.no_grad():
        full = torch.log_softmax(model(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    dec = decode_logprobs(model, ids, prefill=5)
    assert (full - dec).abs().mean().item() <= 1e-5


def test_fixed_batch_overfits():
    torch.manual_seed(0)
    model = LongCtxModel(preset("tiny"))
    ids = torch.randint(0, 97, (2, 65))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    first = None
    for _ in range(30):
        out = model(ids[:, :-1], labels=ids[:, 1:])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        model.apply_balance_updates()
        first = first or out.lm_loss.item()
        last = out.lm_loss.item()
    assert last <= first / 10, (first, last)


# ---------------------------------------------------------------------------------- bad input
def _cli(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "longctx", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


def _one_clean_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    msg = r.stderr.strip().splitlines()[-1]
    assert msg.startswith("error: "), r.stderr
    for n in needles:
        assert n in msg, msg
    return msg


def test_unknown_setting_suggests_the_right_one(tmp_path):
    _one_clean_error(_cli("train", "--set", "model.hiden_size=64", "--out", str(tmp_path)), "model.hiden_size",
                     "did you mean hidden_size")


@pytest.mark.parametrize("setting,needle", [("model.hidden_size=abc", "model.hidden_size"),
                                            ("model.hidden_size=-4", "model.hidden_size"),
                                            ("stages.0.lr=fast", "stages.0.lr")])
def test_wrong_type_or_range(tmp_path, setting, needle):
    _one_clean_error(_cli("train", "--set", setting, "--out", str(tmp_path)), needle)


def test_missing_empty_binary_data(tmp_path):
    _one_clean_error(_cli("train", "--set", f"data.path={tmp_path / 'nope'}", "--out", str(tmp_path / "o")), "data.path")
    (tmp_path / "empty").mkdir()
    _one_clean_error(_cli("train", "--set", f"data.path={tmp_path / 'empty'}", "--out", str(tmp_path / "o")), "data.path")
    (tmp_path / "bin.dat").write_bytes(bytes(range(256)) * 10)
    _one_clean_error(_cli("train", "--set", f"data.path={tmp_path / 'bin.dat'}", "--out", str(tmp_path / "o")), "data.path")


def test_sequence_length_the_run_cannot_take(tmp_path):
    (tmp_path / "t.txt").write_text("hello world, " * 200)
    _one_clean_error(_cli("train", "--set", f"data.path={tmp_path / 't.txt'}", "--set", "stages.0.seq_len=100000",
                          "--out", str(tmp_path / "o")), "stages.0.seq_len")


def test_corrupt_checkpoint_is_refused_and_nothing_is_lost(tmp_path):
    sets = ["--set", "preset=tiny", "--set", "model.vocab_size=256", "--set", "stages.0.seq_len=64", "--set",
            "stages.0.steps=2", "--set", "stages.0.warmup=1", "--set", "stages.1.seq_len=64", "--set", "stages.1.steps=1", "--set", "stages.1.warmup=0", "--set", "data.eval_windows=1"]
    out = tmp_path / "run"
    r = _cli("train", *sets, "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    ck = os.path.realpath(out / "checkpoint")
    with open(os.path.join(ck, "model.safetensors"), "r+b") as f:
        f.seek(0)
        f.write(b"garbage!" * 8)
    before = sorted(os.listdir(out))
    _one_clean_error(_cli("train", *sets, "--out", str(out), "--resume", "--quiet"), "corrupt")
    assert sorted(os.listdir(out)) == before
    _one_clean_error(_cli("generate", "--checkpoint", str(out), "--prompt", "def "), "corrupt")


def test_print_config_and_generate(tmp_path):
    r = _cli("train", "--print-config", "--set", "model.hidden_size=64")
    assert r.returncode == 0 and "hidden_size = 64" in r.stdout


def test_stage_data_mixture_switches_sources(tmp_path):
    (tmp_path / "main.txt").write_text("the main corpus. " * 400)
    (tmp_path / "long.txt").write_text("a long document source; " * 400)
    sets = ["preset=tiny", "model.vocab_size=256", f"data.path={tmp_path / 'main.txt'}", "data.eval_docs=1",
            f"data.sources.long={tmp_path / 'long.txt'}", "data.eval_windows=1",
            "stages.0.seq_len=32", "stages.0.steps=3", "stages.0.warmup=0", "stages.0.data_mix.main=1.0",
            "stages.1.seq_len=64", "stages.1.steps=2", "stages.1.warmup=0", "stages.1.data_mix.long=1.0"]
    tr = Trainer(load_train_config(None, None, sets), out_dir=str(tmp_path / "a"), quiet=True)
    tr.run(stop_after=3)
    main, long = tr.stream.streams
    assert main.cursor > 0 and long.cursor == 0 and long.epoch == 0  # stage 0: main only
    tr = Trainer(load_train_config(None, None, sets), out_dir=str(tmp_path / "a"), quiet=True)
    tr.run(resume=True)
    main2, long2 = tr.stream.streams
    assert (main2.epoch, main2.cursor) == (main.epoch, main.cursor) and long2.cursor == 2 * 64  # stage 1: long only

