"""The collectives context and expert parallelism use, as torch's autograd-aware functional collectives.

Every exchange in `longctx.distributed` goes through `all_gather`, `all_to_all` or `all_to_all_v`
here, so that one place knows which torch entry point a given torch version has, and a test can
count the bytes each mode really sends by wrapping these functions. Nothing here moves data itself:
the work is torch.distributed's (`_functional_collectives`, NCCL on GPUs, gloo on CPUs), whose
backward is the adjoint collective (all-gather <-> reduce-scatter, all-to-all <-> the reverse all-to-all).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _funcol():
    import torch.distributed._functional_collectives as fc

    return fc


def group_size(group) -> int:
    return dist.get_world_size(group)


def group_rank(group) -> int:
    return dist.get_rank(group)


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """[...] on each rank -> [n, ...], row j being rank j's tensor; differentiable (the gradient of
    row j is summed over the ranks and lands on rank j)."""
    fc = _funcol()
    # torch 2.13 renamed the entry point and deprecated the old name; 2.11 has only the old one
    fn = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
    return fc.wait_tensor(fn(x.unsqueeze(0).contiguous(), 0, group))


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """[n, ...] on each rank -> [n, ...]: row j of the result is row `rank` of rank j's input;
    differentiable (the backward is the same exchange in reverse)."""
    fc = _funcol()
    return fc.wait_tensor(fc.all_to_all_single_autograd(x.contiguous(), None, None, group))


def all_to_all_v(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows [sum in_splits, ...] -> [sum out_splits, ...]: this rank's in_splits[j] rows starting at
    sum(in_splits[:j]) go to rank j, and rank j's rows for this rank arrive as block j of the result
    (out_splits[j] rows); differentiable (the backward is the exchange with the splits swapped)."""
    fc = _funcol()
    return fc.wait_tensor(fc.all_to_all_single_autograd(x.contiguous(), list(out_splits), list(in_splits), group))


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group of a tensor that carries no gradient (counts, logged values)."""
    x = x.detach().clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def keep_in_graph(out: torch.Tensor, *received: torch.Tensor) -> torch.Tensor:
    """`out` plus 0 * one element of each received tensor.

    A collective's backward runs on a rank only if its output reaches that rank's loss, and every
    rank must run it or the others wait forever. Where a rank happens not to need what it received
    (the first rank of the sequence needs no earlier state), this keeps the collective in its graph;
    the added zeros leave `out` bit-identical."""
    for r in received:
        out = out + 0.0 * r.reshape(-1)[:1].sum().to(out.dtype)
    return out
