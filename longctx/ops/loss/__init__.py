"""The LM head + cross entropy (`kernels.loss`): the chunked plain-torch twin (`naive.py`) and liger-kernel's
fused linear + cross entropy (`liger.py`, which never holds a chunk's logits for backward)."""

from __future__ import annotations

from .. import fast_path_problem, lazy_attr
from .. import pick as _pick

IMPLS = ("auto", "torch", "liger")

_TWINS = {"token_losses_torch": "naive"}
__all__ = ["IMPLS", "pick", "token_losses", "unavailable", *_TWINS]


def __getattr__(name: str):
    return lazy_attr(__name__, _TWINS, name)


def unavailable(device, cfg=None) -> str | None:
    """Why liger's fused linear + cross entropy cannot run on `device`, or None."""
    from .liger import LIGER_MIN_VERSION, import_error

    return fast_path_problem(device, import_error, f"liger-kernel >= {LIGER_MIN_VERSION}")


def pick(impl: str, h, chunked: bool = True) -> str:
    """"torch" or "liger" for kernels.loss on hidden states h (the rule of `longctx.ops.pick`); `chunked`
    False (the plan's baseline, `memory.loss_chunk` 0: logits materialised) makes auto the torch head."""
    return _pick("loss", impl, IMPLS, h.is_cuda, lambda: unavailable(h.device), plain=not chunked)


def token_losses(h, weight, labels, impl: str = "torch", chunk: int | None = 4096):
    """Per-row cross entropy [N] fp32 of F.linear(h, weight) against labels (0 where label == -100), h [N, D].

    "torch": `chunk` rows at a time under checkpoint (`naive.token_losses_torch`). "liger": liger's fused
    kernel, LIGER_ROWS_PER_CALL rows per call and liger's own chunking inside; `chunk` does not apply."""
    if pick(impl, h, chunked=bool(chunk)) == "liger":
        from .liger import LIGER_ROWS_PER_CALL, liger_token_losses

        return liger_token_losses(h, weight, labels, rows_per_call=LIGER_ROWS_PER_CALL)
    from .naive import token_losses_torch

    return token_losses_torch(h, weight, labels, chunk)
