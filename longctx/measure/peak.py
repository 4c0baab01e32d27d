"""Where in a step the memory peak happens, and what is alive then.

Why: the estimate says what *should* be alive at the peak; when a measurement disagrees (the
offloaded 256k step peaked 14% over its estimate), the step itself has to say where its peak was.
Two tools:

- `timeline(model)`: hooks on every block and its parts mark each module's forward, recomputed
  forward and backward (start and end) with the allocated bytes and the running maximum;
  `locate_peak(marks)` names the two marks between which the maximum was reached and what was
  allocated there. It needs nothing from the allocator but two counters, so it cannot break the step
  (the allocator trace below failed inside the recompute backward on the H200).
- `record()` turns on torch's allocation history for a step; `alive_at_peak(events, before)` replays
  the alloc/free events, finds the moment of the highest total and groups the blocks alive then by
  the innermost frame in longctx (or the innermost frame at all).

Both are plain Python over what they collect, so they are tested on the CPU (a fake counter, a made-up
trace).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

ALLOC, FREES = "alloc", ("free_completed",)


def _where(frames: list[dict]) -> str:
    for f in frames or ():
        name = f.get("filename", "")
        if "/longctx/" in name and not name.endswith("measure/peak.py"):
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


def _phase() -> str:
    """fwd (graph or not), recompute (a forward inside backward) or bwd."""
    in_backward = torch._C._current_graph_task_id() != -1
    if not in_backward:
        return "fwd"
    return "recompute" if torch.is_grad_enabled() else "bwd"


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


class Marks(list):
    """The marks of one step: (label, allocated bytes, running max, max since the previous mark).
    `mark(label)` adds one; with a `reset` (CUDA: the allocator's peak counter) each mark's own max
    covers only the interval since the one before, so every phase of the step gets its own peak
    (`phase_peaks`). Without one the fourth field repeats the running max."""

    def __init__(self, read, reset=None):
        super().__init__()
        self._read, self._reset = read, reset

    def mark(self, label: str) -> None:
        a, m = self._read()
        self.append((label, a, max(self[-1][2] if self else 0, m), m))
        if self._reset is not None:
            self._reset()


@contextlib.contextmanager
def timeline(model, read=None, depth: int = 2, reset=None):
    """Marks of one step: yields a `Marks` list that fills with (label, allocated bytes, running max
    bytes, max bytes since the previous mark). Hooks on `model.layers.N` (depth 1) and their children
    (depth 2): forward start and end (phase fwd, or recompute when a block's forward runs again inside
    backward) and, for outputs that take a gradient, bwd start (the output's gradient arrived) and, for
    inputs, bwd end (the input's gradient is computed). `read()` -> (allocated, max allocated) and
    `reset()` (start a new interval); default torch.cuda's counters and reset_peak_memory_stats, so
    the caller's own max_memory_allocated then covers only the last interval: the step's peak is the
    last mark's running max (bench/memory.py adds a final mark)."""
    if read is None:
        read = lambda: (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated())  # noqa: E731
        reset = torch.cuda.reset_peak_memory_stats
    marks = Marks(read, reset)
    mark = marks.mark

    def mark_grad_of_first(tensors, label):
        """Mark `label` when the gradient of the first of `tensors` that takes one is computed."""
        if torch.is_grad_enabled():
            t = next((t for t in _tensors(tensors) if t.requires_grad), None)
            if t is not None:
                t.register_hook(lambda g: mark(label))

    def pre(name):
        def hook(mod, args, kwargs):
            mark(f"{_phase()} start {name}")
            mark_grad_of_first((args, kwargs), f"bwd end {name}")
        return hook

    def post(name):
        def hook(mod, args, kwargs, out):
            mark(f"{_phase()} end {name}")
            mark_grad_of_first(out, f"bwd start {name}")
        return hook

    handles = []
    for name, mod in model.named_modules():
        parts = name.split(".")
        if parts[0] != "layers" or not 2 <= len(parts) <= depth + 1:
            continue
        handles.append(mod.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(mod.register_forward_hook(post(name), with_kwargs=True))
    try:
        yield marks
    finally:
        for h in handles:
            h.remove()


CHUNK_MARKS = ("forward sweep: chunk", "backward sweep: chunk")  # memory/sequence_chunks.py's progress lines


def phase_peaks(marks, kinds: list[str] | None = None) -> dict:
    """{phase: peak bytes} from per-interval marks (`Marks` with a reset): the forward and the loss,
    then the backward of each block (from its recompute, or its output's gradient, to the next
    block's), named like the estimate's phases ("the backward of layer 11 (D)" with `kinds`). In a
    sequence-chunked step (marks named by CHUNK_MARKS) the forward sweep is one phase and each chunk
    of the backward sweep is a prefix ("chunk 7/8: ..."). The interval that ends at a mark belongs
    to the phase current at the mark before it, in the chunk whose line closes it."""
    chunk_of, cur = [None] * len(marks), None
    for k in reversed(range(len(marks))):
        label = marks[k][0]
        if label.startswith(CHUNK_MARKS[0]):
            cur = "the forward sweep"
        elif label.startswith(CHUNK_MARKS[1]):
            cur = "chunk " + label.split("chunk ", 1)[1].split()[0]
        chunk_of[k] = cur
    out: dict = {}
    phase = "the forward and the loss"
    for k, mk in enumerate(marks):
        # a chunk's marks end with its own line, so the interval up to one is in that chunk; past the
        # last line (the optimizer step) the last chunk's
        here = chunk_of[k] if chunk_of[k] is not None or not k else chunk_of[k - 1]
        name = here if here == "the forward sweep" else f"{here}: {phase}" if here else phase
        interval = mk[3] if len(mk) > 3 else mk[2]
        out[name] = max(out.get(name, 0), interval)
        label = mk[0]
        if label.startswith(CHUNK_MARKS[1]):
            phase = "the forward and the loss"  # the next chunk of the backward sweep starts
        else:
            what, _, mod = label.partition(" start ")
            parts = mod.split(".")
            if what in ("recompute", "bwd") and len(parts) == 2 and parts[0] == "layers":
                i = int(parts[1])
                kind = f" ({kinds[i]})" if kinds else ""
                phase = f"the backward of layer {i}{kind}"
    return out


def locate_peak(marks: list[tuple[str, int, int]]) -> dict:
    """The first mark whose running maximum is the final one: the peak happened after the mark
    before it and by this one. Returns {'peak_bytes', 'index', 'after', 'by', 'allocated_after',
    'allocated_by'} (after/by: labels; None before the first mark)."""
    if not marks:
        return {"peak_bytes": 0, "index": None, "after": None, "by": None, "allocated_after": None, "allocated_by": None}
    top = marks[-1][2]
    i = next(k for k, mk in enumerate(marks) if mk[2] >= top)
    prev = marks[i - 1] if i else None
    return {"peak_bytes": top, "index": i, "after": prev[0] if prev else None, "by": marks[i][0],
            "allocated_after": prev[1] if prev else None, "allocated_by": marks[i][1]}


def format_timeline(marks: list[tuple[str, int, int]], around: int = 12) -> str:
    """The peak's place, then the marks around it (GiB allocated, GiB running max)."""
    gib = 2**30
    r = locate_peak(marks)
    if r["index"] is None:
        return "no marks"
    lines = [f"peak {r['peak_bytes'] / gib:.2f} GiB reached after '{r['after']}' and by '{r['by']}' "
             f"(allocated {0 if r['allocated_after'] is None else r['allocated_after'] / gib:.2f} -> "
             f"{r['allocated_by'] / gib:.2f} GiB)", "", f"{'alloc GiB':>9} {'max GiB':>8}  mark"]
    lo, hi = max(0, r["index"] - around), min(len(marks), r["index"] + around + 1)
    for k in range(lo, hi):
        label, a, m = marks[k][:3]
        lines.append(f"{a / gib:9.2f} {m / gib:8.2f}  {label}{'   <- peak by here' if k == r['index'] else ''}")
    return "\n".join(lines)
