"""Clamped SwiGLU (`kernels.swiglu`): the torch twin (`naive.py`) and fused Triton kernels (`triton.py`,
one pass forward and backward with the same saved tensors), for the dense MLPs and the experts."""

from __future__ import annotations

from .. import fast_path_problem, lazy_attr, module_import_error
from .. import pick as _pick

IMPLS = ("auto", "torch", "triton")

_TWINS = {"ClampedSwiGLU": "naive", "ClampedSwiGLUPacked": "naive", "clamped_swiglu_plain": "naive"}
__all__ = ["IMPLS", "clamped_swiglu", "clamped_swiglu_packed", "pick", "unavailable", *_TWINS]


def __getattr__(name: str):
    return lazy_attr(__name__, _TWINS, name)


def unavailable(device, cfg=None) -> str | None:
    """Why the Triton kernels cannot run on `device`, or None."""
    return fast_path_problem(device, lambda: module_import_error(f"{__name__}.triton"), "triton", interpreter=True)


def pick(impl: str, *ts) -> str:
    """"torch" or "triton" for the setting `impl` on these inputs (the rule of `longctx.ops.pick`)."""

    def why_not():
        why = unavailable(ts[0].device)
        if why is None:
            from .triton import rejects

            why = rejects(*ts)
        return why

    return _pick("swiglu", impl, IMPLS, ts[0].is_cuda, why_not)


def clamped_swiglu(gate, up, limit: float, impl: str = "torch"):
    """silu(min(gate, limit)) * clamp(up, -limit, limit), keeping only gate and up for backward."""
    if pick(impl, gate, up) == "triton":
        from .triton import clamped_swiglu_triton

        return clamped_swiglu_triton(gate, up, limit)
    from .naive import ClampedSwiGLU

    return ClampedSwiGLU.apply(gate, up, limit)


def clamped_swiglu_packed(h, limit: float, impl: str = "torch"):
    """silu(min(gate, limit)) * clamp(up, -limit, limit) of h = [gate | up] (the last dim split in halves)."""
    if h.shape[-1] % 2:
        raise ValueError(f"clamped_swiglu_packed: the last dim ({h.shape[-1]}) must be gate and up, of equal width.")
    if pick(impl, h) == "triton":
        from .triton import clamped_swiglu_packed_triton

        return clamped_swiglu_packed_triton(h, limit)
    from .naive import ClampedSwiGLUPacked

    return ClampedSwiGLUPacked.apply(h, limit)
