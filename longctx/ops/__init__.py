"""Kernels and their plain-torch twins. Triton kernels run on CUDA tensors, and on CPU tensors under the
Triton interpreter (TRITON_INTERPRET=1, set before triton is imported), which the CPU tests use."""

import os


def triton_interpreting() -> bool:
    """Whether Triton kernels run under the interpreter (CPU tensors allowed)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# The elements an int32 offset reaches (0 .. 2^31 - 1): kernels that address a tensor that way read and
# write out of bounds past it (liger's mHC kernels do; bench/NOTES.md, calls 41-42).
INT32_ELEMENTS = 2**31


def int32_rows(row_elements: int) -> int:
    """The most rows of `row_elements` a tensor may have for int32 offsets to address it (at least 1)."""
    return max(1, INT32_ELEMENTS // row_elements)


FUSED_IMPLS = ("auto", "torch", "triton")  # the settings norm_impl and swiglu_impl


def fused_kernel_runs(setting: str, impl: str, module: str, *tensors) -> bool:
    """Whether a layer's fused Triton op (longctx.ops.<module>) runs for `impl`, the training setting
    `setting`: "torch" never; "triton" always (the op then checks its input and raises a ConfigError with
    what it takes and the fix); "auto" on CUDA tensors the module's `runs_here` accepts, else the torch
    form, said once per message where CUDA was there (errors.warn_fallback), never silently. The module
    is imported only for CUDA tensors: a CPU-only install may have no triton."""
    from ..errors import ConfigError, warn_fallback

    if impl == "torch":
        return False
    if impl not in FUSED_IMPLS:
        raise ConfigError(f"{setting} must be one of {', '.join(FUSED_IMPLS)} (got {impl!r}).")
    if impl == "triton":
        return True
    if not tensors[0].is_cuda:
        return False
    import importlib

    try:
        k = importlib.import_module(f"{__name__}.{module}")
    except ImportError as e:
        warn_fallback(f"{setting} auto runs the torch form on CUDA because the fused kernel does not import ({e}); "
                      f"install triton or set {setting} = 'torch' to accept it.")
        return False
    if not k.runs_here(*tensors):
        warn_fallback(f"{setting} auto runs the torch form on CUDA for inputs "
                      f"{', '.join(f'{tuple(t.shape)} {t.dtype}' for t in tensors)}, which the fused kernel does not "
                      f"take; set {setting} = 'torch' to accept it.")
        return False
    return True
