"""DSA sparse attention: the plain-torch twin (`naive.py`) and, on CUDA, the Triton kernel."""

from .naive import dense_masked_attention, sparse_attention_torch

__all__ = ["sparse_attention_torch", "dense_masked_attention"]
