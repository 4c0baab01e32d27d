"""DSA sparse attention (`kernels.sparse_attention`): the plain-torch twin (`naive.py`) and our Triton
kernel (`triton.py`), which gathers each selected latent row once per tile for all heads."""

from __future__ import annotations

from .. import fast_path_problem, lazy_attr, module_import_error

IMPLS = ("auto", "torch", "triton")

_TWINS = {n: "naive" for n in ("dense_masked_attention", "kept_sparse_attention_torch", "sparse_attention_bwd_torch",
                               "sparse_attention_torch")}
__all__ = ["IMPLS", "unavailable", *_TWINS]


def __getattr__(name: str):
    return lazy_attr(__name__, _TWINS, name)


def unavailable(device, cfg=None) -> str | None:
    """Why the Triton kernel cannot run on `device`, or None. Shapes it cannot take raise its ValueError."""
    return fast_path_problem(device, lambda: module_import_error(f"{__name__}.triton"), "triton", interpreter=True)
