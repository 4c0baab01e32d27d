"""h200-ref on two GPUs against one, through the trainer's run loop under torchrun: data-parallel
scaling at 128k and at 1M tokens a sequence (the sequence-chunked step on each rank), and context
parallelism at the longest length its whole-sequence step takes, in each KDA mode, against one GPU
at equal tokens per GPU. Each run's per-rank peaks beside the estimate, step time and tokens/s.

    python bench/two_gpus.py --predict --out DIR          # the estimator's per-GPU peaks (any machine)
    python bench/two_gpus.py --out DIR                    # every run (two GPUs)
    python bench/two_gpus.py --dry-run --out DIR          # every run on one GPU at 1/16 of its length

The runs write no checkpoint (bench/trainer_runs.py). What the
plan does not take is recorded as the estimator's sentence, not run: 4M tokens with CP 2 leaves a
tensor past 2^31 elements on each rank, and the sequence-chunked step that would hold it runs over
data-parallel ranks only (docs/design/sequence_chunks.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from timing import env_record, write_results  # noqa: E402
from trainer_runs import run_child, step_records, train_without_checkpoints  # noqa: E402

M = 1 << 20
K = 1 << 10
# name -> (processes, tokens a sequence, global batch, extra settings, the one-GPU run it scales against)
RUNS = {
    "one-128k": (1, 128 * K, 1, [], None),
    "dp2-128k": (2, 128 * K, 2, [], "one-128k"),
    "one-1m": (1, M, 1, [], None),
    "dp2-1m": (2, M, 2, [], "one-1m"),
    "one-256k": (1, 256 * K, 1, [], None),
    "cp2-512k-hidden_gather": (2, 512 * K, 1, ["parallel.cp=2", "parallel.kda_cp=hidden_gather"], "one-256k"),
    "cp2-512k-qkv_a2a": (2, 512 * K, 1, ["parallel.cp=2", "parallel.kda_cp=qkv_a2a"], "one-256k"),
    "cp2-512k-chunk_state": (2, 512 * K, 1, ["parallel.cp=2", "parallel.kda_cp=chunk_state"], "one-256k"),
    "cp2-4m": (2, 4 * M, 1, ["parallel.cp=2", "parallel.kda_cp=chunk_state"], None),
}


def settings(name: str, steps: int, scale: int = 1) -> list[str]:
    procs, S, batch, extra, _ = RUNS[name]
    return ["preset=h200-ref", f"stages=[{{seq_len = {S // scale}, steps = {steps}, lr = 1e-4, batch_size = {batch}, "
            "warmup = 0}]", "data.eval_windows=0", "ckpt_every=0", *extra]


def predict(name: str) -> dict:
    """The estimator's per-GPU peak for the run's plan on H200s (bf16 activations, the kernels the
    H200 runs), or the sentence that refuses it: what the trainer's plan does there, on any machine."""
    from longctx.config.loading import load_train_config
    from longctx.errors import ConfigError
    from longctx.memory.plan import MemoryPlan
    from longctx.memory.planner import auto_plan, stage_cluster

    procs = RUNS[name][0]
    cfg = load_train_config(None, None, settings(name, 2))
    cluster, tokens = stage_cluster(cfg, cfg.stages[0], procs)
    try:
        plan, e = auto_plan(cfg.model, tokens, MemoryPlan.from_dict(cfg.memory), 1 if cluster is None else cluster.cp,
                            "h200", 2, cfg.kernels, cluster=cluster)
    except ConfigError as err:
        return {"refused": str(err)}
    return {"estimate_gib": round(e["gpu_bytes"] / 2**30, 2), "fits": e["fits"], "seq_chunk": plan.seq_chunk,
            "recompute": plan.recompute, "peak_phase": e["peak_phase"]}


def run(name: str, steps: int, scale: int, out: Path, timeout: float, procs: int) -> dict:
    run_dir = out / f"run-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)] if procs > 1 else []
    cmd = [sys.executable, *launcher, str(Path(__file__).resolve()), "--child", name, "--steps", str(steps),
           "--scale", str(scale), "--out", str(run_dir)]
    rc, log, wall_s = run_child(cmd, timeout)
    (out / f"{name}.log").write_text(log)
    rec = {"run": name, "processes": procs, "seq_len": RUNS[name][1] // scale, "global_batch": RUNS[name][2],
           "rc": rc, "wall_s": wall_s, "trainer_settings": settings(name, steps, scale)}
    steps_ = step_records(run_dir)
    if steps_:
        last = steps_[-1]
        rec.update({k: last.get(k) for k in ("step_s", "tokens_per_s", "peak_gib", "peak_gib_ranks", "estimate_gib")})
        rec["tokens_per_s_per_gpu"] = last["tokens_per_s"] / procs
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "two_gpus"))
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    ap.add_argument("--predict", action="store_true", help="the estimator's peaks only; runs nothing")
    ap.add_argument("--dry-run", action="store_true", help="every run in one process at 1/16 of its length")
    ap.add_argument("--steps", type=int, default=2, help="steps a run (the last one's time and peaks are reported)")
    ap.add_argument("--timeout", type=float, default=540, help="seconds a run")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--scale", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return train_without_checkpoints(settings(args.child, args.steps, args.scale), args.out)
    names = args.runs.split(",")
    bad = [n for n in names if n not in RUNS]
    if bad:
        sys.exit(f"error: --runs {bad[0]!r} is unknown; choose from {', '.join(RUNS)}.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {**env_record(), "predictions": {n: predict(n) for n in names}, "runs": []}
    if args.predict:
        write_results(out, "two_gpus_predicted.json", res)
        return
    scale = 16 if args.dry_run else 1
    for n in names:
        if "refused" in res["predictions"][n]:
            continue
        rec = run(n, args.steps, scale, out, args.timeout, 1 if args.dry_run else RUNS[n][0])
        base = RUNS[n][4]
        done = {r["run"]: r for r in res["runs"]}
        if base in done and rec.get("tokens_per_s") and done[base].get("tokens_per_s"):
            # equal tokens per GPU: the run's throughput over the processes' worth of the one-GPU run's
            rec["scaling_efficiency"] = rec["tokens_per_s"] / (rec["processes"] * done[base]["tokens_per_s"])
        print(json.dumps({k: rec.get(k) for k in ("run", "rc", "step_s", "peak_gib_ranks", "estimate_gib")}), flush=True)
        res["runs"].append(rec)
        write_results(out, "two_gpus_dry_run.json" if args.dry_run else "two_gpus.json", res)


if __name__ == "__main__":
    main()
