"""Measure what autograd keeps for backward, per layer, on any device (CPU included).

`saved_tensors_hooks` sees every tensor autograd saves. We attribute each one to the block that is
running (the model's blocks are wrapped while metering) and sum distinct storages, so a view saved
twice counts once. This is the CPU-runnable twin of a GPU memory snapshot: with full recompute a
block keeps only its input; without, it keeps every activation its backward needs.

`LiveBytes` is the other half: the peak of live tensors while a piece of code runs (a transient
workspace such as the indexer's scores, or a whole training step in bench/memory.py --cpu-smoke).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class SavedTensorMeter:
    def __init__(self):
        self.bytes = defaultdict(int)  # label -> bytes
        self.by_dtype = defaultdict(lambda: defaultdict(int))  # label -> dtype -> bytes
        self.shapes = defaultdict(list)
        self._seen: set = set()
        self.label = "outside"

    def _pack(self, t: torch.Tensor):
        try:
            key = (t.untyped_storage().data_ptr(), t.device)
            nbytes = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            key, nbytes = (id(t), t.device), t.numel() * t.element_size()
        if key not in self._seen and nbytes > 0:
            self._seen.add(key)
            self.bytes[self.label] += nbytes
            self.by_dtype[self.label][str(t.dtype).replace("torch.", "")] += nbytes
            self.shapes[self.label].append((tuple(t.shape), str(t.dtype).replace("torch.", "")))
        return t

    @contextmanager
    def measure(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self

    @contextmanager
    def labelled(self, label: str):
        prev, self.label = self.label, label
        try:
            yield
        finally:
            self.label = prev

    def total(self) -> int:
        return sum(self.bytes.values())


def meter_model_step(model, input_ids, labels) -> SavedTensorMeter:
    """Run one forward with every block labelled; return the meter (the graph is released).
    Labels: "layer<i>" for what block i (and its recompute wrapper) saves, "outside" for the rest
    (embedding, final norm, the LM head and loss). Tensors an offloader packs are not seen (its
    hooks are the innermost): the meter reports what stays on the device."""
    meter = SavedTensorMeter()
    inner = model.block_fn

    def labelled_block(block, state, selection, cu_seqlens):
        with meter.labelled(f"layer{block.idx}"):
            if inner is not None:
                return inner(block, state, selection, cu_seqlens)
            return block(state, selection, cu_seqlens=cu_seqlens)

    model.block_fn = labelled_block
    try:
        with meter.measure():
            out = model(input_ids, labels=labels, return_logits=False)
        del out
    finally:
        model.block_fn = inner
    model.clear_aux()
    return meter


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors created inside this context and still alive, on any device.

    A CPU twin of `torch.cuda.max_memory_allocated` for what runs inside: every op's outputs are
    counted once per storage (views add nothing) and dropped when the storage is freed (a
    finalizer on the storage object, which PyTorch keeps while the storage lives), so `peak` is the
    live set at the worst op boundary (an op's internal scratch is not seen). Tensors that existed
    before entering (parameters, inputs) are not counted. `limit`: raise torch.OutOfMemoryError
    when the live bytes exceed it (exercises OOM paths on the CPU)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Never compiled: without this, torch wraps every call in a dynamo-disable shim (~3x the
        # per-op cost, and it imports dynamo)
        return False

    def __init__(self, limit: int | None = None):
        super().__init__()
        self.live: dict = {}  # storage key -> (token, bytes)
        self.current = 0
        self.peak = 0
        self.limit = limit

    def _free(self, key, token):
        entry = self.live.get(key)
        if entry is not None and entry[0] is token:
            del self.live[key]
            self.current -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key = (st.data_ptr(), str(t.device))
            if st.nbytes() == 0 or key in self.live:
                continue
            token = object()
            self.live[key] = (token, st.nbytes())
            self.current += st.nbytes()
            weakref.finalize(st, self._free, key, token)
        self.peak = max(self.peak, self.current)
        if self.limit is not None and self.current > self.limit:
            raise torch.OutOfMemoryError(
                f"LiveBytes: {self.current / 2**20:.1f} MiB live exceeds the limit of {self.limit / 2**20:.1f} MiB")
        return out


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []
