"""Page-locked host buffers of exactly the size asked for.

torch's pinned memory (`pin_memory=True`, its caching host allocator) rounds every block up to a power
of two: a 3 GiB block input takes 4 GiB of page-locked host memory, a 2.004 GiB selection 4, a 1.002 GiB
one 2 (`python bench/host_buffers.py`, bench/results/host_buffers.json). With all 12 blocks of h200-ref
offloaded at 256k that is 72 GiB of host memory for 54 GiB of saved tensors on the H200 (an RSS of 74.1
GiB against 2.0 without offload), and the 1M chunked step's 24 GiB of selections would take 48
(counted). Here a buffer is an ordinary (pageable) CPU tensor that CUDA then page-locks in place
(cudaHostRegister), so it costs what it holds; copies from and to it are as asynchronous as from pinned
memory. `release` unregisters it (also done when the buffer is garbage collected).

If CUDA refuses to register memory the buffer comes from torch's pinned allocator instead, and the user
is told once (a warning naming the power-of-two cost), never silently.
"""

from __future__ import annotations

import warnings
import weakref

import numpy as np
import torch

_warned = False
PAGE = 4096  # the host page size CUDA locks in (x86-64 Linux)


def _register(ptr: int, nbytes: int) -> int:
    # flags 0 = cudaHostRegisterDefault: page-locked and mapped for the current context's copies
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def page_locked_empty(nbytes: int) -> torch.Tensor:
    """A uint8 host tensor of `nbytes` bytes, page-locked at exactly that size (see the module docstring).
    Falls back, with a warning, to torch's pinned allocator if CUDA will not register the memory."""
    global _warned
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    # whole pages of our own: CUDA locks pages, and a page shared with another registered buffer (small
    # allocations share heap pages) would refuse the second registration
    pages = -(-nbytes // PAGE)
    base = np.empty((pages + 1) * PAGE, dtype=np.uint8)
    start = -base.ctypes.data % PAGE
    # a tensor whose *storage* starts at the aligned page: torch's is_pinned (which the copies and the
    # offloader consult) asks CUDA about the storage's first byte, and a slice of a larger tensor would
    # keep the unregistered start of `base` as its storage pointer
    raw = torch.from_numpy(base[start:start + nbytes])
    ptr = raw.data_ptr()
    err = _register(ptr, pages * PAGE)
    if err == 0:
        # unregister before the memory goes back to the C allocator, whoever drops the last reference
        fin = raw._page_locked = weakref.finalize(raw, _unregister, ptr)
        fin.atexit = False  # at exit the process's memory goes anyway; no CUDA calls during shutdown
        return raw
    if not _warned:
        _warned = True
        warnings.warn(f"cudaHostRegister failed (CUDA error {err}) for a {nbytes / 2**30:.2f} GiB host buffer; "
                      "offload and selection buffers now come from torch's pinned allocator, which rounds each up "
                      "to a power of two of host memory (memory.pin_memory=false uses pageable buffers instead).",
                      stacklevel=2)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """An uninitialised uint8 host tensor of `nbytes`: page-locked at its exact size when `pinned` (and CUDA
    is available), pageable otherwise. The caller keeps this tensor for as long as the memory is in use
    (views of it are fine) and may `release` it early."""
    if pinned and torch.cuda.is_available():
        return page_locked_empty(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8)


def as_view(raw: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    """`raw`'s bytes as a tensor of `shape` and `dtype` (no copy)."""
    return raw.view(dtype).view(shape)


def host_rss_bytes() -> int:
    """This process's resident host memory now (VmRSS; page-locked buffers count in it), or where there is
    no /proc, its peak (ru_maxrss)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release(buf: torch.Tensor) -> None:
    """Unregister a buffer from `page_locked_empty` now (its memory is freed when the last reference goes).
    A buffer from the fallback or a pageable one: nothing to do."""
    fin = getattr(buf, "_page_locked", None)
    if fin is not None:
        fin()
