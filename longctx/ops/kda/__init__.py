"""Kimi Delta Attention (`kernels.kda`) with its short conv (`kernels.kda_conv`) and gated output norm
(`kernels.kda_norm`): the plain-torch twins (`naive.py`) and fla-core 0.6.0's Triton kernels (`fla.py`).
The three settings take the same values and follow the rule of `longctx.ops.pick` each on its own."""

from __future__ import annotations

from .. import fast_path_problem, lazy_attr

IMPLS = ("auto", "torch", "fla")  # kernels.kda, kernels.kda_conv and kernels.kda_norm alike

_TWINS = {**{n: "naive" for n in ("causal_conv1d", "gated_rms_norm", "kda_chunk", "kda_gate", "kda_recurrent",
                                  "kda_step", "l2norm")},
          **{n: "fla" for n in ("fla_available", "fla_causal_conv1d", "fla_chunk_kda", "fla_gated_rms_norm",
                                "fla_import_error", "fla_recurrent_kda")}}
__all__ = ["IMPLS", "conv_unavailable", "norm_unavailable", "unavailable", *_TWINS]


def __getattr__(name: str):
    return lazy_attr(__name__, _TWINS, name)


def _fla_problem(device) -> str | None:
    from .fla import fla_import_error

    return fast_path_problem(device, fla_import_error, "fla-core 0.6.0")


def unavailable(device, cfg=None) -> str | None:
    """Why fla's chunk kernel cannot run KDA on `device` for the model `cfg` (a ModelConfig), or None."""
    why = _fla_problem(device)
    if why is None and cfg is not None:
        if cfg.kda_chunk_size not in (32, 64):
            why = f"fla's KDA kernel takes model.kda_chunk_size 32 or 64, not {cfg.kda_chunk_size}"
        elif cfg.kda_head_dim > 256:
            why = f"fla's KDA kernel takes model.kda_head_dim <= 256, not {cfg.kda_head_dim}"
    return why


def conv_unavailable(device, cfg=None) -> str | None:
    """Why fla's causal_conv1d cannot run KDA's short conv on `device`, or None."""
    return _fla_problem(device)


def norm_unavailable(device, cfg=None) -> str | None:
    """Why fla's fused gated RMSNorm cannot run KDA's output norm on `device`, or None."""
    return _fla_problem(device)
