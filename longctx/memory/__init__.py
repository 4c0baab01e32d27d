"""Memory techniques applied around the single-device model, each a named switch of the memory plan.

    plan.py             MemoryPlan (the switches, validated) and apply_plan (sets them on a model)
    planner.py          the automatic plan: the cheapest of recompute / offload / sequence chunks that fits
    model_bytes.py      the byte model the planner asks: what each tensor of a step costs, per phase
    recompute.py        per-block activation recompute (and the offload of what it keeps)
    offload.py          saved block inputs to host memory, prefetched back during backward
    sequence_chunks.py  the sequence-chunked step: exact backprop through S tokens with O(chunk) activations
    host_buffers.py     page-locked host buffers of exactly the size asked for
    allocator.py        the CUDA caching allocator's settings
"""
