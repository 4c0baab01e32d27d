"""Training steps of a few GLM-5.3-Flash-shaped layers on one GPU, through the trainer's run loop
(`longctx train`'s, in a process per case), with each step's measured peak beside the estimate the
trainer's plan made (bench/trainer_runs.py: no checkpoints).

The shapes are the published model's (hidden 4096; KDA 64 x 128; MLA 64 heads, kv_lora 512; the
indexer 32 x 128 with its k-pool; routed experts of width 2048, 8 a token, one shared), the layer
count and the routed experts per MoE layer are the case's. One H200 holds no MoE layer of all 288
experts under fp32 AdamW: 288 x 3 x 4096 x 2048 = 7.25 B expert parameters at 16 bytes each (weight,
gradient, two moments) are 116 GB before any activation. So the MoE cases hold an expert-parallel
rank's share: 288 / 8 = 36 experts sees, per rank, the token-expert pairs of EP 8 with 64k tokens a
rank.

    python bench/glm_layers.py --out bench/out/glm_layers [--cases dense4,ep8share4] [--seq-len 65536]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from timing import env_record, write_results  # noqa: E402
from trainer_runs import run_child, step_records, train_without_checkpoints  # noqa: E402

# name -> (layer pattern, mlp pattern, routed experts)
CASES = {
    "dense4": ("KKKD", "dddd", 288),  # the attention layers' shapes, dense MLPs: no expert at all
    "ep8share4": ("KKKD", "dddm", 36),  # the published first four layers, one MoE with an EP-8 rank's experts
    "ep8share8": ("KKKDKKKD", "dddmmmmm", 36),  # eight layers, five MoE
    "smoke": ("KKKD", "dddm", 8),  # the tiny preset on the CPU: checks the script
}


def case_sets(name: str, seq_len: int, steps: int) -> list[str]:
    lp, mp, experts = CASES[name]
    return [f"preset={'tiny' if name == 'smoke' else 'glm-5.3-flash'}", f"model.num_layers={len(lp)}", f"model.layer_pattern={lp}",
            f"model.mlp_pattern={mp}", f"model.n_routed_experts={experts}",
            f"stages=[{{seq_len = {seq_len}, steps = {steps}, lr = 1e-4, batch_size = 1, warmup = 0}}]",
            "data.eval_windows=0", "ckpt_every=0"]


def run_case(name: str, seq_len: int, steps: int, out: Path, timeout: float) -> dict:
    run_dir = out / f"run-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--seq-len", str(seq_len),
           "--steps", str(steps), "--out", str(run_dir)]
    rc, log, wall_s = run_child(cmd, timeout)
    (out / f"{name}.log").write_text(log)
    rec = {"case": name, "layers": CASES[name][0], "mlp": CASES[name][1], "routed_experts": CASES[name][2],
           "seq_len": seq_len, "rc": rc, "wall_s": wall_s, "trainer_settings": case_sets(name, seq_len, steps)}
    steps_ = step_records(run_dir)
    rec["steps"] = [{k: s.get(k) for k in ("step", "loss", "step_s", "tokens_per_s", "peak_gib", "estimate_gib")}
                    for s in steps_]
    if steps_:
        last = steps_[-1]
        rec.update(peak_gib=last.get("peak_gib"), estimate_gib=last.get("estimate_gib"), step_s=last.get("step_s"))
        if last.get("peak_gib") and last.get("estimate_gib"):
            rec["estimate_over_peak"] = round(last["estimate_gib"] / last["peak_gib"] - 1, 4)
    plan = [line for line in log.splitlines() if line.startswith(("model:", "memory plan:", "kernels:"))]
    rec["plan_lines"] = plan[:3]
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "glm_layers"))
    ap.add_argument("--cases", default="dense4,ep8share4", help=f"comma-separated subset of {', '.join(CASES)}")
    ap.add_argument("--seq-len", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=2, help="steps per case (the last one's peak and time are reported)")
    ap.add_argument("--timeout", type=float, default=400, help="seconds per case")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return train_without_checkpoints(case_sets(args.child, args.seq_len, args.steps), args.out)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {**env_record(), "runs": []}
    for name in args.cases.split(","):
        if name not in CASES:
            sys.exit(f"error: --cases {name!r} is unknown; choose from {', '.join(CASES)}.")
        rec = run_case(name, args.seq_len, args.steps, out, args.timeout)
        print(json.dumps({k: rec.get(k) for k in ("case", "rc", "peak_gib", "estimate_gib", "step_s", "wall_s")}), flush=True)
        res["runs"].append(rec)
        write_results(out, "glm_layers.json", res)
    if os.environ.get("OUT"):  # the device tool brings back what lies under $OUT
        shutil.copy(out / "glm_layers.json", Path(os.environ["OUT"]) / "glm_layers.json")


if __name__ == "__main__":
    main()
