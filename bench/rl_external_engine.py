"""The loop an outside rollout engine (vLLM, SGLang) runs with `longctx rl`, end to end on the CPU,
with longctx's own decode path standing in for the engine:

    OMP_NUM_THREADS=1 python bench/rl_external_engine.py [--init runs/sft] [--rounds 3] [--preset rl-retrieval]
        [--set KEY=VALUE ...] [--out runs/rl-external] [--compare]

Round r (0-based) is what an engine's driver does for step r:

1. the engine loads the policy: for r = 0 the starting checkpoint, exported once with
   `longctx export`; then OUT/policy, which the run rewrites after every step (rl.export_every = 1)
   and names in OUT/policy.json ({"step": r, "path": ...}, written last);
2. it samples rl.group completions of each of stage.batch_size prompts, with the log-probability of
   every sampled token, and writes them to OUT/engine/rollouts-r.jsonl: "step": r, the prompt as
   messages, the completion's token ids, their log-probs and the reference answer (no reward: the
   run scores them with rl.reward);
3. `longctx rl --set rl.rollouts=OUT/engine/rollouts-r.jsonl --max-steps r+1` (with --resume after
   the first round) trains step r on them, checkpoints, and exports the policy for round r + 1.

Each step line's dlogp is then the engine's mismatch with the trainer (~1e-7 here: the same fp32
numbers after the export round trip). --compare also runs the same steps in-process (`longctx rl`
sampling itself) into OUT/in-process: the stand-in engine draws what the run would draw (the same
prompts and the same seed per step, `rl.rollout_seed`), so every step's numbers must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from longctx.config.loading import load_train_config  # noqa: E402
from longctx.data.tokenizers import load_tokenizer  # noqa: E402
from longctx.errors import run_script  # noqa: E402
from longctx.generate import sample  # noqa: E402
from longctx.hf_interop import load_pretrained  # noqa: E402
from longctx.train.rl import rollout_seed  # noqa: E402
from longctx.train.rollouts import TaskPrompts  # noqa: E402
from longctx.train.sft import SFTData  # noqa: E402

KEYS = ("reward", "length", "loss", "grad_norm", "clip_frac", "logp_gap")


def longctx(*args: str) -> None:
    cmd = [sys.executable, "-m", "longctx", *args]
    print("$ longctx " + " ".join(args), flush=True)
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    if rc:  # the command has said why (one line, for a mistake in the settings)
        sys.exit(rc)


class StandInEngine:
    """What an engine does between two steps, with longctx's decode path: load the exported policy (the
    transformers layout, as vLLM and SGLang read it), sample, write the rollouts file."""

    def __init__(self, cfg):
        self.cfg, self.r = cfg, cfg.rl
        self.tok = load_tokenizer(cfg.data.tokenizer)
        data = SFTData(cfg, self.tok, quiet=True)  # the task's training split: the prompts a run draws
        self.template = data.template
        self.prompts = TaskPrompts(data.source.task, data.template, cfg.sft.min_len, self.r.max_new_tokens, cfg.seed)

    def round(self, policy: str, step: int, path: str) -> None:
        model = load_pretrained(policy)
        stage = self.cfg.stages[0]  # one stage: prompt k of step s is k = s * batch_size + i, as in the run
        asked = [self.prompts.get(step * stage.batch_size + i, stage.seq_len) for i in range(stage.batch_size)]
        groups = sample(model, [a[0] for a in asked], n=self.r.group, max_new_tokens=self.r.max_new_tokens,
                        temperature=self.r.temperature, top_p=self.r.top_p, top_k=self.r.top_k,
                        stop_ids=self.template.stop_ids, stop_strings=self.r.stop, decode=self.tok.decode,
                        vocab_limit=self.tok.vocab_size, seed=rollout_seed(self.cfg.seed, step))
        with open(path, "w") as f:
            for (_, messages, answer, length), comps in zip(asked, groups):
                for c in comps:
                    f.write(json.dumps({"step": step, "prompt": messages, "completion_ids": c.tokens,
                                        "logprobs": c.logprobs, "answer": answer, "prompt_len": length}) + "\n")


def steps_of(run: str) -> list[dict]:
    return [r for r in map(json.loads, open(os.path.join(run, "metrics.jsonl"))) if "reward" in r]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--init", default="runs/sft", help="the checkpoint RL starts from (a run folder)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--preset", default="rl-retrieval")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="runs/rl-external")
    ap.add_argument("--compare", action="store_true", help="also run the steps in-process and compare the numbers")
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    sets = [*a.set, f"init_from={a.init}", "rl.export_every=1", f"stages.0.steps={a.rounds}"]
    cfg = load_train_config(None, a.preset, [*sets, "task=rl"])
    if len(cfg.stages) != 1:
        sys.exit("this script drives a one-stage run; give --set stages=[...] with one stage")
    args = ["--preset", a.preset, *(x for s in sets for x in ("--set", s)), "--out", a.out]
    engine_dir = os.path.join(a.out, "engine")
    os.makedirs(engine_dir, exist_ok=True)
    start = os.path.join(engine_dir, "policy-start")
    longctx("export", "--checkpoint", a.init, "--out", start, "--force")
    engine = StandInEngine(cfg)
    t0 = time.perf_counter()
    for r in range(a.rounds):
        policy = start
        if r > 0:
            said = json.load(open(os.path.join(a.out, "policy.json")))
            assert said["step"] == r, f"the run exported the policy of step {said['step']}, not {r}"
            policy = said["path"]
        path = os.path.join(engine_dir, f"rollouts-{r}.jsonl")
        engine.round(policy, r, path)
        print(f"engine: step {r}: {cfg.stages[0].batch_size} x {cfg.rl.group} rollouts from {policy} -> {path}",
              flush=True)
        longctx("rl", *args, "--set", f"rl.rollouts={path}", "--max-steps", str(r + 1),
                *(["--resume"] if r else ["--force"]))
    took = time.perf_counter() - t0
    ext = steps_of(a.out)
    print(f"\n{a.rounds} rounds in {took:.0f} s")
    for rec in ext:
        print("step {step}: reward {reward:.3f} | len {length:.1f} | dlogp {logp_gap:.1e}".format(**rec))
    if a.compare:
        inproc = os.path.join(a.out, "in-process")
        longctx("rl", "--preset", a.preset, *(x for s in sets for x in ("--set", s)), "--out", inproc, "--force")
        ins = steps_of(inproc)
        worst = max(abs(x[k] - y[k]) / max(1.0, abs(y[k])) for x, y in zip(ext, ins) for k in KEYS)
        print(f"in-process run: the same {len(ins)} steps; largest difference of {', '.join(KEYS)}: {worst:.1e}")
        if len(ins) != len(ext) or worst > 1e-5:
            return 1
    return 0


if __name__ == "__main__":
    run_script(main)
