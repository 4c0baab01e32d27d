"""Shared by the benchmarks: timing (CUDA events after warm-up, the median) and the provenance every
results JSON starts with (GPU, versions, command, date), and writing that JSON."""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def timed(fn, warmup: int, reps: int, device: str = "cuda") -> float:
    """Median milliseconds over `reps` calls after `warmup` calls: CUDA events on "cuda", the wall
    clock elsewhere (the benchmarks' --cpu-smoke modes)."""
    cuda = device == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    ms = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ms.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ms)


def provenance(gpu: str | None = None) -> dict:
    """The head of a results JSON: which GPU (default: the current CUDA device), torch and triton
    versions, the command line and the date."""
    import triton

    return {"gpu": gpu if gpu is not None else torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "command": " ".join([sys.executable] + sys.argv),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def write_results(out_dir, name: str, res: dict) -> Path:
    """OUT_DIR/NAME (created if missing), the results indented, and a line saying where."""
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    print("wrote", path)
    return path
