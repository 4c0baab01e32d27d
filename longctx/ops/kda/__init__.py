"""Kimi Delta Attention ops: plain-torch twin (`naive`) and the fla-core CUDA kernels (`fla_backend`)."""

from .fla import fla_available, fla_causal_conv1d, fla_chunk_kda, fla_gated_rms_norm, fla_recurrent_kda
from .naive import kda_chunk, kda_gate, kda_recurrent, kda_step, l2norm

__all__ = [
    "fla_available",
    "fla_causal_conv1d",
    "fla_chunk_kda",
    "fla_gated_rms_norm",
    "fla_recurrent_kda",
    "kda_chunk",
    "kda_gate",
    "kda_recurrent",
    "kda_step",
    "l2norm",
]
