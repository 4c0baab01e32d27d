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

ROW_CAP = 32768  # the longest row the Triton path's row kernel holds in registers (32 warps x 32 keys a thread)
ROW_AUTO = 8192  # its "auto" takes the row kernel up to rows this long: past it "compact" is faster (H200)
GROUP = 16  # pools per group maximum that the score kernel writes for the "compact" selection
GROUP_ROW_CAP = 16384  # group maxima a row the compact kernel holds in registers; wider rows take coarser groups


def compact_group(n: int, k: int) -> int | None:
    """The pools per group the Triton path's "compact" selection uses on rows of n scores with k picks
    (GROUP, or a power-of-two multiple of it so that a row has at most GROUP_ROW_CAP groups), or None
    where its candidate buffer (k x group) would not fit one register row (ROW_CAP). Plain arithmetic, so
    the memory estimate uses it without importing Triton."""
    groups = -(-n // GROUP)
    m = -(-groups // GROUP_ROW_CAP)
    group = GROUP * (1 << max(0, m - 1).bit_length())
    return None if k * group > ROW_CAP else group


def auto_method(n: int, k: int) -> str:
    """The selection the Triton path's "auto" runs on rows of n scores with k picks: the row kernel ("rows")
    up to ROW_AUTO, then "compact" where its buffer fits and a row has more than k groups (with fewer it
    keeps every score), else "topk"."""
    if n <= ROW_AUTO:
        return "rows"
    group = compact_group(n, k)
    return "compact" if group is not None and -(-n // group) > k else "topk"

_TWINS = {"kpool_scores_torch": "naive", "kpool_topk_torch": "naive", "select_from_scores": "naive"}
__all__ = ["IMPLS", "ROW_AUTO", "ROW_CAP", "GROUP", "GROUP_ROW_CAP", "compact_group", "auto_method", "unavailable", *_TWINS]


def __getattr__(name: str):
    return lazy_attr(__name__, _TWINS, name)


def unavailable(device, cfg=None) -> str | None:
    """Why the Triton path cannot run on `device`, or None. Shapes it cannot take raise its ValueError."""
    return fast_path_problem(device, lambda: module_import_error(f"{__name__}.triton"), "triton", interpreter=True)
