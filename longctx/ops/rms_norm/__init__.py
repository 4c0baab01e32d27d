"""RMSNorm (`kernels.rms_norm`): the torch twin (`naive.py`) and fused Triton kernels (`triton.py`, the
same arithmetic and saved tensors in one pass over the rows)."""

from __future__ import annotations

from .. import fast_path_problem, lazy_attr, module_import_error
from .. import pick as _pick

IMPLS = ("auto", "torch", "triton")

_TWINS = {"RMSNormFn": "naive", "rms_norm_plain": "naive", "rms_norm_torch": "naive"}
__all__ = ["IMPLS", "pick", "rms_norm", "unavailable", *_TWINS]


def __getattr__(name: str):
    return lazy_attr(__name__, _TWINS, name)


def unavailable(device, cfg=None) -> str | None:
    """Why the Triton kernels cannot run on `device`, or None."""
    return fast_path_problem(device, lambda: module_import_error(f"{__name__}.triton"), "triton", interpreter=True)


def pick(impl: str, x, weight) -> str:
    """"torch" or "triton" for the setting `impl` on these inputs (the rule of `longctx.ops.pick`)."""

    def why_not():
        why = unavailable(x.device)
        if why is None:
            from .triton import rejects

            why = rejects(x, weight)
        return why

    return _pick("rms_norm", impl, IMPLS, x.is_cuda, why_not)


def rms_norm(x, weight, eps: float, impl: str = "torch"):
    """weight * RMSNorm(x) in x's dtype, through the backend `impl` names (or picks, for "auto")."""
    if pick(impl, x, weight) == "triton":
        from .triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    from .naive import rms_norm_torch

    return rms_norm_torch(x, weight, eps)
