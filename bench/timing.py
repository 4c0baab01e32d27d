"""Shared timing for the benchmarks: CUDA events after warm-up, the median."""

from __future__ import annotations

import statistics

import torch


def timed(fn, warmup: int, reps: int) -> float:
    """Median milliseconds over `reps` CUDA-event-timed calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ms = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms)
