"""DSA sparse attention (`kernels.sparse_attention`): the plain-torch twin (`naive.py`), our Triton kernel
(`triton.py`), which gathers each selected latent row once per tile for all heads, and FlashMLA's sparse
prefill forward with our Triton backward (`flashmla.py`, where sgl-flash-mla is installed).

"auto" runs Triton, or FlashMLA where it is installed and measured faster (64 heads and more, bf16, latent
width 512, SM90: `auto_backend`); "triton" and "flashmla" run that one or stop with the reason."""

from __future__ import annotations

from .. import fast_path_problem, lazy_attr, module_import_error
from .. import pick as _pick

IMPLS = ("auto", "torch", "triton", "flashmla")

_TWINS = {n: "naive" for n in ("dense_masked_attention", "kept_sparse_attention_torch", "sparse_attention_bwd_torch",
                               "sparse_attention_torch")}
__all__ = ["IMPLS", "auto_backend", "pick", "unavailable", *_TWINS]


def __getattr__(name: str):
    return lazy_attr(__name__, _TWINS, name)


def _shape(cfg, heads, width):
    """(heads, latent width) from the arguments, else from a ModelConfig, else None."""
    if heads is None and cfg is not None:
        heads, width = cfg.attn_heads, cfg.kv_lora_rank
    return heads, width


def unavailable(device, cfg=None, impl: str = "triton", heads: int | None = None, width: int | None = None,
                dtype=None) -> str | None:
    """Why backend `impl` ("triton"; "auto" means it too; or "flashmla") cannot run on `device`, or None.
    For FlashMLA also the model's shapes (`cfg`, or heads and width) and the inputs' dtype where given.
    Shapes the Triton kernel cannot take raise its ValueError when it runs."""
    if impl != "flashmla":
        return _triton_problem(device, interpreter=True)
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return f"it runs on CUDA tensors, and these are on {dev.type}"
    from . import flashmla

    heads, width = _shape(cfg, heads, width)
    err = flashmla.import_error()  # not in .[gpu]: an estimate for another machine assumes it only where it imports
    if err is not None:
        return (f"sgl-flash-mla does not import: {err}; `pip install --no-deps sgl-flash-mla` installs it (its "
                "kernels use torch's stable ABI; its metadata asks for a newer torch than it needs)")
    return (flashmla.device_problem(dev) or (flashmla.shape_problem(heads, width, dtype) if heads is not None else None)
            or _triton_problem(device))


def _triton_problem(device, interpreter: bool = False) -> str | None:
    """Why our Triton kernels (the forward, and the backward every backend here uses) cannot run, or None."""
    return fast_path_problem(device, lambda: module_import_error(f"{__name__}.triton"), "triton", interpreter=interpreter)


def auto_backend(device, cfg=None, heads: int | None = None, width: int | None = None, dtype=None) -> str:
    """The fast backend auto runs: "flashmla" where it can run these shapes and heads >= 64 (measured faster:
    flashmla.py's docstring), else "triton"."""
    from . import flashmla

    heads, width = _shape(cfg, heads, width)
    if heads is None or heads < flashmla.AUTO_MIN_HEADS:
        return "triton"
    return "flashmla" if unavailable(device, impl="flashmla", heads=heads, width=width, dtype=dtype) is None else "triton"


def pick(impl: str, device, cfg=None, heads: int | None = None, width: int | None = None, dtype=None,
         warn: bool = True) -> str:
    """"torch", "triton" or "flashmla" for kernels.sparse_attention = `impl` on `device` (the rule of
    `longctx.ops.pick`, then auto's choice between the two fast backends, `auto_backend`), for the model's
    shapes (`cfg`, or heads and width) and the inputs' dtype where given."""
    import torch

    dev = torch.device(device)
    shape = dict(heads=heads, width=width, dtype=dtype)
    got = _pick("sparse_attention", impl, IMPLS, dev.type == "cuda", lambda: unavailable(dev, cfg, impl=impl, **shape),
                warn=warn)
    return auto_backend(dev, cfg, **shape) if got == "triton" and impl == "auto" else got
