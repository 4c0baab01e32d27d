"""`init_from`: a run that starts from a transformers GLM-5.3-Flash checkpoint has the checkpoint's model and
weights at step 0, in one process (exactly `load_pretrained`'s tensors) and under `torchrun` with
parallel.ep = 2 (the same step losses as the one process: each rank streamed only its shards into a
model built on the meta device). Its model settings are the checkpoint's; a training-only one may
differ, any other is one sentence, as is an `init_from` that names no checkpoint."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from hf_reference import make_checkpoint  # skips without transformers

from longctx.config.loading import load_train_config
from longctx.errors import ConfigError
from longctx.train.trainer import Trainer

SETS = ["stages.0.seq_len=64", "stages.0.steps=2", "stages.0.batch_size=2", "stages.0.warmup=1", "stages.1.seq_len=64",
        "stages.1.steps=1", "stages.1.warmup=0", "stages.1.batch_size=2", "data.eval_windows=1", "log_every=1000"]


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm")
    make_checkpoint(path, seed=1, vocab_size=256)  # the byte tokenizer's 256 ids
    return str(path)


def _sets(glm, corpus, *more):
    return [*SETS, f"init_from={glm}", f"data.path={corpus}", *more]


def _steps(out):
    return [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "loss" in r]


@pytest.fixture(scope="module")
def one_process(glm, corpus, tmp_path_factory):
    from longctx.hf_interop import config_from_hf, load_pretrained

    out = str(tmp_path_factory.mktemp("one"))
    said = []
    t = Trainer(load_train_config(None, "tiny", _sets(glm, corpus)), out_dir=out, log=said.append)
    assert t.cfg.model == config_from_hf(json.load(open(os.path.join(glm, "config.json"))))
    ref = load_pretrained(glm).state_dict()
    got = t.model.state_dict()
    assert sorted(got) == sorted(ref)
    bad = [k for k in ref if not torch.equal(got[k], ref[k])]
    assert not bad, f"step 0 differs from the checkpoint in {bad}"
    assert any(s.startswith(f"weights from {glm} (transformers layout; ") for s in said), said
    t.run()
    return out


def test_one_process_starts_from_the_checkpoint(one_process):
    steps = _steps(one_process)
    assert [r["step"] for r in steps] == [1, 2, 3] and all(r["loss"] == r["loss"] for r in steps)
    saved = json.load(open(os.path.join(one_process, "config.json")))
    assert saved["init_from"] and saved["model"]["n_routed_experts"] == 4 and saved["model"]["hidden_size"] == 32


def test_torchrun_ep2_starts_from_the_same_weights(glm, corpus, one_process, tmp_path):
    import torch.distributed as dist

    from test_torchrun import TORCHRUN, _train

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    r = _train(tmp_path / "ep2", *TORCHRUN, sets=_sets(glm, corpus, "preset=tiny", "parallel.ep=2"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(re.findall(r"weights from .* \(transformers layout; [\d,]+ values read by rank 0\)", r.stdout)) == 1
    a, b = _steps(one_process), _steps(tmp_path / "ep2")
    assert [x["step"] for x in b] == [1, 2, 3]
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]), (x["step"], x["loss"], y["loss"])


def test_a_training_setting_may_differ_and_a_shape_may_not(glm, corpus, tmp_path):
    cfg = load_train_config(None, "tiny", _sets(glm, corpus, "model.balancer=sign"))
    t = Trainer(cfg, out_dir=str(tmp_path), quiet=True)
    assert t.cfg.model.balancer == "sign" and t.cfg.model.hidden_size == 32
    cfg = load_train_config(None, "tiny", _sets(glm, corpus, "model.hidden_size=64"))
    with pytest.raises(ConfigError, match=rf"^init_from '{re.escape(glm)}' holds a model with hidden_size = 32, but "
                                          r"this run sets model.hidden_size = 64; leave that setting out to train the "
                                          r"checkpoint's model \(only balancer, .* may differ from it\)\.$"):
        Trainer(cfg, out_dir=str(tmp_path / "b"), quiet=True)


def test_a_bad_init_from_is_one_sentence(tmp_path, corpus, capsys):
    from longctx.cli import main

    missing = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=rf"^init_from '{re.escape(missing)}' does not exist; point it at a "
                                          r"transformers GLM-5.3-Flash folder, a longctx checkpoint or a run folder, "
                                          r"or leave it unset to start from random weights\.$"):
        load_train_config(None, "tiny", [f"init_from={missing}"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^init_from '.*empty' is not a checkpoint folder \(no config.json, "
                                          r"longctx_config.json or checkpoint link in it\); point it at"):
        load_train_config(None, "tiny", [f"init_from={tmp_path / 'empty'}"])
    assert main(["train", "--set", f"init_from={missing}", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: init_from ") and err.count("\n") == 1 and "Traceback" not in err, err
