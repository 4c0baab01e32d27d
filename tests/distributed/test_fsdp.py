"""FSDP2 data parallelism, in 2 and 4 gloo processes against one process holding the whole batch
(fp32, relative <= 1e-5): the loss (summed shares), every parameter gradient (gathered with
full_tensor) and the parameters after one AdamW step with gradient clipping; the same with the
block recompute of the memory plan (every block, and the first two of four), and with two
accumulated micro-batches that reduce once; each rank holds ~1/world of the parameter bytes; the
collectives FSDP runs per step are counted; under bf16 gathers the routers stay fp32.

The one process takes the batch in as many micro-batches as the ranks hold pieces (the same
global-mean loss and its gradient, summed in the same grouping). Taken in one piece instead, its
fp32 gradients differ from these by the order of the additions alone: up to 1.4e-5 relative for
mHC's three scale parameters here (sums with heavy cancellation), the same 1.4e-5 by which one
process's 1-piece and 2-piece runs differ; everything else agrees to ~1e-6 either way.

Model: the tiny preset shrunk to hidden 16 (KKKD, dense + MoE, mHC), 8 sequences of 12 tokens,
some labels masked so that ranks hold different label counts (the loss-share scaling matters).
"""

from __future__ import annotations

import math

import pytest
import torch

import launch
from fsdp_util import CountedCollectives, batch, build, one_process_step, optimizer, rank_rows, step_errors

pytestmark = pytest.mark.usefixtures("one_thread")  # the one-process references: tiny ops
TOL = 1e-5


def reference(recompute: bool | int, pieces: int) -> dict:
    """One process: the loss, gradients and post-step parameters of the whole batch, taken in
    `pieces` consecutive micro-batches (see the module docstring for why). `recompute`: every block
    (True) or the first N (`memory.recompute = N`)."""
    model = build()
    if recompute:
        from longctx.memory.recompute import RecomputePolicy

        model.block_fn = RecomputePolicy(recompute=recompute)
    x, y = batch()
    return one_process_step(model, optimizer(model), x, y, pieces)


def check_data_parallel(rank: int, world: int, recompute: bool | int, micro: int, want: dict, cp: int = 1) -> dict:
    """`cp` > 1: a (dp, cp) mesh whose every rank holds its own sequences. FSDP sees no difference
    between a cp rank's share of a sequence and a dp rank's share of the batch; the check is that the
    units shard over, and the gradients sum over, the flattened dp x cp ranks."""
    from longctx.distributed import ParallelConfig, build_mesh
    from longctx.distributed.fsdp import loss_share, parallelize, set_gradient_sync

    mesh = build_mesh(world, ParallelConfig(cp=cp))
    model = build()
    if recompute:
        from longctx.memory.recompute import RecomputePolicy

        model.block_fn = RecomputePolicy(recompute=recompute)
    parallelize(model, mesh)
    opt = optimizer(model)
    x, y = batch()
    xl, yl = rank_rows(x, y, rank, world)
    n_all = (y != -100).sum()
    loss = torch.zeros(())
    for j, (xm, ym) in enumerate(zip(xl.chunk(micro), yl.chunk(micro))):
        set_gradient_sync(model, j == micro - 1)  # reduce once, after the last micro-batch
        lm_loss = model(xm, labels=ym, return_logits=False).lm_loss
        if micro == 1:
            part = loss_share(lm_loss, ym, mesh)
        else:  # the share of the whole step's mean: the label count of every rank's every micro-batch
            part = lm_loss * ((ym != -100).sum() / n_all)
        part.backward()
        loss += part.detach()
    errs = step_errors(model, opt, loss, want)
    return errs


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("recompute, micro", [(False, 1), (True, 1), (2, 1), (False, 2)],
                         ids=["plain", "recompute", "recompute the first 2", "accumulate"])
def test_data_parallel_matches_one_process(world, recompute, micro):
    want = reference(recompute, world * micro)
    for cp in [1, 2] if world == 4 and micro == 1 and not recompute else [1]:
        for rank, errs in enumerate(launch.run(check_data_parallel, world, recompute, micro, want, cp)):
            bad = {k: v for k, v in errs.items() if not v <= TOL}
            assert not bad, f"rank {rank} of {world} (cp {cp}): relative errors above {TOL}: {bad}"


def check_bytes_and_collectives(rank: int, world: int) -> dict:
    """Per-rank parameter bytes, and the all-gathers / reduce-scatters of one recomputed step."""
    from longctx.distributed import ParallelConfig, build_mesh
    from longctx.distributed.fsdp import loss_share, parallelize
    from longctx.memory.recompute import RecomputePolicy

    mesh = build_mesh(world, ParallelConfig(cp=1))
    model = build()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    bound = sum(math.ceil(p.shape[0] / world) * (p.numel() // max(p.shape[0], 1)) * p.element_size()
                for p in model.parameters())  # dim-0 shards, the first ranks take the remainder
    parallelize(model, mesh)
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    out = {"local": local, "total": total, "bound": bound, "units": len(model.layers) + 1}
    for recompute in (False, True):
        model.block_fn = RecomputePolicy(recompute=True) if recompute else None
        xl, yl = rank_rows(*batch(), rank, world)
        with CountedCollectives() as counted:
            o = model(xl, labels=yl, return_logits=False)
            loss_share(o.lm_loss, yl, mesh).backward()
        model.zero_grad(set_to_none=True)
        out["recompute" if recompute else "plain"] = dict(counted.counts)

    # bf16 gathers: the blocks compute on bf16 parameters, the routers on fp32 ones, and the fp32
    # shards receive fp32 gradients
    model = parallelize(build(), mesh, param_dtype=torch.bfloat16)
    seen = {}
    moe = next(b.mlp for b in model.layers if hasattr(b.mlp, "router"))

    def record(name, attr):
        def hook(module, args):  # runs after FSDP's own pre-forward: the gathered parameters, the cast inputs
            seen.setdefault(name, getattr(module, attr).dtype)  # returns None: the arguments stay
            seen.setdefault(name + " input", args[0].dtype)

        return hook

    moe.router.register_forward_pre_hook(record("router", "weight"))
    moe.experts.register_forward_pre_hook(record("experts", "gate_up"))
    xl, yl = rank_rows(*batch(), rank, world)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = model(xl, labels=yl, return_logits=False)
    loss_share(o.lm_loss, yl, mesh).backward()
    seen["grads"] = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
    seen["shards"] = sorted({str(p.dtype) for p in model.parameters()})
    seen["finite"] = bool(torch.isfinite(o.lm_loss))
    out["bf16"] = seen
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_parameter_bytes_and_collectives_per_rank(world):
    res = launch.run(check_bytes_and_collectives, world)
    total = res[0]["total"]
    assert sum(r["local"] for r in res) == total, "the shards do not add up to the model"
    for rank, r in enumerate(res):
        assert r["local"] <= r["bound"] <= 1.1 * total / world, (rank, r)
        # the root keeps its parameters for backward; each block gathers for its forward and again
        # for its backward (under recompute: for the recompute, whose gathered parameters the backward uses)
        blocks = r["units"] - 1
        for mode in ("plain", "recompute"):
            assert r[mode] == {"all_gather": 2 * blocks + 1, "reduce_scatter": blocks + 1}, (rank, mode, r[mode])
        # the router's input stays bf16: it keeps x for backward in the activation dtype
        assert r["bf16"] == {"router": torch.float32, "router input": torch.bfloat16, "experts": torch.bfloat16,
                             "experts input": torch.bfloat16, "grads": ["torch.float32"], "shards": ["torch.float32"],
                             "finite": True}, (rank, r["bf16"])
