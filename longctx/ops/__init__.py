"""Kernels and their plain-torch twins, one package per op: `ops/<op>/{__init__.py, naive.py, <backend>.py}`.

Each op's `__init__.py` defines its settings once, `IMPLS` = ("auto", "torch", <its fast backend>, [a
second one]), and `unavailable(device, cfg)`: why the fast backend cannot run there (None where it can).
`pick` below is the one rule by which every layer chooses at run time, and `longctx.kernels.planned` says
ahead of a run:

  "torch"    the plain-torch twin (`naive.py`), always;
  <backend>  that fast path ("triton", "fla", "liger", "flashmla"); where it cannot run, a ConfigError
             naming kernels.<op> and the fix, never a quiet substitute;
  "auto"     the first fast path on CUDA where it imports and takes the inputs, else the torch twin: without
             a word on the CPU (nothing was asked of a GPU), with a warning on CUDA. An op with a second
             backend (sparse_attention's FlashMLA) says where auto takes that one instead (`auto_backend`).

Triton kernels run on CUDA tensors, and on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1,
set before triton is imported), which the CPU tests use: there an explicit "triton" runs on the CPU.
This module and every `ops/<op>/__init__.py` import without torch, triton, fla or liger: the twins and
wrappers they name load on first use (`lazy_attr`)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable


def triton_interpreting() -> bool:
    """Whether Triton kernels run under the interpreter (CPU tensors allowed)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pick(op: str, impl: str, impls: tuple[str, ...], cuda: bool, why_not: Callable[[], str | None],
         plain: bool = False, warn: bool = True) -> str:
    """What runs for the setting kernels.<op> = `impl`: "torch", `impls[2]` (the op's fast backend) for "auto",
    or the backend `impl` names.

    cuda: the inputs are (or will be) on a CUDA device. why_not(): why that backend cannot run them,
    None where it can; asked only where the answer matters, so a CPU run never imports a kernel library.
    plain: the memory plan's baseline switch for this op is off (`memory.loss_chunk` 0, `chunked_indexer`
    or `mhc_cast_recompute` false); auto then takes the twin, which is what the baseline measures.
    warn: False when planning (`kernels.planned`) rather than running."""
    from ..errors import ConfigError, warn_fallback

    if impl not in impls:
        raise ConfigError(f"kernels.{op} must be one of {', '.join(impls)} (got {impl!r}).")
    if impl == "torch" or (impl == "auto" and (not cuda or plain)):
        return "torch"
    why = why_not()
    if why is None:
        return impls[2] if impl == "auto" else impl
    if impl != "auto":
        raise ConfigError(f"kernels.{op} = {impl!r} cannot run here ({why}); set kernels.{op} to 'auto' or 'torch'.")
    if warn:
        warn_fallback(f"kernels.{op} auto runs the plain-torch twin on CUDA ({why}); set kernels.{op} = 'torch' to "
                      "accept it.")
    return "torch"


def fast_path_problem(device, import_error: Callable[[], str | None], library: str,
                      interpreter: bool = False) -> str | None:
    """Why a fast backend cannot run on `device` (a torch.device or its name), or None.

    import_error(): why its library does not import (None where it does). interpreter: a Triton kernel,
    which also runs CPU tensors under TRITON_INTERPRET=1. A CUDA device this process does not see (an
    estimate for another machine) is taken to have what `pip install -e .[gpu]` installs."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda" and not (interpreter and triton_interpreting()):
        return (f"it runs on CUDA tensors{' (or under TRITON_INTERPRET=1)' if interpreter else ''}, "
                f"and these are on {dev.type}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        return None
    err = import_error()
    return None if err is None else f"{library} does not import: {err}; `pip install -e .[gpu]` installs it"


def lazy_attr(package: str, table: dict[str, str], name: str):
    """`package`'s attribute `name` from the submodule `table` names for it, imported on first use: an op
    package's twins and wrappers need torch, and its __init__ imports without it (longctx.config reads
    each op's IMPLS and stays torch-free). For a module-level `__getattr__`."""
    if name not in table:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{package}.{table[name]}"), name)


@functools.lru_cache(maxsize=None)
def module_import_error(name: str) -> str | None:
    """Why the module `name` (one of our Triton backends, e.g. "longctx.ops.rms_norm.triton") does not
    import, or None."""
    import importlib

    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - ImportError, or a triton/torch mismatch raised while importing
        return f"{type(e).__name__}: {e}"
    return None


# The elements an int32 offset reaches (0 .. 2^31 - 1): kernels that address a tensor that way read and
# write out of bounds past it (liger's mHC kernels do).
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
