"""mHC residual maths (`kernels.mhc`): the plain-torch twin (`naive.py`) and liger-kernel's Triton mHC ops
(`liger.py`), whose coefficient projection runs our Triton kernel (`triton.py`) for up to 8 streams."""

from __future__ import annotations

from .. import fast_path_problem, lazy_attr

IMPLS = ("auto", "torch", "liger")

_TWINS = {"mhc_coefficients": "naive", "mhc_post_res": "naive", "mhc_pre": "naive", "mhc_project": "naive"}
__all__ = ["IMPLS", "unavailable", *_TWINS]


def __getattr__(name: str):
    return lazy_attr(__name__, _TWINS, name)


def unavailable(device, cfg=None) -> str | None:
    """Why liger's mHC ops cannot run on `device` for the model `cfg` (a ModelConfig), or None."""
    from .liger import LIGER_MIN_VERSION, MAX_STREAMS, import_error, streams_supported

    why = fast_path_problem(device, import_error, f"liger-kernel >= {LIGER_MIN_VERSION}")
    if why is None and cfg is not None:
        if not streams_supported(cfg.hc_streams):
            why = f"liger's mHC kernels take model.hc_streams a power of two <= {MAX_STREAMS}, not {cfg.hc_streams}"
        elif cfg.hc_sinkhorn_iters < 1:
            why = f"liger's mHC kernels take model.hc_sinkhorn_iters >= 1, not {cfg.hc_sinkhorn_iters}"
    return why
