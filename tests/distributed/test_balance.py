"""MoE routing statistics over several ranks' tokens, in 2 and 4 gloo processes: the distributed
k-th largest, the quantile balancer's bias (one step and the iterated form), the sign step's load
and the aux loss equal the single-process ones on the concatenated tokens — the order statistics
bit for bit (fp32 compares -0 == +0 and every NaN alike, so those are canonicalised first).

Through the whole tiny model under FSDP, the MoE layers' pending quantile biases equal one
process's to fp32 precision.

The tokens are split unevenly, one rank of four holding none; the scores have ties (a coarse grid),
-inf, +inf and values near the fp32 limits, and rows whose alpha is infinite turn s - alpha into NaN.
"""

from __future__ import annotations

import pytest
import torch

import launch

pytestmark = pytest.mark.usefixtures("one_thread")  # the one-process references: tiny ops
N_EXPERTS, TOP_K = 8, 2
SPLITS = {2: [23, 14], 4: [0, 5, 20, 12]}  # 37 tokens


def _canon(x: torch.Tensor) -> torch.Tensor:
    """The int32 bits of x with -0 made +0 and every NaN the same NaN (what fp32 order cannot tell apart)."""
    x = torch.where(x == 0, torch.zeros_like(x), x)
    x = torch.where(x.isnan(), torch.full_like(x, float("nan")), x)
    return x.contiguous().view(torch.int32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_canon(a.float()), _canon(b.float()))


def _scores(kind: str, m: int, g: torch.Generator) -> torch.Tensor:
    if kind == "router":  # sigmoid scores on a grid of 1/32: many exact ties
        return (torch.sigmoid(torch.randn(m, N_EXPERTS, generator=g)) * 32).round() / 32
    s = torch.randint(-3, 4, (m, N_EXPERTS), generator=g).float() / 4
    if kind == "infinite":  # rows whose (k+1)-th largest is -inf or +inf: s - alpha is NaN there
        pick = torch.tensor([float("-inf"), float("inf")])[torch.randint(0, 2, (m, N_EXPERTS), generator=g)]
        return torch.where(torch.rand(m, N_EXPERTS, generator=g) < 0.6, pick, s)
    special = torch.tensor([float("-inf"), float("inf"), 3e38, -3e38, 1e30, -1e-30, 1e-30])
    where = torch.rand(m, N_EXPERTS, generator=g) < 0.25
    pick = special[torch.randint(0, len(special), (m, N_EXPERTS), generator=g)]
    return torch.where(where, pick, s)


