"""Benchmarks that step the real trainer (`longctx train`'s run loop) in a child process per run and
read back its metrics: one child per run gives each its own clean CUDA peak, and torchrun can start
it. The children write no checkpoint: the models these benchmarks step (GLM-shaped layers, h200-ref
sharded) hold tens of GB of weights and AdamW state, most of the lent machine's disk.

    rc, log, wall_s = run_child(cmd, timeout)      # the parent: cmd re-invokes the script as a child
    train_without_checkpoints(sets, out)           # the child: the trainer of `longctx train --set ...`
    steps = step_records(run_dir)                  # the parent again: the steps' metrics.jsonl records
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def run_child(cmd: list[str], timeout: float) -> tuple[int | str, str, float]:
    """(exit code or "timeout", stdout + stderr, seconds) of `cmd` run from the repository root."""
    t0 = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        rc, log = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        rc, log = "timeout", _text(e.stdout) + _text(e.stderr)
    return rc, log, round(time.time() - t0, 1)


def train_without_checkpoints(sets: list[str], out: str) -> None:
    """The trainer `longctx train --set S ...` builds, run into `out` with its checkpoints skipped."""
    from longctx.config.loading import load_train_config
    from longctx.train.trainer import Trainer

    trainer = Trainer(load_train_config(None, None, sets), out_dir=out)
    trainer.save = lambda reason: None
    trainer.run(force=True)


def step_records(run_dir: Path) -> list[dict]:
    """The step records of a run's metrics.jsonl (not its evaluations), [] when it wrote none."""
    metrics = Path(run_dir) / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
