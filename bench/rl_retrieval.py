"""CPU: RL of an SFT checkpoint of the small model on the embedded long-context retrieval task: the mean
reward of each step's rollouts, and the held-out exact match by haystack length before and after
(`longctx rl --preset rl-retrieval --set init_from=runs/sft`).

    OMP_NUM_THREADS=1 python bench/rl_retrieval.py [--init runs/sft] [--preset rl-retrieval]
        [--set KEY=VALUE ...] [--out runs/rl] [--json bench/results/rl_retrieval.json]

Runs the preset through the trainer (its step lines on stdout: reward, completion length, clip
fraction, the sampler-vs-trainer log-prob gap), then writes the JSON: the reward and the other RL
numbers of every step, the reward's mean over the first and the last steps, the exact match by
length and kind before and after, the command, date, commit, versions and wall time. The run folder
holds reward.png and accuracy.png.

A step's mean reward is over that step's prompts, whose difficulty varies more than the policy does
in a few dozen steps; so the script also samples one fixed set of task prompts the run never drew
(--probe of them, rl.group completions each, the run's sampling settings and seeds) with the
starting weights and with the final ones: the mean reward and the greedy exact match on the same
prompts, before and after.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from longctx.config.loading import load_train_config  # noqa: E402
from longctx.data.retrieval_task import exact_match  # noqa: E402
from longctx.distributed.checkpoint import load_checkpoint  # noqa: E402
from longctx.errors import run_script  # noqa: E402
from longctx.generate import sample  # noqa: E402
from longctx.train.rollouts import completion_text  # noqa: E402
from longctx.train.trainer import Trainer  # noqa: E402

PROBE_FIRST = 1_000_000  # the probe's prompt indices: far past any a run of this size draws

STEP_KEYS = ("step", "reward", "reward_std", "length", "clip_frac", "logp_gap", "kl", "flat_groups", "truncated",
             "loss", "grad_norm", "lr", "step_s", "rollout_s")


def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "longctx", "bench/rl_retrieval.py"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def _init_config(path: str) -> dict | None:
    """What trained the starting checkpoint: its run's saved preset, stages, sft settings and seed."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            c = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return {k: c.get(k) for k in ("preset", "task", "init_from", "stages", "sft", "seed")}


@torch.no_grad()
def probe(trainer: Trainer, model, n: int) -> dict:
    """Mean sampled reward (rl.group completions a prompt) and greedy exact match of `model` on the task's
    prompts PROBE_FIRST .. PROBE_FIRST + n - 1 of the first stage, seeded per prompt."""
    rl, r = trainer.rl, trainer.cfg.rl
    stage = trainer.cfg.stages[0]
    sampled, greedy = [], []
    for i in range(n):
        ids, _, answer, _ = rl.prompts.get(PROBE_FIRST + i, stage.seq_len)
        common = dict(max_new_tokens=r.max_new_tokens, top_p=r.top_p, top_k=r.top_k, stop_ids=rl.template.stop_ids,
                      vocab_limit=trainer.tokenizer.vocab_size)
        group = sample(model, [ids], n=r.group, temperature=r.temperature, seed=i, **common)[0]
        sampled += [exact_match(completion_text(rl.template, c.tokens, r.stop), answer) for c in group]
        best = sample(model, [ids], n=1, temperature=0.0, **common)[0][0]
        greedy.append(exact_match(completion_text(rl.template, best.tokens, r.stop), answer))
    return {"prompts": n, "samples": len(sampled), "mean_reward": float(np.mean(sampled)),
            "greedy_exact_match": float(np.mean(greedy))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--init", default="runs/sft", help="the SFT checkpoint (a run folder) to start from")
    ap.add_argument("--preset", default="rl-retrieval")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=None, help="run folder (default: the preset's out_dir)")
    ap.add_argument("--first-last", type=int, default=10, help="steps averaged at each end of the reward curve")
    ap.add_argument("--probe", type=int, default=32, help="fixed task prompts sampled before and after (0: none)")
    ap.add_argument("--json", default=str(ROOT / "bench/results/rl_retrieval.json"))
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = load_train_config(None, a.preset, [*a.set, "task=rl", f"init_from={a.init}"])
    if a.out:
        cfg.out_dir = a.out
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    summary = trainer.run(force=True)
    wall = time.perf_counter() - t0
    probes = None
    if a.probe:
        start = copy.deepcopy(trainer.model)
        load_checkpoint(a.init, start, device=trainer.device)  # the weights the run started from
        probes = {"before": probe(trainer, start, a.probe), "after": probe(trainer, trainer.model, a.probe)}
        print(f"probe ({a.probe} fixed prompts x {cfg.rl.group}): {json.dumps(probes)}")
    recs = [json.loads(x) for x in open(os.path.join(cfg.out_dir, "metrics.jsonl"))]
    steps = [{k: r[k] for k in STEP_KEYS if k in r} for r in recs if "reward" in r]
    rewards = [s["reward"] for s in steps]
    n = min(a.first_last, len(rewards) // 2)
    res = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__},
        "threads": torch.get_num_threads(),
        "config": cfg.summary(),
        "init_from": a.init,
        "init_config": _init_config(a.init),
        "rl": cfg.to_dict()["rl"],
        "sft_task": {k: cfg.to_dict()["sft"][k] for k in ("questions", "kinds", "min_len", "eval_lengths", "eval_examples")},
        "stages": cfg.to_dict()["stages"],
        "steps": len(steps),
        "wall_s": round(wall, 1),
        "reward_first": float(np.mean(rewards[:n])) if n else None,
        "reward_last": float(np.mean(rewards[-n:])) if n else None,
        "reward_first_last_steps": n,
        "accuracy_before": summary["before"]["accuracy"],
        "accuracy_after": summary["after"]["accuracy"],
        "by_kind_before": summary["before"].get("by_kind"),
        "by_kind_after": summary["after"].get("by_kind"),
        "answers_per_length": summary["after"]["turns"] // max(1, len(summary["after"]["accuracy"])),
        "probe": probes,
        "per_step": steps,
        "run_folder": cfg.out_dir,
        "note": "reward: exact match of each sampled completion (temperature rl.temperature) with the reference "
                "answer; accuracy: held-out exact match scored in one forward pass (argmax = reference at every "
                "position, i.e. the greedy answer), the reference answers before it in the conversation",
    }
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in ("reward_first", "reward_last", "probe", "accuracy_before", "accuracy_after",
                                          "wall_s")}, indent=1))
    return 0


if __name__ == "__main__":
    run_script(main)
