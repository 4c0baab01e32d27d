"""The MoE router's fp32 logits (`kernels.router`): the torch twin (`naive.py`, x cast to fp32) and the
split-weight bf16 matmuls (`bf16x3.py`, the same product on the tensor cores without an fp32 copy of x)."""

from __future__ import annotations

from .. import fast_path_problem, lazy_attr
from .. import pick as _pick

IMPLS = ("auto", "torch", "bf16x3")

_TWINS = {"Fp32Logits": "naive", "router_logits_torch": "naive"}
__all__ = ["IMPLS", "pick", "router_logits", "unavailable", *_TWINS]


def __getattr__(name: str):
    return lazy_attr(__name__, _TWINS, name)


def unavailable(device, cfg=None) -> str | None:
    """Why the bf16x3 path cannot run on `device`, or None: it needs cuBLAS's bf16 matmul with fp32 output
    (`torch.mm(..., out_dtype=torch.float32)`, CUDA only), and nothing beyond torch."""
    return fast_path_problem(device, lambda: None, "torch")


def rejects(x, weight) -> str | None:
    """Why the bf16x3 path cannot take these inputs, or None."""
    import torch

    if x.dtype != torch.bfloat16:
        return f"the bf16x3 router takes bf16 tokens, not {x.dtype} (fp32 tokens need no cast: the twin is exact)"
    if weight.dtype != torch.float32:
        return f"the bf16x3 router takes an fp32 router weight, not {weight.dtype}"
    return None


def pick(impl: str, x, weight) -> str:
    """"torch" or "bf16x3" for the setting `impl` on these inputs (the rule of `longctx.ops.pick`)."""
    return _pick("router", impl, IMPLS, x.is_cuda, lambda: unavailable(x.device) or rejects(x, weight))


def router_logits(x, weight, impl: str = "torch"):
    """x @ weight^T in fp32 ([t, hidden] tokens, [E, hidden] fp32 weight -> [t, E] fp32), through the
    backend `impl` names (or picks, for "auto")."""
    if pick(impl, x, weight) == "bf16x3":
        from .bf16x3 import router_logits_bf16x3

        return router_logits_bf16x3(x, weight)
    from .naive import router_logits_torch

    return router_logits_torch(x, weight)
