"""Measure what autograd keeps for backward, per layer, on any device (CPU included).

`saved_tensors_hooks` sees every tensor autograd saves. We attribute each one to the block that is
running (the model's blocks are wrapped while metering) and sum distinct storages, so a view saved
twice counts once. This is the CPU-runnable twin of a GPU memory snapshot: with full recompute a
block keeps only its input; without, it keeps every activation its backward needs.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

import torch


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
    (embedding, final norm, the LM head and loss)."""
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
