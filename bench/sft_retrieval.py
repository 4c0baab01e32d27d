"""CPU: SFT of the small model on the embedded long-context retrieval task, and its exact match on
held-out haystacks by length, before and after (`longctx sft --preset sft-retrieval`).

    OMP_NUM_THREADS=2 python bench/sft_retrieval.py [--preset sft-retrieval] [--set KEY=VALUE ...]
        [--out runs/sft] [--decode 8] [--json bench/results/sft_retrieval.json] [--pretrain STEPS[@SEQ_LEN],...]

--pretrain STEPS[@SEQ_LEN][,STEPS@SEQ_LEN ...] first trains the preset's model on the embedded corpus
(next-token loss; a stage per item, SEQ_LEN tokens (default 1024) x 2048 // SEQ_LEN rows a step, at least
one; into OUT/pretrain) and starts the SFT from it (init_from): the task's held-out files are the corpus's
held-out ones, so pretraining sees none of them.

(OMP_NUM_THREADS=1 where the cores are shared with other jobs: torch's threads spin-wait for each
other, and a step of two threads on two busy cores can take ten times as long.)

Runs the preset through the trainer (its log on stdout), then checks the scoring against real
decoding: for the first --decode held-out examples of the shortest length it samples every answer
greedily through the decode path (`longctx.generate`, from the conversation so far with the
reference answers before it) and scores it with the task's reward (`exact_match`), next to the
one-forward exact match the run reports. Writes the JSON: the command, date, commit and versions,
the config, the before/after accuracy by length and kind and its table, the decode check, the times.
The run folder (the preset's runs/sft) keeps the final checkpoint, which `init_from=runs/sft` starts
another job (RL) from, and accuracy.png, the exact match by length.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from longctx.config.loading import load_train_config  # noqa: E402
from longctx.data.retrieval_task import eval_examples, exact_match  # noqa: E402
from longctx.errors import run_script  # noqa: E402
from longctx.generate import generate  # noqa: E402
from longctx.train.trainer import Trainer  # noqa: E402


def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


@torch.no_grad()
def decode_check(trainer: Trainer, n: int) -> dict:
    """Greedy answers through the decode path, scored by exact_match, beside the one-forward verdicts."""
    data = trainer.sft
    L = data.lengths[0]
    exs = eval_examples(data.task, [L], n)[L]
    agree, hits, total = 0, 0, 0
    model = trainer.model
    for ex in exs:
        enc = data.template.encode(ex.messages)
        x = torch.as_tensor(enc.tokens, device=trainer.device)[None]
        pred = model(x).logits[0].argmax(-1)
        for t, (mi, s, e) in enumerate(enc.spans):
            forward_hit = bool((pred[s - 1:e - 1] == x[0, s:e]).all())
            prompt = torch.as_tensor(data.template.generation_prompt(ex.messages[:mi]), device=trainer.device)[None]
            out = generate(model, prompt, max_new_tokens=e - s + 4, temperature=0, vocab_limit=256)
            text = data.template.completion(out[0, prompt.shape[1]:].tolist())["content"]
            decoded_hit = exact_match(text, ex.answers[t]) == 1.0
            hits += decoded_hit
            agree += decoded_hit == forward_hit
            total += 1
    return {"length": L, "examples": n, "answers": total, "decoded_exact_match": hits / max(total, 1),
            "agreement_with_one_forward_scoring": agree / max(total, 1)}


def pretrain_stages(spec: str) -> list[tuple[int, int]]:
    """'500' or '500@1024,300@4096' -> [(steps, seq_len), ...]."""
    out = []
    for item in spec.split(","):
        steps, _, L = item.strip().partition("@")
        try:
            out.append((int(steps), int(L or 1024)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--pretrain {spec!r}: write STEPS or STEPS@SEQ_LEN items, comma-separated "
                                             "(e.g. 500@1024,300@4096)") from None
        if out[-1][0] < 1 or out[-1][1] < 16:
            raise argparse.ArgumentTypeError(f"--pretrain {spec!r}: each stage needs at least 1 step and 16 tokens")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="sft-retrieval")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=None, help="run folder (default: the preset's out_dir)")
    ap.add_argument("--decode", type=int, default=8, help="held-out examples whose answers are decoded greedily")
    ap.add_argument("--json", default=str(ROOT / "bench/results/sft_retrieval.json"))
    ap.add_argument("--pretrain", type=pretrain_stages, default=[], metavar="STEPS[@SEQ_LEN],...",
                    help="first pretrain the model on the embedded corpus (a stage per item; SEQ_LEN tokens, default "
                         "1024, x 2048 // SEQ_LEN rows a step) and start SFT from it")
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = load_train_config(None, a.preset, [*a.set, "task=sft"])
    if a.out:
        cfg.out_dir = a.out
    t0 = time.perf_counter()
    pretrain_s = None
    if a.pretrain:
        # the first stage as before (2e-3, cosine after warm-up), later ones at 1e-3 decaying linearly
        first, later = "lr=2e-3", 'lr=1e-3, schedule="linear"'
        stages = ", ".join(f"{{seq_len={L}, steps={n}, batch_size={max(1, 2048 // L)}, warmup={min(10 if i else 20, n)}, "
                           f"{later if i else first}}}" for i, (n, L) in enumerate(a.pretrain))
        model_sets = [x for x in a.set if x.startswith("model.")]  # the SFT's model is the pretrained one
        pre = load_train_config(None, a.preset, [*model_sets, f"stages=[{stages}]", "task=pretrain"])
        pre.out_dir = os.path.join(cfg.out_dir, "pretrain")
        Trainer(pre).run(force=True)
        cfg.init_from = pre.out_dir
        pretrain_s = round(time.perf_counter() - t0, 1)
    trainer = Trainer(cfg)
    summary = trainer.run(force=True)
    train_s = time.perf_counter() - t0
    check = decode_check(trainer, a.decode) if a.decode > 0 else None
    res = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "numpy": __import__("numpy").__version__,
        "device": str(trainer.device),
        "gpu": torch.cuda.get_device_name(trainer.device) if trainer.device.type == "cuda" else None,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "config": cfg.summary(),
        "run": cfg.out_dir,  # its final checkpoint, metrics.jsonl and accuracy.png
        "sft": cfg.to_dict()["sft"],
        "steps": summary["step"],
        "pretrain_stages": [{"steps": n, "seq_len": L} for n, L in a.pretrain],
        "pretrain_s": pretrain_s,
        "wall_s": round(train_s, 1),  # the job: data, evaluations before and after, training, checkpoint, plots
        "decode_check_s": round(time.perf_counter() - t0 - train_s, 1),
        "accuracy_table": summary.get("accuracy_table"),
        "accuracy_before": summary["before"]["accuracy"],
        "accuracy_after": summary["after"]["accuracy"],
        "by_kind_before": summary["before"].get("by_kind"),
        "by_kind_after": summary["after"].get("by_kind"),
        "answers_per_length": summary["after"]["turns"] // max(1, len(summary["after"]["accuracy"])),
        "eval_loss_before": summary["before"]["loss"],
        "eval_loss_after": summary["after"]["loss"],
        "decode_check": check,
        "note": "exact match of each held-out answer scored in one forward pass (argmax = reference at every "
                "position, i.e. the greedy answer), the reference answers before it in the conversation",
    }
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in ("accuracy_before", "accuracy_after", "by_kind_after", "decode_check",
                                          "wall_s")}, indent=1))
    return 0


if __name__ == "__main__":
    run_script(main)
