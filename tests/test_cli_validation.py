"""The subcommands' arguments: a mistake is one `error: ...` sentence and exit 2, never a traceback;
data.eval_windows=0 turns evaluation off; every preset the CLI lists trains on the default data."""

from __future__ import annotations

import json
import os

import pytest

from longctx.cli import main
from longctx.train_config import load_train_config
from longctx.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

# Two steps of the tiny model at a tiny length on the embedded corpus.
TWO_STEPS = ["preset=tiny", "model.vocab_size=256", "stages=[{seq_len = 32, steps = 2, lr = 1e-3}]", "log_every=1000"]


# ------------------------------------------------------------------------------ data.eval_windows=0
def test_eval_windows_zero_trains_without_evaluation(tmp_path):
    logged = []
    tr = Trainer(load_train_config(None, None, [*TWO_STEPS, "data.eval_windows=0", "eval_every=1"]),
                 out_dir=str(tmp_path), log=logged.append)
    summary = tr.run()
    assert summary["step"] == 2 and summary["before"] is None and summary["after"] is None
    assert not any("held-out loss" in line for line in logged), logged
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(recs) == 2 and not any("eval" in r or "eval_loss" in r for r in recs), recs
    assert not os.path.exists(tmp_path / "per_position_loss.png")
    assert os.path.exists(tmp_path / "loss.png") and os.path.exists(tmp_path / "checkpoint")
    assert json.loads((tmp_path / "summary.json").read_text())["after"] is None


def test_eval_windows_zero_from_the_cli(tmp_path, capsys):
    sets = [a for s in [*TWO_STEPS, "data.eval_windows=0"] for a in ("--set", s)]
    assert main(["train", *sets, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "held-out loss" not in out and "checkpoint (final)" in out, out
