"""The per-GPU memory of a GLM-5.3-Flash training step on clusters of H200s, on paper (`longctx estimate`).

    python bench/estimate_table.py [--preset glm-5.3-flash] [--gpus 8,16,32,64] [--seq-lens 65536,262144,1048576]
                                   [--host-gib 125] [--param-dtype fp32] [--out bench/results]

For each number of GPUs and each length: how a full training step (one sequence a data-parallel rank,
AdamW, bf16 autocast) fits (`longctx.memory.planner.fit_on`: the AdamW moments on the GPU first, then
on the host; the largest expert parallelism; the KDA context-parallel modes in the order of the bytes
they send, each with its smallest cp that fits; the cheapest memory plan of recompute and block
offload), its per-GPU peak and the term that dominates it; and for each length the smallest cluster of
8, 16, 32, ... GPUs on which it fits. Writes OUT/estimate_glm53flash.json (command, date, commit, the
assumptions, every cell) and prints the markdown table. It runs nothing on a GPU: every figure is the
byte model's (longctx/memory/model_bytes.py), whose many-GPU terms are counted from the tensors the
code allocates.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import env_record, write_results  # noqa: E402

from longctx.config import preset  # noqa: E402
from longctx.memory.model_bytes import ALLOCATOR_SLACK, GIB, GPU_FIT, GPUS, HOST_FIT  # noqa: E402
from longctx.memory.plan import MemoryPlan  # noqa: E402
from longctx.memory.planner import dominant_term, fit_cluster, fit_on  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _cell(row: dict) -> dict:
    e, cl = row["estimate"], row["cluster"]
    out = {"gpus": row["gpus"], "fits": row["fits"], "why": row["why"]}
    if e is not None:
        name, b = dominant_term(e)
        out.update(cluster=dataclasses.asdict(cl), dp=cl.dp, cp=cl.cp, ep=cl.ep, plan=row["plan"].to_dict(),
                   gpu_allocated_gib=round(e["gpu_bytes"] / GIB, 2), gpu_reserved_gib=round(e["gpu_reserved_bytes"] / GIB, 2),
                   host_gib=round(e["host_bytes"] / GIB, 2), peak_phase=e["peak_phase"],
                   dominant_term=name, dominant_gib=round(b / GIB, 2))
    return out


def _length(n: int) -> str:
    return f"{n // 2**20}M" if n % 2**20 == 0 else f"{n // 1024}k"


def _text(c: dict) -> str:
    if "cp" not in c:
        return "no: " + (c["why"] or "")
    moments = ", moments on host" if c["cluster"]["opt_offload"] else ""
    mode = f" {c['cluster']['kda_cp']}" if c["cp"] > 1 else ""
    plan = c["plan"]
    mem = f"recompute {plan['recompute']}" + (f", offload {plan['offload']}" if plan["offload"] not in ("0", "off") else "")
    verdict = "**fits**" if c["fits"] else "no"
    return (f"{verdict} {c['gpu_reserved_gib']:.0f} GiB (dp {c['dp']} x cp {c['cp']}{mode}, ep {c['ep']}{moments}; {mem}); "
            f"dominant: {c['dominant_term']} {c['dominant_gib']:.0f} GiB")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="glm-5.3-flash")
    p.add_argument("--gpus", type=_ints, default=[8, 16, 32, 64])
    p.add_argument("--seq-lens", type=_ints, default=[65536, 262144, 1048576])
    p.add_argument("--gpu", default="h200", choices=sorted(GPUS))
    p.add_argument("--host-gib", type=float, default=None, help="host memory per GPU (default: the --gpu entry's)")
    p.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="what FSDP's all-gather delivers (fp32: as the trainer shards)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = p.parse_args(argv)
    cfg = preset(a.preset)
    host = None if a.host_gib is None else a.host_gib * GIB
    settings = dict(param_bytes=4 if a.param_dtype == "fp32" else 2, host=host)
    cap = GPUS[a.gpu]
    cells, smallest = {}, {}
    for S in a.seq_lens:
        for G in a.gpus:
            cells[f"{G}x{S}"] = _cell(fit_on(cfg, S, MemoryPlan(), G, a.gpu, **settings))
        r = fit_cluster(cfg, S, MemoryPlan(), a.gpu, **settings)
        smallest[str(S)] = None if r["gpus"] is None else _cell(r["found"])
    assumptions = {
        "gpu": a.gpu, "gpu_memory_gib": round(cap["memory"] / GIB, 1), "host_per_gpu_gib": round((host or cap["host"]) / GIB, 1),
        "fits": f"estimated allocated peak x {ALLOCATOR_SLACK} (allocator slack) <= {GPU_FIT:.0%} of the GPU, "
                f"host bytes <= {HOST_FIT:.0%} of the host per GPU",
        "step": "one sequence per data-parallel rank (batch = dp), bf16 autocast, AdamW with fp32 master weights and moments, "
                "fp32 gradients; FSDP2 over all GPUs, gathers in " + a.param_dtype,
        "not_counted": "the optimizer step's own transients (after the backward, not at the peak); uneven expert routing "
                       "beyond one MoE chunk; NCCL's buffers",
        "source": "longctx/memory/model_bytes.py (on paper; many-GPU terms counted from the code, not measured)",
    }
    res = {**env_record("none (on paper)"), "preset": a.preset, "assumptions": assumptions, "cells": cells,
           "smallest_cluster": smallest}
    write_results(a.out, "estimate_glm53flash.json" if a.preset == "glm-5.3-flash" else f"estimate_{a.preset}.json", res)
    print(f"\n{a.preset}: per-GPU memory of a training step ({assumptions['gpu']} {assumptions['gpu_memory_gib']} GiB, "
          f"host {assumptions['host_per_gpu_gib']} GiB per GPU)\n")
    print("| GPUs | " + " | ".join(_length(S) for S in a.seq_lens) + " |")
    print("|---|" + "---|" * len(a.seq_lens))
    for G in a.gpus:
        print(f"| {G} | " + " | ".join(_text(cells[f'{G}x{S}']) for S in a.seq_lens) + " |")
    print("| smallest | " + " | ".join((f"{smallest[str(S)]['gpus']} GPUs" if smallest[str(S)] else "none up to 4096")
                                      for S in a.seq_lens) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
