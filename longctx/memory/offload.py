"""CPU offload of saved layer inputs: pinned host buffers, async copies on a side stream,
prefetch of the previous layer during backward, pinned blocks released after every step.

Used as the `saved_tensors_hooks` around a recomputed block, so what it moves is exactly what full
recompute keeps: the block's input (the 4-stream mHC residual) and, with selection reuse, the
indexer's int32 selection. Backward visits blocks in reverse; when block i's input is unpacked we
start copying block i-1's back on the side stream, so the copy overlaps block i's recompute.

On a CPU-only machine there is nothing to offload to; the hooks then keep tensors as they are
(the logic is still exercised by tests through `force=True` with plain host buffers).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class _Handle:
    __slots__ = ("host", "device", "d2h_done", "gpu", "h2d_done", "index")

    def __init__(self, host, device, d2h_done, index):
        self.host, self.device, self.d2h_done, self.index = host, device, d2h_done, index
        self.gpu, self.h2d_done = None, None


class Offloader:
    def __init__(self, pin_memory: bool = True, min_bytes: int = 1 << 20, force: bool = False):
        self.pin_memory = pin_memory
        self.min_bytes = min_bytes
        self.force = force  # offload even CPU tensors (tests)
        self.handles: list[_Handle] = []
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.bytes_offloaded = 0
        self.peak_host_bytes = 0
        self._live_host = 0

    # ------------------------------------------------------------------ hooks
    def pack(self, t: torch.Tensor):
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or not (t.is_cuda or self.force):
            return t
        if not t.is_cuda:
            h = _Handle(t.clone(), t.device, None, len(self.handles))
        else:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin_memory)
            cur = torch.cuda.current_stream(t.device)
            self.stream.wait_stream(cur)
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=self.pin_memory)
                done = torch.cuda.Event()
                done.record(self.stream)
            t.record_stream(self.stream)  # keep t's memory until the copy has read it
            h = _Handle(host, t.device, done, len(self.handles))
        self.handles.append(h)
        self.bytes_offloaded += nbytes
        self._live_host += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self._live_host)
        return h

    def unpack(self, h):
        if not isinstance(h, _Handle):
            return h
        if h.gpu is None:
            self._fetch(h)
        if h.index > 0:  # prefetch the previous block's input while this one recomputes
            prev = self.handles[h.index - 1]
            if prev is not None and prev.gpu is None:
                self._fetch(prev)
        if h.h2d_done is not None:
            torch.cuda.current_stream(h.device).wait_event(h.h2d_done)
        out = h.gpu
        self._live_host -= out.numel() * out.element_size()
        self.handles[h.index] = None
        h.host = h.gpu = None
        return out

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
    def hooks(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    def end_step(self):
        """Forget this step's handles and hand cached pinned blocks back to the OS (seed 000:
        PyTorch's host allocator otherwise keeps every freed pinned block)."""
        self.handles.clear()
        self._live_host = 0
        if torch.cuda.is_available():
            if self.stream is not None:
                self.stream.synchronize()
            empty = getattr(torch._C, "_host_emptyCache", None)
            if empty is not None:
                empty()
