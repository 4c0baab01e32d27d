"""Kernels and their plain-torch twins. Triton kernels run on CUDA tensors, and on CPU tensors under the
Triton interpreter (TRITON_INTERPRET=1, set before triton is imported), which the CPU tests use."""

import os


def triton_interpreting() -> bool:
    """Whether Triton kernels run under the interpreter (CPU tensors allowed)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