def _local(x: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    sizes = SPLITS[world]
    start = sum(sizes[:rank])
    return x[start : start + sizes[rank]]


def check_statistics(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from longctx.distributed import ParallelConfig, build_mesh
    from longctx.distributed.balance import aux_loss_share, global_load, kth_largest, quantile_bias, statistics_group
    from longctx.layers.moe import quantile_bias as single_quantile_bias
    from longctx.layers.moe import sign_step_bias

    # every rank of the (dp, cp) mesh: a dp2 x cp2 mesh at 4 ranks
    group = statistics_group(build_mesh(world, ParallelConfig(cp=2 if world == 4 else 1)))
    m = sum(SPLITS[world])
    g = torch.Generator().manual_seed(7)
    out = {}
    for kind in ("router", "extreme", "infinite"):
        s_all = _scores(kind, m, g)
        s = _local(s_all, world, rank)
        # the order statistic itself, over each expert's column of all ranks' tokens
        for bits, ks in ((8, (1, 2, 9, m // 2, m - 1, m)), (4, (3, m)), (1, (1, m // 3))):
            for k in ks:
                want = s_all.t().topk(k, dim=1).values[:, -1]
                out[(kind, "kth", bits, k)] = _same(kth_largest(s.t(), k, group, bits=bits), want)
        for bias_kind in ("zero", "random", "tied"):
            if bias_kind == "zero":
                bias = torch.zeros(N_EXPERTS)
            elif bias_kind == "random":
                bias = 0.3 * torch.randn(N_EXPERTS, generator=g)
            else:
                bias = torch.randint(-1, 2, (N_EXPERTS,), generator=g).float() / 8
            for iters, tol in ((1, 0.0),) + (((32, 0.01),) if bias_kind == "random" else ()):
                want = single_quantile_bias(s_all, bias, TOP_K, iters, tol)
                got = quantile_bias(s, bias, TOP_K, iters, tol, group=group)
                out[(kind, "quantile", bias_kind, iters)] = _same(got, want)
        # sign step: the load of all ranks' tokens
        bias = 0.3 * torch.randn(N_EXPERTS, generator=g)
        from longctx.layers.moe import select_experts

        load_all = torch.bincount(select_experts(s_all + bias, TOP_K).flatten(), minlength=N_EXPERTS)
        load = torch.bincount(select_experts(s + bias, TOP_K).flatten(), minlength=N_EXPERTS)
        got_load = global_load(load, group)
        out[(kind, "load")] = torch.equal(got_load, load_all)
        out[(kind, "sign")] = _same(sign_step_bias(bias, got_load.float(), 1e-3), sign_step_bias(bias, load_all.float(), 1e-3))

    # aux loss: the shares sum to the single-process loss, their gradients are its gradient's rows
    logits_all = torch.randn(m, N_EXPERTS, generator=g)
    idx_all = select_experts(torch.sigmoid(logits_all), TOP_K)

    def aux(logits, idx, grp):
        p = torch.sigmoid(logits)
        prob_sum = (p / p.sum(-1, keepdim=True)).sum(0)
        load = torch.bincount(idx.flatten(), minlength=N_EXPERTS)
        return aux_loss_share(load, prob_sum, logits.shape[0], N_EXPERTS, TOP_K, 1e-2, grp)

    x_all = logits_all.clone().requires_grad_()
    a_all = aux(x_all, idx_all, None)
    a_all.backward()
    x = _local(logits_all, world, rank).clone().requires_grad_()
    a = aux(x, _local(idx_all, world, rank), group)
    a.backward()
    total = a.detach().clone()
    dist.all_reduce(total, group=group)
    out["aux loss"] = float((total - a_all).abs() / a_all.abs())
    gw = _local(x_all.grad, world, rank)
    out["aux grad"] = float((x.grad - gw).abs().max() / x_all.grad.abs().max()) if gw.numel() else 0.0
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_statistics_match_one_process(world):
    for rank, res in enumerate(launch.run(check_statistics, world)):
        assert res.pop("aux loss") <= 1e-6, (rank, res)
        assert res.pop("aux grad") <= 1e-6, (rank, res)
        bad = [case for case, ok in res.items() if not ok]
        assert not bad, f"rank {rank}: not bit-identical to one process: {bad}"


def test_order_keys_cover_every_float():
    """The int32 image is monotone over the whole fp32 line, and maps back to the same value."""
    from longctx.distributed.balance import _ordered_keys, _values_of_keys

    x = torch.tensor([float("-inf"), -3.4e38, -1.0, -1e-45, -0.0, 0.0, 1e-45, 1.0, 3.4e38, float("inf"), float("nan")])
    keys = _ordered_keys(x)
    assert (keys[1:-1] >= keys[:-2]).all() and (keys[1:] > keys[:-1]).sum() == len(x) - 2  # -0 and +0 share a key
    assert _same(_values_of_keys(keys), x)


def check_model_bias(rank: int, world: int, want: list) -> list:
    """The model's quantile bias updates after one training forward of this rank's sequences (the
    tiny model under FSDP), with every MoE's statistic taken over all ranks: MoE calls
    `moe.quantile_bias`, which this points at the distributed one for the duration."""
    import longctx.layers.moe as moe_mod
    from fsdp_util import B, batch, build
    from longctx.distributed import ParallelConfig, build_mesh
    from longctx.distributed.balance import attach_statistics, statistics_group
    from longctx.distributed.fsdp import parallelize

    mesh = build_mesh(world, ParallelConfig(cp=2 if world == 4 else 1))
    group = statistics_group(mesh)
    model = parallelize(build(), mesh)
    assert attach_statistics(model, group) == len(want)
    stats = {m.statistics for m in model.modules() if isinstance(m, moe_mod.MoE)}
    assert len({s.group for s in stats}) == 1
    real = moe_mod.quantile_bias
    moe_mod.quantile_bias = next(iter(stats)).quantile_bias
    try:
        x, _ = batch()
        per = B // world
        with torch.no_grad():
            model(x[rank * per : (rank + 1) * per])
    finally:
        moe_mod.quantile_bias = real
    got = [m.pending_bias for m in model.modules() if isinstance(m, moe_mod.MoE)]
    return [float((g - w).abs().max()) for g, w in zip(got, want)]


@pytest.mark.parametrize("world", [2, 4])
def test_model_bias_update_matches_one_process(world):
    """Through the whole model the scores differ from one process's by fp32 rounding (other batch
    shapes), so the updates agree to fp32 precision rather than bit for bit: to 1e-5 of the scores'
    scale (sigmoid scores, at most 1). The bias is a difference of two scores near 0.5 at this
    initialisation, at most ~1e-2 in size, so an error relative to the bias itself would count the
    cancellation; the per-rank quota in place of the global one moves it by ~0.5."""
    from fsdp_util import batch, build
    from longctx.layers.moe import MoE

    model = build()
    x, _ = batch()
    with torch.no_grad():
        model(x)
    want = [m.pending_bias for m in model.modules() if isinstance(m, MoE)]
    assert want and all(w is not None and w.abs().max() > 0 for w in want)
    for rank, errs in enumerate(launch.run(check_model_bias, world, want)):
        assert max(errs) <= 1e-5, (rank, errs)  # absolute: see the docstring
