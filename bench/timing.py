"""Shared timing for the benchmarks: CUDA events after warm-up, the median."""

from __future__ import annotations

import statistics
import time

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
