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


# fp32 means fp32. longctx's own Triton kernels take the dots of fp32 inputs at full precision
# (input_precision "ieee"; Triton's default for fp32 is TF32, 10-bit mantissas), whatever torch's switches
# say: their fp32 runs are the exact references of the GPU tests. A library kernel with no fp32 mode says so
# (`warn_tf32`) unless the user has let fp32 matmuls take TF32 (`tf32_allowed`), the one switch longctx reads.


def tf32_allowed() -> bool:
    """Whether the user lets fp32 matrix products take TF32: torch.backends.cuda.matmul's switch (allow_tf32,
    or fp32_precision "tf32"), off by default."""
    import torch

    m = torch.backends.cuda.matmul
    try:
        return bool(m.allow_tf32)
    except RuntimeError:  # torch refuses the legacy read after a mix of its two APIs; the new one answers
        return m.fp32_precision == "tf32"


def warn_tf32(op: str, fix: str, *tensors) -> None:
    """`op` takes the products of fp32 inputs through TF32 (about 3e-4 relative error, against fp32's 1e-7)
    and has no fp32 mode: said once per message (RuntimeWarning, errors.warn_fallback) where one of `tensors`
    is fp32 and the user has not allowed TF32 (`tf32_allowed`). Never silent: the fp32 that was asked for
    is not what runs."""
    import torch

    from ..errors import warn_fallback

    if any(t.dtype == torch.float32 for t in tensors) and not tf32_allowed():
        warn_fallback(f"{op} takes fp32 inputs' products in TF32 (10-bit mantissas, about 3e-4 relative error "
                      f"where fp32 gives 1e-7): {fix}; or allow TF32 (torch.backends.cuda.matmul.allow_tf32 = True) "
                      "to accept it.")


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
