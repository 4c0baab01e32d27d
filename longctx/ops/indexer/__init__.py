"""K-pool indexer selection: the plain-torch twin (`naive.py`) and, on CUDA, our Triton paths: the
two-phase one (`two_phase.py`: a score-to-buffer kernel, each row's k-th score, an emit kernel; the
layers' default, `KPoolIndexer.kernel`) and the fused one-kernel radix select (`triton_kernel.py`).

`select_pools` is the integration point for `KPoolIndexer`: it replaces the score + mask + topk of
one block of queries and returns pool ids; token expansion and the tail stay in the layer.

Wired into `KPoolIndexer` (longctx/layers/kpool_indexer.py) behind its `backend` switch
(auto | torch | triton; auto = the Triton path on CUDA): `KPoolIndexer._kernel_pools` computes the
unscaled q and the scaled head weights w once for all T queries, then calls `kpool_topk_two_phase`
(kernel two_phase / two_phase_radix) or `select_pools(..., backend="triton")` (kernel fused), and
`_select_block` expands the pools (`pools >= 0`) into tokens + tail.

Ties: `select_pools` gives them to the lower pool id; `torch.topk` (and so transformers' indexer)
may not, so the transformers-equivalence tests run the torch path (the CPU default), and
references compared against the kernel sort by (-score, pool).
"""

from __future__ import annotations

import torch

from .. import triton_interpreting
from .naive import kpool_scores_torch, kpool_topk_torch, select_from_scores

try:  # triton is optional on the CPU
    from .fused import kpool_topk_triton
    from .triton import kpool_scores_triton, kpool_topk_two_phase
except ImportError:  # pragma: no cover - exercised only without triton installed
    kpool_topk_triton = kpool_scores_triton = kpool_topk_two_phase = None

BACKENDS = ("torch", "triton")


def select_pools(q: torch.Tensor, w: torch.Tensor, pk: torch.Tensor, pool: int, k_pools: int,
                 backend: str = "torch", chunk: int | None = 256, q_offset: int = 0) -> torch.Tensor:
    """int32 [B, S, k_pools]: each query's k_pools best selectable pools, ascending, -1 padded.

    score(t, p) = sum_h w[t,h] relu(q[t,h] . pk[p]) with q pre-scaled; pool p is selectable by the
    query at absolute position q_offset + t iff (p+1)*pool - 1 <= q_offset + t; ties go to the
    lower pool id. backend "torch" scores `chunk` queries at a time; "triton" is the fused kernel
    (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1) and ignores `chunk`.
    """
    if backend == "torch":
        return kpool_topk_torch(q, w, pk, pool, k_pools, chunk=chunk, q_offset=q_offset)
    if backend == "triton":
        if kpool_topk_triton is None:
            raise ValueError("select_pools: backend='triton' needs the triton package; install it or use backend='torch'")
        if q.device.type != "cuda" and not triton_interpreting():
            raise ValueError(
                f"select_pools: backend='triton' needs CUDA tensors (got {q.device}); use backend='torch' "
                f"or set TRITON_INTERPRET=1 before importing triton"
            )
        return kpool_topk_triton(q, w, pk, pool, k_pools, q_offset=q_offset)
    raise ValueError(f"select_pools: backend={backend!r} unknown; use one of {BACKENDS}")


__all__ = ["BACKENDS", "kpool_scores_torch", "kpool_scores_triton", "kpool_topk_torch", "kpool_topk_triton",
           "kpool_topk_two_phase", "select_from_scores", "select_pools"]
