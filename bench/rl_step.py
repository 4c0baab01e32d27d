"""GPU: RL steps of h200-ref on 128k-token trajectories (rollout + train), their time split, and the
rollout-vs-trainer log-prob gap in bf16 and in fp32.

    python bench/rl_step.py --out OUT [--seq-len 131072] [--group 4] [--new 32] [--steps 2] [--fp32-seq-len S,...]
                            [--fp32-only]

1. `longctx rl`'s own steps (the Trainer, task = rl, the embedded retrieval task's prompts) with the
   h200-ref model in the trainer's GPU precision (bf16 autocast, fp32 weights): --steps steps of one
   prompt of about --seq-len tokens, rl.group completions of --new tokens each, rl.micro_batch = 1 (a
   trajectory per forward and backward). Each step's line has the rollout time, the step time, the
   mean reward and `logp_gap`, the mean |sampler log-prob - trainer log-prob| over the completion
   tokens (the sampler decodes token by token through the KDA states and DSA caches, the trainer
   runs one training forward over prompt + completion).
2. The rollout's split: the prompt's prefill alone (sample with one new token) beside the whole rollout.
3. The same gap in fp32: the step-1 weights cast to fp32, one prompt of each --fp32-seq-len length
   (default --seq-len), --new tokens sampled without autocast and scored by the fp32 training forward.
   --fp32-only skips 1 and 2 (the initial weights, cast to fp32) and writes OUT/rl_gap_fp32.json.

The weights are h200-ref's initialisation (no trained h200-ref checkpoint ships), with the output
head re-drawn at std --head-std (default 3/sqrt(hidden), as tests/test_end_to_end_gpu.py does): at
the initial std every next-token distribution is nearly uniform and any two paths' log-probs agree,
while logits of std ~3, as a trained LM's, make the gap measure the two paths' numerics. The rewards
are those of an untrained policy. At initialisation the MoE routers' scores are nearly tied, so bf16
rounding can send a token to other experts in the sampler than in the trainer: the steps replay the
sampler's routing (rl.replay_routing, the default), and the separate gaps are measured both with the
replay and without it (`*_free`), which is what the replay saves.
Writes OUT/rl_step.json (bench/results/rl_step.json is the tracked copy).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from timing import env_record, write_results  # noqa: E402

from longctx.config.loading import load_train_config  # noqa: E402
from longctx.errors import run_script  # noqa: E402
from longctx.generate import sample  # noqa: E402
from longctx.layers.moe import routing_tape  # noqa: E402
from longctx.train.rl import completion_logprobs, replay_tape  # noqa: E402
from longctx.train.rollouts import Rollout  # noqa: E402
from longctx.train.trainer import Trainer  # noqa: E402

STEP_KEYS = ("step", "reward", "length", "prompt_tokens", "clip_frac", "logp_gap", "loss", "grad_norm", "step_s",
             "rollout_s", "tokens_per_s", "peak_gib", "impl")


def timed(fn):
    """(fn(), its seconds), the GPU's queue drained at both ends."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def gap(model, trainer, prompt, new: int, seed: int, autocast: bool) -> dict:
    """Sample `new` tokens after `prompt` (temperature 1) and score them with the training forward: the
    mean and max |Δ log-prob| over the completion, with the times of both; with the sampler's MoE routing
    replayed in that forward (rl.replay_routing, what the RL step does) and without (`*_free`)."""
    dev, dt = trainer.device, trainer.dtype
    sampled = {}
    with torch.no_grad(), torch.autocast(dev.type, dtype=dt, enabled=autocast):
        c, sample_s = timed(lambda: sample(model, [prompt], n=1, max_new_tokens=new, temperature=1.0, seed=seed,
                                           vocab_limit=trainer.tokenizer.vocab_size,
                                           cache_dtype=dt if autocast else None, record_routing=True)[0][0])
        tape = replay_tape(model, [Rollout(prompt, c.tokens, c.logprobs, "", None, 0, routing=c.routing)], [0])
        for name, t in (("", tape), ("_free", None)):
            if name and tape is None:
                break  # no MoE layer: nothing to replay, one measurement
            with routing_tape(t):
                sampled[name] = timed(lambda: completion_logprobs(model, [(prompt, c.tokens)], dev)[0].float().cpu())
    model.clear_aux()
    out = {"prompt_tokens": int(len(prompt)), "new_tokens": len(c.tokens), "routing_replayed": tape is not None,
           "sample_s": sample_s}
    for name, (lp, forward_s) in sampled.items():
        d = (lp - torch.tensor(c.logprobs, dtype=torch.float32)).abs()
        out.update({f"mean_abs_gap{name}": float(d.mean()), f"max_abs_gap{name}": float(d.max()),
                    f"train_forward_s{name}": forward_s})
    out["mean_logprob"] = float(sampled[""][0].mean())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "rl_step"))
    ap.add_argument("--model", default="h200-ref")
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new", type=int, default=32, help="tokens sampled per completion")
    ap.add_argument("--steps", type=int, default=2, help="RL steps (the first compiles the kernels)")
    ap.add_argument("--fp32-seq-len", help="prompt tokens of the fp32 gap, comma-separated (default --seq-len; 0: skip)")
    ap.add_argument("--fp32-only", action="store_true", help="only the fp32 gap, from the initial weights")
    ap.add_argument("--head-std", type=float, help="std of the re-drawn output head (default 3/sqrt(hidden); 0: keep)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args()
    S = a.seq_len
    fp32_lens = [int(x) for x in (a.fp32_seq_len or str(S)).split(",") if int(x) > 0]
    name = "rl_gap_fp32.json" if a.fp32_only else "rl_step.json"
    sets = ["task=rl", f"stages=[{{seq_len={S}, steps={a.steps}, lr=1e-6, batch_size=1}}]",
            f"rl.group={a.group}", f"rl.max_new_tokens={a.new}", "rl.micro_batch=1", "sft.eval_examples=0",
            f"sft.min_len={S - a.new}", *a.set]
    cfg = load_train_config(None, "rl-retrieval", sets)
    cfg.model = load_train_config(None, a.model).model  # the model preset, its vocabulary sized to the tokenizer
    cfg.out_dir = os.path.join(a.out, "run")
    res = {**env_record(), "model": a.model, "seq_len": S, "group": a.group, "new_tokens": a.new,
           "config": cfg.summary(), "note": __doc__.split("\n\n")[2].replace("\n", " ")}

    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    head_std = 3 / cfg.model.hidden_size ** 0.5 if a.head_std is None else a.head_std
    if head_std:
        with torch.no_grad():
            w = trainer.model.lm_head.weight
            w.normal_(0.0, head_std, generator=torch.Generator(w.device).manual_seed(0))
    res["head_std"] = head_std
    trainer.save = lambda *args, **kw: None  # no checkpoint: h200-ref's weights and optimizer state are tens of GB
    model, rl = trainer.model, trainer.rl
    if not a.fp32_only:
        steps_and_bf16(a, trainer, res, cfg, t0)
    if fp32_lens:
        trainer.opt = None  # the optimizer state is not needed for the fp32 check: free its memory
        model.float()
        res["gap_fp32"] = []
        for i, n in enumerate(fp32_lens):
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            g = gap(model, trainer, rl.prompts.get(10_001 + i, n)[0], a.new, 3, autocast=False)
            if torch.cuda.is_available():
                g["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            res["gap_fp32"].append(g)
            res["impl_fp32"] = model.impl_report()
            print("fp32:", json.dumps(g))
            write_results(a.out, name, res)
    write_results(a.out, name, res)
    return 0


def steps_and_bf16(a, trainer, res: dict, cfg, t0: float) -> None:
    """Parts 1 and 2: the RL steps through the trainer, the prefill alone, the bf16 gap."""
    trainer.run(force=True)
    res["trainer_wall_s"] = time.perf_counter() - t0
    recs = [json.loads(x) for x in open(os.path.join(cfg.out_dir, "metrics.jsonl"))]
    res["steps"] = [{k: r[k] for k in STEP_KEYS if k in r} for r in recs if "reward" in r]
    for s in res["steps"]:
        s["train_s"] = s["step_s"] - s["rollout_s"]
    print(json.dumps(res["steps"], indent=1))
    write_results(a.out, "rl_step.json", res)

    model, rl = trainer.model, trainer.rl
    S = a.seq_len
    prompt = rl.prompts.get(10_000, S)[0]
    with torch.no_grad(), torch.autocast(trainer.device.type, dtype=trainer.dtype):
        _, res["prefill_s"] = timed(lambda: sample(model, [prompt], n=a.group, max_new_tokens=1, temperature=1.0,
                                                   seed=1, vocab_limit=trainer.tokenizer.vocab_size,
                                                   cache_dtype=trainer.dtype))
    model.clear_aux()
    res["prefill_prompt_tokens"] = int(len(prompt))
    res["gap_bf16"] = gap(model, trainer, prompt, a.new, 2, autocast=trainer.dtype != torch.float32)
    print("bf16:", json.dumps(res["gap_bf16"]))
    write_results(a.out, "rl_step.json", res)


if __name__ == "__main__":
    run_script(main)
