"""K-pool indexer selection (`kernels.indexer`): the plain-torch twin (`naive.py`) and our Triton path
(`triton.py`: a score kernel into a buffer of one block of queries, each row's k-th score, an emit kernel).

`KPoolIndexer` (longctx/layers/kpool_indexer.py) computes the unscaled q and the scaled head weights w
once for all T queries, then calls `triton.kpool_topk_triton` for pool ids, or scores and selects a block
of queries at a time in torch; it expands the pools into tokens plus the tail itself.

Ties: the Triton path gives them to the lower pool id; `torch.topk` (and so transformers' indexer) may
not, so the transformers-equivalence tests run the torch path (the CPU default), and references compared
against the kernel sort by (-score, pool).
"""

from __future__ import annotations

from .. import fast_path_problem, lazy_attr, module_import_error

IMPLS = ("auto", "torch", "triton")

_TWINS = {"kpool_scores_torch": "naive", "kpool_topk_torch": "naive", "select_from_scores": "naive"}
__all__ = ["IMPLS", "unavailable", *_TWINS]


def __getattr__(name: str):
    return lazy_attr(__name__, _TWINS, name)


def unavailable(device, cfg=None) -> str | None:
    """Why the Triton path cannot run on `device`, or None. Shapes it cannot take raise its ValueError."""
    return fast_path_problem(device, lambda: module_import_error(f"{__name__}.triton"), "triton", interpreter=True)
