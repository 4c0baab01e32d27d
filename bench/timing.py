"""Shared by the benchmarks: timing (CUDA events after warm-up, the median; the kernels' own times under
the profiler), the record every results
JSON starts with (GPU, versions, command, date, commit: `env_record`), and writing that JSON."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


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


def kernel_times(fn, reps: int = 1) -> dict[str, float]:
    """Milliseconds per call of each CUDA kernel fn launches (names cut at 48 characters), summed under the
    profiler over `reps` calls: the GPU's own time. Event timing of a call also counts the gaps where the
    GPU waits for the host's launches, which dominate an op of a millisecond or two."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {e.key.split("(")[0][:48]: round(e.device_time_total / 1e3 / reps, 3) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0}


def commit() -> str | None:
    """The commit the benchmark ran from: $LONGCTX_COMMIT if set (a machine that holds a copy of the
    tree without .git: dev/README.md), else git's HEAD, with "-dirty" when tracked files differ from it;
    None outside a git checkout."""
    if os.environ.get("LONGCTX_COMMIT"):
        return os.environ["LONGCTX_COMMIT"]

    def git(*args):
        try:
            r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    head = git("rev-parse", "--short=12", "HEAD")
    if not head:
        return None
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - absent or broken: recorded as such
        return None


def env_record(gpu: str | None = None) -> dict:
    """The head of every results JSON: the GPU (default: the current CUDA device's name), torch and
    triton versions, the command line, the date (UTC) and the commit."""
    if gpu is None:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "triton": _version("triton"),
            "command": " ".join(["python", *sys.argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit()}


def write_results(out_dir, name: str, res: dict) -> Path:
    """OUT_DIR/NAME (created if missing), the results indented, and a line saying where."""
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", path)
    return path
