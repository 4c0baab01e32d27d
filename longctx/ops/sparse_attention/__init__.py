"""DSA sparse attention: the plain-torch twin (`naive.py`) and, on CUDA, our Triton kernel."""

from .naive import dense_masked_attention, kept_sparse_attention_torch, sparse_attention_bwd_torch, sparse_attention_torch

try:  # triton is optional on the CPU; the DSA layer reports which implementation ran
    from .triton import kept_sparse_attention_triton, sparse_attention_fwd, sparse_attention_triton
except ImportError:  # pragma: no cover - exercised only without triton installed
    sparse_attention_triton = sparse_attention_fwd = kept_sparse_attention_triton = None

__all__ = ["sparse_attention_torch", "dense_masked_attention", "sparse_attention_triton", "sparse_attention_fwd",
           "sparse_attention_bwd_torch", "kept_sparse_attention_torch", "kept_sparse_attention_triton"]
