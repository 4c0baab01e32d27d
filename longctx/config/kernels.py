"""The `kernels` section of the training config: which backend runs each op of the model.

Every field is one op (`longctx/ops/<op>/`) and takes one of that op's `IMPLS`, defined beside its
implementations:

  "auto"     the fast path on CUDA where it imports and takes the inputs, else the plain-torch twin
             (on CUDA with a warning naming the setting); the default;
  "torch"    the plain-torch twin (what the CPU runs, and the GPU tests' fp32 reference);
  a backend  the fast path ("triton": ours, "fla": fla-core's, "liger": liger-kernel's, "flashmla":
             sgl-flash-mla's, "bf16x3": torch's cuBLAS matmuls on split weights); a run where it cannot
             run stops at the start with a ConfigError naming the setting.

`longctx.kernels.apply_kernels` sets them on a model and `longctx.kernels.planned` says, without running,
what each will run on a device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import ConfigError, did_you_mean
from ..ops import indexer, kda, loss, mhc, rms_norm, router, sparse_attention, swiglu

# kernels.<field> -> the op package that defines its values (IMPLS)
OPS = {"kda": kda, "kda_conv": kda, "kda_norm": kda, "sparse_attention": sparse_attention, "indexer": indexer,
       "loss": loss, "mhc": mhc, "rms_norm": rms_norm, "swiglu": swiglu, "router": router}

# The flat TrainConfig fields these replace, and what to set instead.
_REPLACED = {
    "backend": "three settings, kernels.kda, kernels.sparse_attention and kernels.indexer",
    "loss_impl": "kernels.loss",
    "residual_impl": "kernels.mhc",
    "kda_conv": "kernels.kda_conv",
    "kda_norm": "kernels.kda_norm",
    "norm_impl": "kernels.rms_norm",
    "swiglu_impl": "kernels.swiglu",
}


@dataclass
class KernelConfig:
    """Which backend runs each op; see the module docstring for the values."""

    kda: str = "auto"               # the KDA recurrence: fla-core's chunk kernel ("fla")
    kda_conv: str = "auto"          # KDA's short conv: fla's causal_conv1d ("fla")
    kda_norm: str = "auto"          # KDA's gated output norm: fla's fused gated RMSNorm ("fla")
    sparse_attention: str = "auto"  # DSA's attention over the selected tokens: ours ("triton"), or FlashMLA's forward
                                    # with our backward ("flashmla"; auto's from 64 heads where sgl-flash-mla imports)
    indexer: str = "auto"           # the k-pool indexer's selection: ours, score buffer + k-th select ("triton")
    loss: str = "auto"              # the LM head + cross entropy: liger's fused kernel ("liger")
    mhc: str = "auto"               # the mHC residuals: liger's ops, our projection up to 8 streams ("liger")
    rms_norm: str = "auto"          # every RMSNorm: ours ("triton")
    swiglu: str = "auto"            # the MLPs' and experts' clamped SwiGLU: ours ("triton")
    router: str = "auto"            # the MoE router's fp32 logits from bf16 tokens: split-weight bf16 matmuls ("bf16x3")

    @classmethod
    def every(cls, impl: str) -> "KernelConfig":
        """Every op on `impl` ("torch": the plain model; "auto": the default)."""
        return cls(**{f.name: impl for f in dataclasses.fields(cls)})

    @classmethod
    def from_dict(cls, d: dict | None) -> "KernelConfig":
        """The [kernels] table of a config, validated: unknown names and values are one ConfigError each."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ConfigError(f"kernels must be a table of op = backend (got {type(d).__name__}); e.g. [kernels] "
                              "kda = \"torch\".")
        known = [f.name for f in dataclasses.fields(cls)]
        for k in d:
            if k not in known:
                raise ConfigError(f"unknown setting kernels.{k}"
                                  + (did_you_mean(str(k), known) or f"; the ops are {', '.join(known)}."))
        return cls(**d).validate()

    def validate(self) -> "KernelConfig":
        for f in dataclasses.fields(self):
            v, allowed = getattr(self, f.name), OPS[f.name].IMPLS
            if v not in allowed:
                raise ConfigError(f"kernels.{f.name} must be one of {', '.join(allowed)} (got {v!r})"
                                  + ((did_you_mean(v, allowed) if isinstance(v, str) else "") or "."))
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_replaced(d: dict, prefix: str = "") -> None:
    """One ConfigError for a flat kernel setting of the old layout (`backend`, `loss_impl`, ...) in the
    config table `d`, naming what replaces it."""
    for k in d:
        if k in _REPLACED:
            new = _REPLACED[k]
            first = new.split("kernels.", 1)[1].split(",")[0].split(" ")[0]
            raise ConfigError(f"{prefix}{k} is now {new}; set {'them' if ',' in new else 'it'} in the [kernels] "
                              f"table (e.g. --set kernels.{first}=torch).")
        if k == "indexer_kernel":
            raise ConfigError(f"{prefix}indexer_kernel is gone: the indexer has one Triton path, chosen by "
                              "kernels.indexer (auto, torch or triton); delete the setting.")
