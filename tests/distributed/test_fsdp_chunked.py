"""The sequence-chunked step under FSDP2 data parallelism (and expert parallelism), in 2 and 4 gloo
processes against one process (fp32, relative <= 1e-5, or twice the one process's own order noise
where that is larger: fsdp_util.order_noise): the loss (summed shares), every parameter gradient and
the parameters after one clipped AdamW step; the reduce-scatters run once per step, not once per chunk.

The one process runs the same chunked step over the ranks' rows one piece after another, each
piece's loss divided by the label count of the whole batch (the grouping of sums the ranks follow;
see test_fsdp.py for why one piece would differ by rounding alone). Chunks of 5 over 12 tokens
leave a short last chunk; with the indexer KL on, chunks of 4 (pool borders) and its mean over all
the ranks' rows.
"""

from __future__ import annotations

import pytest
import torch

import launch
from fsdp_util import (B, CountedCollectives, batch, build, errors_above, one_process_step, optimizer, order_noise, rank_rows,
                       step_errors, tiny_config)

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-5


def _model(kl: bool):
    if not kl:
        return build()
    from longctx.model import LongCtxModel

    torch.manual_seed(0)
    model = LongCtxModel(tiny_config().replace(indexer_loss=True))
    model.loss_chunk = None
    return model


def _chunker(kl: bool):
    from longctx.memory.sequence_chunks import SequenceChunker

    return SequenceChunker(4 if kl else 5)


def reference(kl: bool, pieces: int) -> dict:
    def piece(model, xm, ym, n):
        return _chunker(kl).forward_backward(model, xm, ym, n_labels=n, n_rows=B).loss.item()

    model = _model(kl)
    x, y = batch()
    return one_process_step(model, optimizer(model), x, y, pieces, piece)


def check_chunked(rank: int, world: int, kl: bool, ep: int, want: dict) -> dict:
    from longctx.distributed import ParallelConfig, build_mesh
    from longctx.distributed.expert_parallel import apply_expert_parallel
    from longctx.distributed.fsdp import parallelize, set_gradient_sync

    mesh = build_mesh(world, ParallelConfig(cp=1, ep=ep))
    model = _model(kl)
    if ep > 1:
        apply_expert_parallel(model, mesh, ep)
    parallelize(model, mesh)
    opt = optimizer(model)
    x, y = batch()
    xl, yl = rank_rows(x, y, rank, world)
    with CountedCollectives() as counted:
        out = _chunker(kl).forward_backward(model, xl, yl, n_labels=(y != -100).sum(), n_rows=B,
                                            grad_sync=lambda on: set_gradient_sync(model, on))
    errs = step_errors(model, opt, out.loss, want)
    # one reduce-scatter per FSDP unit that received a gradient (routers and experts among them)
    units = {id(m) for m in model.modules() if hasattr(m, "set_requires_gradient_sync")}
    return {"errs": errs, "reduce_scatters": counted.counts["reduce_scatter"], "units": len(units)}


@pytest.mark.parametrize("world, kl, ep", [(2, False, 1), (2, True, 1), (4, False, 2)],
                         ids=["dp2", "dp2-indexer-kl", "dp4-ep2"])
def test_chunked_step_matches_one_process(world, kl, ep):
    """Every error within TOL, or within twice what regrouping the one process's own sums moves it by
    (fsdp_util.order_noise)."""
    want = reference(kl, world)
    noise = order_noise(want, reference(kl, 1))
    for rank, res in enumerate(launch.run(check_chunked, world, kl, ep, want)):
        bad = errors_above(res["errs"], TOL, noise)
        assert not bad, (f"rank {rank} of {world} (ep {ep}, kl {kl}): relative errors above {TOL} "
                         f"(or 2x the order noise): {bad}")
        # 3 chunks, gradients reduced once: at most one reduce-scatter per unit (not 3 per unit)
        assert 0 < res["reduce_scatters"] <= res["units"], res
