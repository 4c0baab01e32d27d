"""What is alive at the peak of a CUDA step, by the line of our code that allocated it.

Why: the estimate says what *should* be alive at the peak; when a measurement disagrees (the
offloaded 256k step peaked 14% over its estimate), the allocator's own event trace says what *was*.
`record()` turns on torch's allocation history for a step; `alive_at_peak(events, before)` replays
the alloc/free events, finds the moment of the highest total and groups the blocks alive then by the
innermost frame in longctx (or the innermost frame at all). The replay is plain Python over the
trace, so it is tested on the CPU with a made-up trace.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

ALLOC, FREES = "alloc", ("free_completed",)


def _where(frames: list[dict]) -> str:
    for f in frames or ():
        name = f.get("filename", "")
        if "/longctx/" in name and not name.endswith("memory/peak.py"):
            return f"{name.split('/longctx/', 1)[1]}:{f.get('line')} {f.get('name')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename')}:{f.get('line')} {f.get('name')}"
    return "(no stack)"


def alive_at_peak(events: list[dict], before: int = 0, top: int = 25) -> dict:
    """Replay `events` (torch.cuda.memory._snapshot()['device_traces'][device]); `before`: bytes
    allocated when recording started (parameters, optimizer state: not in the trace). Returns
    {'peak_bytes', 'at_event', 'by_site': [(site, bytes, blocks)] largest first, 'untracked_bytes'}."""
    def replay(stop: int):
        """Live blocks {addr: (size, event)} after event `stop`, the running total after each event."""
        live, total, totals = {}, before, []
        for i, e in enumerate(events[: stop + 1]):
            action = e.get("action")
            if action == ALLOC:
                live[e["addr"]] = (e["size"], i)
                total += e["size"]
            elif action in FREES:  # not in `live`: allocated before recording began, part of `before`
                total -= live.pop(e["addr"])[0] if e.get("addr") in live else e.get("size", 0)
            totals.append(total)
        return live, totals

    _, totals = replay(len(events) - 1)
    at = max(range(len(totals)), key=totals.__getitem__, default=-1)
    peak = max(before, totals[at]) if at >= 0 else before
    if peak == before:
        at = -1
    peak_live = {a: (size, _where(events[i].get("frames"))) for a, (size, i) in replay(at)[0].items()} if at >= 0 else {}
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, where in peak_live.values():
        sites[where][0] += size
        sites[where][1] += 1
    ranked = sorted(((w, b, n) for w, (b, n) in sites.items()), key=lambda r: -r[1])
    return {"peak_bytes": peak, "at_event": at, "untracked_bytes": before, "by_site": ranked[:top],
            "other_bytes": sum(b for _, b, _ in ranked[top:])}


def format_peak(r: dict) -> str:
    gib = 2**30
    lines = [f"peak {r['peak_bytes'] / gib:.2f} GiB (event {r['at_event']}); allocated before recording "
             f"(parameters, optimizer state, caches): {r['untracked_bytes'] / gib:.2f} GiB", "",
             f"{'GiB':>8} {'blocks':>7}  allocated at"]
    lines += [f"{b / gib:8.2f} {n:7d}  {w}" for w, b, n in r["by_site"]]
    if r["other_bytes"]:
        lines.append(f"{r['other_bytes'] / gib:8.2f} {'':7}  (other sites)")
    return "\n".join(lines)


@contextlib.contextmanager
def record(device=None, max_entries: int = 2_000_000):
    """CUDA only: record the allocator's events inside; yields a dict that holds, on exit,
    'events' and 'before' for alive_at_peak."""
    out = {"before": torch.cuda.memory_allocated(device)}
    try:  # clear_history: only this context's events (torch >= 2.6)
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python", clear_history=True)
    except TypeError:
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield out
    finally:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        idx = torch.device(device or "cuda").index or 0
        traces = snap.get("device_traces") or [[]]
        out["events"] = traces[idx] if idx < len(traces) else []
