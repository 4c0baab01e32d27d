"""Which backend runs each op of a model: set by one function, `apply_kernels`, and said ahead of a run by
another, `planned`, which the trainer's report and the memory estimator ask too.

    from longctx.config.kernels import KernelConfig
    ran = apply_kernels(model, KernelConfig(mhc="torch"))   # {"kda": "fla", ..., "mhc": "torch"} on CUDA
    with plain_torch(model):                                # every op on its torch twin (fp32 references)
        ...

Every module that runs an op holds its settings in `kernels` (a dict of kernels.<op> -> setting) and picks
per call by the one rule of `longctx.ops.pick`, so "auto" still meets the inputs (a dtype a kernel does not
take runs the twin, with a warning on CUDA); `planned` applies the same rule to the device and the model's
shapes without tensors.
"""

from __future__ import annotations

import contextlib

import torch

from .config.kernels import OPS, KernelConfig
from .ops import indexer, kda, loss, mhc, pick, rms_norm, router, sparse_attention, swiglu

__all__ = ["apply_kernels", "ops_of", "plain_torch", "planned"]

# kernels.<op> -> why its fast backend cannot run on a device for a model config (None where it can)
_UNAVAILABLE = {
    "kda": kda.unavailable, "kda_conv": kda.conv_unavailable, "kda_norm": kda.norm_unavailable,
    "sparse_attention": sparse_attention.unavailable, "indexer": indexer.unavailable, "loss": loss.unavailable,
    "mhc": mhc.unavailable, "rms_norm": rms_norm.unavailable, "swiglu": swiglu.unavailable,
    "router": router.unavailable,
}


def ops_of(cfg) -> list[str]:
    """The kernels.<op> a model of `cfg` (a ModelConfig) runs, in KernelConfig's order: KDA's three with K
    layers, the sparse attention with D layers and the indexer where one of them runs its own, mHC with
    mHC residuals, the router with MoE layers; the loss, the RMSNorms and the SwiGLUs always."""
    kinds, idx = cfg.layer_kinds(), cfg.indexer_kinds()
    used = {"loss", "rms_norm", "swiglu"}
    if "K" in kinds:
        used |= {"kda", "kda_conv", "kda_norm"}
    if "D" in kinds:
        used.add("sparse_attention")
        if any(k == "D" and idx[i] == "f" for i, k in enumerate(kinds)):
            used.add("indexer")
    if cfg.residual == "mhc":
        used.add("mhc")
    if "m" in cfg.mlp_kinds():
        used.add("router")
    return [op for op in OPS if op in used]


def planned(kernels: KernelConfig, device, model_cfg, plan=None, warn: bool = False) -> dict[str, str]:
    """What each op a model of `model_cfg` runs will run on `device` ("cpu", "cuda", a torch.device),
    without running it: {op: "torch" or its fast backend}, by the rule the layers pick by
    (`longctx.ops.pick`) applied to the device's libraries and the model's shapes. What only the inputs
    tell (a dtype a kernel does not take) is left to the run. A CUDA device this process does not see (an
    estimate for another machine) is taken to have what `pip install -e .[gpu]` installs.

    plan: the memory plan (`longctx.memory.plan.MemoryPlan`); its baseline switches make auto the torch
    twin (memory.loss_chunk 0 for the loss, chunked_indexer off for the indexer, mhc_cast_recompute off for
    mHC). An explicit backend that cannot run raises its ConfigError; warn: say auto's fallbacks on CUDA."""
    kernels.validate()
    dev = torch.device(device)
    plain = set()
    if plan is not None:
        plain = {op for op, on in (("loss", plan.loss_chunk), ("indexer", plan.chunked_indexer),
                                   ("mhc", plan.mhc_cast_recompute)) if not on}
    return {op: sparse_attention.pick(kernels.sparse_attention, dev, model_cfg, warn=warn)  # two fast backends
            if op == "sparse_attention" else
            pick(op, getattr(kernels, op), OPS[op].IMPLS, dev.type == "cuda",
                 lambda op=op: _UNAVAILABLE[op](dev, model_cfg), plain=op in plain, warn=warn)
            for op in ops_of(model_cfg)}


def apply_kernels(model, kernels: KernelConfig) -> dict[str, str]:
    """Set every module's `kernels` from `kernels`, on the device the model is on, and return what will run
    there (`planned`): an explicit backend that cannot run raises its ConfigError now rather than at the
    first step, and auto's fallbacks on CUDA are said now (RuntimeWarning). Call it after moving the model;
    the memory plan's baseline switches, applied by `longctx.memory.plan.apply_plan`, then still turn auto
    to the torch twin where they are off."""
    param = next(model.parameters(), None)
    ran = planned(kernels, param.device if param is not None else "cpu", model.cfg, warn=True)
    for m in model.modules():
        settings = getattr(m, "kernels", None)
        if isinstance(settings, dict):
            for op in settings:
                settings[op] = getattr(kernels, op)
    return ran


@contextlib.contextmanager
def plain_torch(model):
    """Every op of `model` on its plain-torch twin inside the block, the settings restored after (on error
    too): the fp32 references of the GPU tests."""
    kept = [(s, dict(s)) for m in model.modules() if isinstance(s := getattr(m, "kernels", None), dict)]
    try:
        for s, _ in kept:
            s.update(dict.fromkeys(s, "torch"))
        yield model
    finally:
        for s, old in kept:
            s.update(old)
