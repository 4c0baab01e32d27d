"""A run folder's life: refusing to clobber it, --force, --resume from its own config, a resume that
rebuilds the stage's memory plan, and SIGINT / SIGTERM / Ctrl-C under `tee` that leave a
checkpoint from which the resumed run reproduces the uninterrupted losses."""

from __future__ import annotations

import json
import os
import random
import re
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
from longctx.train_config import load_train_config
from longctx.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small text file: tokenizing it is instant, unlike the embedded stdlib corpus."""
    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog def class return import yield lambda".split()
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(60)) for _ in range(300)))
    return str(path)


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
