"""CPU offload of saved layer inputs: pinned host buffers, async copies on a side stream,
prefetch of the previous layer during backward, one step's pinned buffers reused by the next.

Used as the `saved_tensors_hooks` around a recomputed block, so what it moves is exactly what full
recompute keeps: the block's input (the 4-stream mHC residual) and, with selection reuse, the
indexer's int32 selection. Each block packs into its own *group*. Backward visits blocks in
reverse; when a tensor of block i is unpacked we start copying every tensor of the block packed
before it back on the side stream, so those copies overlap block i's recompute.

The hooks must be active where autograd *packs* a custom Function's saved tensors, which is after
`Function.forward` returns (not at `save_for_backward`): the caller wraps `Function.apply`, and
`paused()` lets whatever a block saves inside its own forward (the indexer's KL graph) through.

Pinned buffers: by default the offloader keeps one step's buffers and the next step takes the same
ones again: host memory is flat (the same buffers every step; those a step did not take go back) and
nothing is page-locked twice; `close()` returns them. With `keep_pinned` off (the 1M-token GLM-5.3-Flash
training report's remedy for growing host memory) every step's pinned blocks go back to the OS at its
end, so host memory cannot grow either, but each step page-locks its buffers afresh (page-locking GiBs
takes seconds, on the thread that launches the forward): ~33 s a step for the 42 GiB of a 256k step on
the H200 (`bench/memory.py --parts offload --offload-modes pinned,pinned_kept`). Each buffer is
page-locked at its exact size (`host_buffers.py`; torch's pinned allocator rounds to powers of two: 72
GiB of host memory for 54 GiB of tensors at 256k).

On a CPU-only machine there is nothing to offload to; the hooks then keep tensors as they are
(the logic is still exercised by tests through `force=True` with plain host buffers).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .host_buffers import as_view, host_buffer, release


class _Handle:
    __slots__ = ("d2h_done", "device", "gpu", "group", "h2d_done", "host", "index", "nbytes")

    def __init__(self, host, device, d2h_done, index, group, nbytes):
        self.host, self.device, self.d2h_done, self.index, self.group = host, device, d2h_done, index, group
        self.gpu, self.h2d_done, self.nbytes = None, None, nbytes


class Offloader:
    def __init__(self, pin_memory: bool = True, min_bytes: int = 1 << 20, force: bool = False,
                 keep_pinned: bool = True):
        self.pin_memory = pin_memory
        self.keep_pinned = keep_pinned
        self._pool: dict[int, list[torch.Tensor]] = {}  # nbytes -> free kept buffers (keep_pinned)
        self._taken: list[torch.Tensor] = []  # this step's kept buffers, back to the pool at end_step
        self.kept_bytes = 0
        self.min_bytes = min_bytes
        self.force = force  # offload even CPU tensors (tests)
        self.handles: list[_Handle | None] = []  # this step's, in packing order; None once unpacked
        self.groups: dict = {}  # group -> its handles
        self.group_order: list = []  # groups in packing order
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.bytes_offloaded = 0
        self.peak_host_bytes = 0
        self._live_host = 0
        self._group = None
        self._paused = False

    # ------------------------------------------------------------------ hooks
    def pack(self, t: torch.Tensor):
        nbytes = t.numel() * t.element_size()
        if self._paused or nbytes < self.min_bytes or not (t.is_cuda or self.force):
            return t
        index = len(self.handles)
        if not t.is_cuda:  # force (tests): the same buffers and bookkeeping, a plain copy
            h = _Handle(self._host_buffer(t, nbytes).copy_(t.detach()), t.device, None, index, self._group, nbytes)
        else:
            host = self._host_buffer(t, nbytes)
            cur = torch.cuda.current_stream(t.device)
            self.stream.wait_stream(cur)
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=self.pin_memory)
                done = torch.cuda.Event()
                done.record(self.stream)
            t.record_stream(self.stream)  # keep t's memory until the copy has read it
            h = _Handle(host, t.device, done, index, self._group, nbytes)
        self.handles.append(h)
        if self._group not in self.groups:
            self.groups[self._group] = []
            self.group_order.append(self._group)
        self.groups[self._group].append(h)
        self.bytes_offloaded += nbytes
        self._live_host += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self._live_host)
        return h

    def unpack(self, h):
        if not isinstance(h, _Handle):
            return h
        if self.handles[h.index] is not h:
            raise RuntimeError(
                "an offloaded block input was unpacked twice (a second backward through the same graph, "
                "e.g. retain_graph=True); offload frees each host copy when backward uses it, so run one "
                "backward per forward or set memory.offload=off.")
        if h.gpu is None:
            self._fetch(h)
        pos = self.group_order.index(h.group)
        if pos > 0:  # prefetch the previous block's tensors while this one recomputes
            for prev in self.groups[self.group_order[pos - 1]]:
                if self.handles[prev.index] is prev and prev.gpu is None:
                    self._fetch(prev)
        if h.h2d_done is not None:
            torch.cuda.current_stream(h.device).wait_event(h.h2d_done)
        out = h.gpu
        self._live_host -= h.nbytes
        self.handles[h.index] = None
        h.host = h.gpu = None
        return out

    def _host_buffer(self, t: torch.Tensor, nbytes: int) -> torch.Tensor:
        pin = self.pin_memory and t.is_cuda  # pinning serves GPU copies only (CPU tensors: tests)
        free = self._pool.get(nbytes) if self.keep_pinned else None
        if free:
            raw = free.pop()
        else:
            raw = host_buffer(nbytes, pin)  # page-locked at its exact size (host_buffers.py)
            self.kept_bytes += nbytes
        self._taken.append(raw)
        return as_view(raw, t.shape, t.dtype)

    def _fetch(self, h: _Handle):
        if h.device.type != "cuda":
            h.gpu = h.host
            return
        with torch.cuda.stream(self.stream):
            if h.d2h_done is not None:
                self.stream.wait_event(h.d2h_done)
            h.gpu = h.host.to(h.device, non_blocking=self.pin_memory)
            h.h2d_done = torch.cuda.Event()
            h.h2d_done.record(self.stream)
        # the consumer runs on the current stream; tell the allocator it uses this memory there
        h.gpu.record_stream(torch.cuda.current_stream(h.device))

    @contextmanager
    def hooks(self, group=None):
        """Offload what autograd saves in this context, as part of `group` (one block)."""
        prev, self._group = self._group, group
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._group = prev

    @contextmanager
    def paused(self):
        """Inside `hooks`: keep what is saved here on its device."""
        prev, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = prev

    def live_handles(self) -> int:
        return sum(h is not None for h in self.handles)

    def end_step(self):
        """Forget this step's handles; then either put this step's buffers back in the offloader's own
        pool for the next (`keep_pinned`), or hand cached pinned blocks back to the OS (PyTorch's host
        allocator otherwise keeps every freed pinned block)."""
        self.handles.clear()
        self.groups.clear()
        self.group_order.clear()
        self._live_host = 0
        if self.stream is not None and torch.cuda.is_available():
            self.stream.synchronize()  # no copy still reads or writes a buffer given back below
        # buffers this step did not take go back: the pool is never more than one step's
        gone = [raw for free in self._pool.values() for raw in free] + ([] if self.keep_pinned else self._taken)
        self._pool.clear()
        if self.keep_pinned:
            for raw in self._taken:
                self._pool.setdefault(raw.numel(), []).append(raw)
        self._taken = []
        for raw in gone:
            release(raw)
        self.kept_bytes -= sum(raw.numel() for raw in gone)
        if gone:
            self._empty_host_cache()  # what came from torch's pinned allocator (host_buffers' fallback)

    def close(self):
        """Give every kept buffer back (the policy is being replaced)."""
        self.end_step()
        for raw in (r for free in self._pool.values() for r in free):
            release(raw)
        self._pool.clear()
        self.kept_bytes = 0
        self._empty_host_cache()

    @staticmethod
    def _empty_host_cache():
        if torch.cuda.is_available():
            empty = getattr(torch._C, "_host_emptyCache", None)
            if empty is not None:
                empty()
