"""Fused LM head + cross entropy through liger-kernel (CUDA only), imported lazily.

Contract. For h [N, D], the head weight w [V, D] and labels y [N] (ignore_index -100):

    liger_token_losses(h, w, y)  == F.cross_entropy(F.linear(h, w).float(), y, reduction="none")
    liger_loss_sum(h, w, y)      == liger_token_losses(h, w, y).sum()

forward and backward (h and w), within bf16 rounding (tests/ops/test_loss_gpu.py checks it against
`naive.token_losses_torch`, the model's chunked torch path). Ignored rows have loss 0 and no gradient. Under autocast the logits
are computed in the autocast dtype, as `F.linear` does; liger's CE kernel reads them in fp32.

liger-kernel 0.8.5 supports reduction="none" with a correct backward: it keeps h and w and, in the
backward, recomputes the logits chunk by chunk and folds the per-token upstream gradient in before
the weight-gradient product. So the model takes its per-token losses [B, S] (evaluation by position,
`token_losses=True`, and the training loss `sum / n`) from the same call. Its chunking is its own:
about N / ceil(V / D) rows of logits at a time (rounded up to a power of two), plus a zero [N, D]
buffer per call, so the transient grows with N. `rows_per_call` caps N per call (the rows are split
with one `torch.split`, whose backward is a single cat), which keeps the transient constant.
Each liger call synchronises with the host once (it counts the non-ignored rows with .item()), and
the wrapper's label range check once more (liger reads logits[row, label] unchecked).

`liger_loss_sum` is liger's reduced form (reduction="sum": all gradients are computed in the forward
and scaled in the backward, one logits product fewer than "none"). It returns only the scalar, so the
model does not use it; bench/fused_loss.py times it to show what a sum-only training path would gain.
"""

from __future__ import annotations

import functools
import re

import torch

__all__ = [
    "LIGER_MIN_VERSION",
    "LIGER_ROWS_PER_CALL",
    "check_loss_args",
    "import_error",
    "liger_available",
    "liger_loss_sum",
    "liger_token_losses",
    "liger_version",
]

LIGER_MIN_VERSION = "0.8.5"  # the release read and tested here (per-token-correct reduction="none" backward)
LIGER_ROWS_PER_CALL = 65536  # rows per liger call from the model (bounds liger's transient, see above)


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def liger_version() -> str | None:
    """The installed liger-kernel's version, or None when it has no metadata."""
    import importlib.metadata as md

    for name in ("liger-kernel", "liger_kernel"):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def liger_import_error(importer, need: str) -> str | None:
    """Why a liger-kernel feature cannot be used, or None: `importer()` imports what the feature
    needs (raising if it cannot), and the installed version must be LIGER_MIN_VERSION or newer."""
    try:
        importer()
    except Exception as e:  # noqa: BLE001 - ImportError, or a triton/torch mismatch raised while importing
        return f"{type(e).__name__}: {e}"
    v = liger_version()
    if v is None:
        return "liger-kernel imports but has no package metadata, so its version cannot be checked"
    if _version_tuple(v) < _version_tuple(LIGER_MIN_VERSION):
        return f"liger-kernel {v} is installed; {LIGER_MIN_VERSION} or newer is needed ({need})"
    return None


def _import_flce():
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy  # noqa: F401


@functools.lru_cache(maxsize=1)
def _import_error() -> str | None:
    return liger_import_error(_import_flce, "reduction='none' backward")


def import_error() -> str | None:
    """Why liger's fused linear + cross entropy cannot be imported, or None."""
    return _import_error()


def liger_available() -> bool:
    """True when liger-kernel (>= 0.8.5) imports and a CUDA device is present."""
    return torch.cuda.is_available() and _import_error() is None


def check_loss_args(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    """Raise ValueError (naming the shapes) for what liger's fused linear + CE cannot take."""
    if h.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"fused linear + CE takes hidden [N, D] and weight [V, D]; got hidden {tuple(h.shape)} and "
                         f"weight {tuple(weight.shape)}.")
    if weight.shape[1] != h.shape[1]:
        raise ValueError(f"fused linear + CE: hidden {tuple(h.shape)} and weight {tuple(weight.shape)} disagree on D "
                         f"({h.shape[1]} vs {weight.shape[1]}).")
    if labels.shape != (h.shape[0],):
        raise ValueError(f"fused linear + CE: labels {tuple(labels.shape)} must be [N] = [{h.shape[0]}] for hidden "
                         f"{tuple(h.shape)}.")
    if h.shape[0] == 0 or weight.shape[0] == 0:
        raise ValueError(f"fused linear + CE needs N >= 1 and V >= 1; got hidden {tuple(h.shape)}, weight "
                         f"{tuple(weight.shape)}.")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"fused linear + CE: labels must be int64 (or int32), got {labels.dtype}.")
    for name, t in (("hidden", h), ("weight", weight)):
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"fused linear + CE: {name} must be bf16, fp16 or fp32, got {t.dtype}.")
    devices = {h.device, weight.device, labels.device}
    if len(devices) != 1 or not h.is_cuda:
        raise ValueError(f"fused linear + CE (liger) runs on one CUDA device; got hidden on {h.device}, weight on "
                         f"{weight.device}, labels on {labels.device}.")
    if h.dtype != weight.dtype and not torch.is_autocast_enabled("cuda"):
        raise ValueError(f"fused linear + CE: hidden is {h.dtype} and weight {weight.dtype} outside autocast; cast one "
                         "of them or run under torch.autocast (as F.linear needs too).")


def _check_label_range(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    # liger's CE kernel reads logits[row, label] unchecked: an out-of-range label would be a silent wrong loss.
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        first = labels[bad][0].item()
        raise ValueError(f"fused linear + CE: label {first} is outside [0, {vocab}) (vocab of weight) and is not "
                         f"ignore_index {ignore_index}.")


def liger_token_losses(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                       rows_per_call: int | None = None) -> torch.Tensor:
    """Per-row cross entropy [N] fp32 of F.linear(h, weight) against labels (0 on ignored rows), fused."""
    err = _import_error()
    if err is not None:
        raise RuntimeError(f"liger fused linear + CE needs liger-kernel >= {LIGER_MIN_VERSION}; {err}")
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    check_loss_args(h, weight, labels)
    if rows_per_call is not None and rows_per_call < 1:
        raise ValueError(f"rows_per_call must be >= 1 or None (got {rows_per_call}).")
    labels = labels.long()
    _check_label_range(labels, weight.shape[0], ignore_index)
    h = h.contiguous()
    if rows_per_call is None or h.shape[0] <= rows_per_call:
        return liger_fused_linear_cross_entropy(h, weight, labels, ignore_index=ignore_index, reduction="none")
    parts = [liger_fused_linear_cross_entropy(hh, weight, yy, ignore_index=ignore_index, reduction="none")
             for hh, yy in zip(torch.split(h, rows_per_call), torch.split(labels, rows_per_call))]
    return torch.cat(parts)


def liger_loss_sum(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Sum over non-ignored rows of the cross entropy of F.linear(h, weight), fused (liger reduction="sum")."""
    err = _import_error()
    if err is not None:
        raise RuntimeError(f"liger fused linear + CE needs liger-kernel >= {LIGER_MIN_VERSION}; {err}")
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    check_loss_args(h, weight, labels)
    labels = labels.long()
    _check_label_range(labels, weight.shape[0], ignore_index)
    return liger_fused_linear_cross_entropy(h.contiguous(), weight, labels, ignore_index=ignore_index, reduction="sum")
