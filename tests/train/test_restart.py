"""What a worker that torchrun restarted (--max-restarts) does with the run folder, in one process with
torchrun's variables set by hand (tests/train/test_torchrun.py kills a real rank): before the run's
first checkpoint it starts afresh over what the failed attempt wrote, to the uninterrupted losses, and
it never takes over a folder that its own job did not begin (a first attempt that refused it)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from longctx.cli import main
from longctx.config.loading import load_train_config
from longctx.train.trainer import JOB_FILE, Trainer


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _sets(corpus):
    return ["preset=tiny", "model.vocab_size=256", f"data.path={corpus}", "data.eval_docs=1", "data.eval_windows=1",
            "stages.0.seq_len=32", "stages.0.steps=4", "stages.0.batch_size=2", "stages.0.warmup=1",
            "stages.1.seq_len=64", "stages.1.steps=1", "stages.1.batch_size=2", "stages.1.warmup=0"]


def _flags(corpus):
    return [a for s in _sets(corpus) for a in ("--set", s)]


def _steps(out):
    return [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "loss" in r]


def test_a_restart_before_the_first_checkpoint_starts_afresh_and_another_jobs_folder_is_refused(
        tmp_path, corpus, monkeypatch, capsys):
    for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    ref = tmp_path / "ref"
    assert main(["train", *_flags(corpus), "--out", str(ref), "--quiet"]) == 0

    out = tmp_path / "run"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    tr = Trainer(load_train_config(None, None, _sets(corpus)), out_dir=str(out), quiet=True)
    real = tr.train_step

    def dies_in_step_2(stage, k):
        if tr.step == 1:
            raise RuntimeError("a rank died")
        return real(stage, k)

    tr.train_step = dies_in_step_2
    with pytest.raises(RuntimeError, match="a rank died"):
        tr.run(force=False)
    assert [r["step"] for r in _steps(out)] == [1] and not os.path.lexists(out / "checkpoint")
    assert (out / JOB_FILE).exists()

    # torchrun's restart: the same command (no --force, no --resume) in a folder that holds a run
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    capsys.readouterr()
    assert main(["train", *_flags(corpus), "--out", str(out)]) == 0
    said = capsys.readouterr()
    assert "torchrun restart 1: continuing the run in" in said.out and "afresh" in said.out, said.out + said.err
    a, b = _steps(out), _steps(ref)
    assert [r["step"] for r in a] == [1, 2, 3, 4, 5]  # each step once: the failed attempt's step 1 is gone
    assert all(abs(x["loss"] - y["loss"]) <= 1e-5 * abs(y["loss"]) for x, y in zip(a, b)), (a, b)

    # another job's restarted workers (a first attempt that was refused this folder) leave it alone
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    before = sorted(os.listdir(out))
    assert main(["train", *_flags(corpus), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out") and "already holds a run" in err and err.count("\n") == 1, err
    assert sorted(os.listdir(out)) == before and [r["step"] for r in _steps(out)] == [1, 2, 3, 4, 5]
