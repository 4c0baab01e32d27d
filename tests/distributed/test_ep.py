"""Expert parallelism in 2 and 4 gloo processes against one process holding every expert (fp32,
relative <= 1e-5).

Layer: one MoE (8 experts, top-2, shared expert) over 37 tokens split unevenly (one rank of four
holds none), chunked by 4 tokens so that the ranks run different numbers of chunks; EP=2 and EP=4
(EP=2 at 4 processes: two ep groups, each expert on two ranks). Its output rows, input gradient,
every parameter gradient (the experts' gathered whole), the quantile balancer's pending bias and
the aux loss equal one process's; each rank holds 1/EP of the routed-expert bytes.

Model: the tiny model (hidden 16, 4 experts, KKKD, dense + MoE, mHC) under FSDP2 + EP, chunked MoE
(7 tokens, no rank's token count a multiple of it): EP=2 at 2 processes, EP=4 and EP=2 x CP=2 (real
context parallelism: zigzag shards through the CP context of `cp_context`; attnres residual, see
its test) at 4: the loss, every gradient (full_tensor), the grad norm, the parameters after one
AdamW step and the pending biases equal one process's; routed-expert bytes per rank are 1/EP of the total after `apply_expert_parallel`
and 1/world once FSDP shards them over efsdp. A DCP checkpoint written at EP=2 loads into one plain
process (the same full state dict, the same next loss), and a plain process's checkpoint loads into
EP=2.
"""

from __future__ import annotations

import pytest
import torch

import launch
from cp_util import randomize, rel
from fsdp_util import B, S, batch, build, errors_above, one_process_step, optimizer, order_noise, step_rel

pytestmark = pytest.mark.usefixtures("one_thread")  # the one-process references: tiny ops
TOL = 1e-5
SPLITS = {2: [23, 14], 4: [0, 5, 20, 12]}  # 37 tokens; chunks of 4: [6, 4] and [0, 2, 5, 3] per rank
LAYER_CHUNK, MODEL_CHUNK = 4, 7


# ----------------------------------------------------------------------------- one MoE layer
def layer_config(balancer: str):
    from longctx.config import preset

    return preset("tiny").replace(hidden_size=16, n_routed_experts=8, experts_per_token=2, moe_intermediate_size=8,
                                  n_shared_experts=1, balancer=balancer)


def layer_inputs(m: int):
    g = torch.Generator().manual_seed(3)
    return torch.randn(1, m, 16, generator=g), torch.randn(1, m, 16, generator=g)


def build_layer(balancer: str):
    from longctx.layers.moe import MoE

    moe = MoE(layer_config(balancer), 0)
    randomize(moe, 5)  # scores far from tied: routing then cannot flip on fp32 rounding
    moe.chunk_tokens = LAYER_CHUNK
    return moe


def layer_reference(balancer: str) -> dict:
    moe = build_layer(balancer)
    x, w = layer_inputs(sum(SPLITS[2]))
    x.requires_grad_()
    out = moe(x)
    loss = (out * w).sum() + (moe.aux_loss if moe.aux_loss is not None else 0.0)
    loss.backward()
    return {"out": out.detach()[0], "x grad": x.grad[0], "loss": loss.item(), "bias": moe.pending_bias,
            "grads": {k: p.grad.clone() for k, p in moe.named_parameters()},
            "bytes": sum(p.numel() * p.element_size() for p in (moe.experts.gate_up, moe.experts.down))}


def check_layer(rank: int, world: int, ep: int, balancer: str, want: dict) -> dict:
    import torch.distributed as dist

    from longctx.distributed import ParallelConfig, build_mesh
    from longctx.distributed.balance import attach_statistics
    from longctx.distributed.expert_parallel import apply_expert_parallel, expert_bytes
    from longctx.distributed.mesh import expert_mesh

    mesh = build_mesh(world, ParallelConfig(ep=ep))
    moe = build_layer(balancer)
    assert apply_expert_parallel(moe, mesh, ep) == 1
    attach_statistics(moe, dist.group.WORLD)
    sizes = SPLITS[world]
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    x, w = layer_inputs(sum(sizes))
    x, w = x[:, lo:hi].clone().requires_grad_(), w[:, lo:hi]
    out = moe(x)
    loss = (out * w).sum() + (moe.aux_loss if moe.aux_loss is not None else 0.0)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    errs = {"loss": abs(total.item() - want["loss"]) / abs(want["loss"]),
            "out": rel(out.detach()[0], want["out"][lo:hi]), "x grad": rel(x.grad[0], want["x grad"][lo:hi]),
            "bias": rel(moe.pending_bias, want["bias"])}
    efsdp = expert_mesh(mesh, ep).get_group("efsdp")
    for k, p in moe.named_parameters():
        if hasattr(p, "to_local"):  # this rank's experts: its ep group's tokens; + the other groups' (efsdp)
            g = p.grad.to_local().clone()
            dist.all_reduce(g, group=efsdp)
            n = p.shape[0] // ep
            j = rank % ep
            errs[f"grad {k}"] = rel(g, want["grads"][k][j * n : (j + 1) * n])
        else:  # replicated: every rank's tokens add up
            g = p.grad.clone()
            dist.all_reduce(g)
            errs[f"grad {k}"] = rel(g, want["grads"][k])
    errs["bytes x ep / total"] = expert_bytes(moe) * ep / want["bytes"]
    return errs


@pytest.mark.parametrize("world, ep", [(2, 2), (4, 4), (4, 2)])
@pytest.mark.parametrize("balancer", ["quantile", "aux"])
def test_layer_matches_one_process(world, ep, balancer):
    want = layer_reference(balancer)
    for rank, errs in enumerate(launch.run(check_layer, world, ep, balancer, want)):
        assert errs.pop("bytes x ep / total") == 1.0, (rank, errs)
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank} of {world} (ep {ep}): relative errors above {TOL}: {bad}"


# ----------------------------------------------------------------------------- the model under FSDP
def build_model(residual: str = "mhc"):
    from longctx.layers.moe import MoE
    from longctx.model import LongCtxModel

    if residual == "mhc":
        model = build()
    else:
        from fsdp_util import tiny_config

        torch.manual_seed(0)
        model = LongCtxModel(tiny_config().replace(residual=residual))
        model.loss_chunk = None
    for m in model.modules():
        if isinstance(m, MoE):
            m.chunk_tokens = MODEL_CHUNK
    return model


def pending(model) -> list:
    from longctx.layers.moe import MoE

    return [m.pending_bias for m in model.modules() if isinstance(m, MoE)]


def model_reference(pieces: int, residual: str = "mhc") -> dict:
    """One process: loss, gradients, grad norm and post-step parameters of the whole batch in
    `pieces` micro-batches (test_fsdp's docstring: the same grouping of the sums), and the pending
    biases of one forward over the whole batch (what a step's forward over all ranks records)."""
    model = build_model(residual)
    x, y = batch()
    with torch.no_grad():
        model(x)
    bias = pending(model)
    model = build_model(residual)
    experts = sum(p.numel() * p.element_size() for k, p in model.named_parameters() if ".experts." in k)
    return {**one_process_step(model, optimizer(model), x, y, pieces), "bias": bias, "experts": experts}


def sharded_model(world: int, ep: int, cp: int = 1, residual: str = "mhc"):
    """The tiny model with EP, then FSDP, then global routing statistics (and the CP context)."""
    from longctx.distributed import ParallelConfig, build_mesh, cp_context
    from longctx.distributed.balance import attach_statistics, statistics_group
    from longctx.distributed.expert_parallel import apply_expert_parallel, expert_bytes
    from longctx.distributed.fsdp import parallelize
    from longctx.layers.dsa import SparseMLA
    from longctx.layers.kda import KimiDeltaAttention

    cfg = ParallelConfig(cp=cp, ep=ep).validate(world)
    mesh = build_mesh(world, cfg)
    model = build_model(residual)
    assert apply_expert_parallel(model, mesh, ep) == (0 if ep == 1 else len(pending(model)))
    after_ep = expert_bytes(model)
    parallelize(model, mesh)
    attach_statistics(model, statistics_group(mesh))
    ctx = cp_context(mesh, cfg)
    for m in model.modules():
        if isinstance(m, (KimiDeltaAttention, SparseMLA)):
            m.cp = ctx
    return model, mesh, cfg, {"after ep": after_ep, "after fsdp": expert_bytes(model)}


def local_rows(t: torch.Tensor, mesh, cfg) -> torch.Tensor:
    """This rank's rows of the batch (its dp rank's), and of those its cp rank's zigzag tokens."""
    from longctx.distributed import cp_rank, dp_rank, shard

    per = t.shape[0] // cfg.dp
    t = t[dp_rank(mesh) * per : (dp_rank(mesh) + 1) * per]
    return shard(t, cfg.cp, cp_rank(mesh)) if cfg.cp > 1 else t


def run_model(rank: int, world: int, ep: int, cp: int, residual: str = "mhc") -> dict:
    """One step of this rank's share: the loss (summed over ranks), every gradient and post-step
    parameter whole, the grad norm, this rank's pending biases and its routed-expert bytes."""
    import torch.distributed as dist

    from longctx.distributed.fsdp import clip_grad_norm_, loss_share

    model, mesh, cfg, nbytes = sharded_model(world, ep, cp, residual)
    opt = optimizer(model)
    x, y = batch()
    xl, yl = local_rows(x, mesh, cfg), local_rows(y, mesh, cfg)
    assert xl.numel() % MODEL_CHUNK, "the rank's tokens must not fill whole chunks"
    loss = loss_share(model(xl, labels=yl, return_logits=False).lm_loss, yl, mesh)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    # the indexer gets no gradient from the LM loss, here as in one process
    grads = {k: p.grad.full_tensor() for k, p in model.named_parameters() if p.grad is not None}
    norm = clip_grad_norm_(list(model.parameters()), 0.5)
    opt.step()
    return {"loss": total.item(), "grads": grads, "norm": float(norm), "bias": pending(model), "bytes": nbytes,
            "params": {k: p.detach().full_tensor() for k, p in model.named_parameters()}}


def errors(got: dict, want: dict) -> dict:
    errs = {"loss": abs(got["loss"] - want["loss"]) / abs(want["loss"]),
            "grad norm": abs(got["norm"] - want["norm"]) / want["norm"]}
    assert sorted(got["grads"]) == sorted(want["grads"])
    for k, g in want["grads"].items():
        errs[f"grad {k}"] = rel(got["grads"][k], g)
    for i, (b, w) in enumerate(zip(got["bias"], want["bias"], strict=True)):
        errs[f"bias {i}"] = float((b - w).abs().max())  # absolute, on the scores' scale: see test_balance
    for k, p in want["params"].items():
        errs[f"param {k}"] = step_rel(got["params"][k], p)
    return errs


def check_bytes(res: list, world: int, ep: int, total: int) -> None:
    """1/ep of the routed-expert bytes per rank once the experts are split, 1/world once FSDP shards
    them over efsdp too (the tiny model's expert tensors split evenly over ep and, on dim 1, over efsdp)."""
    for rank, r in enumerate(res):
        assert r["bytes"]["after ep"] * ep == total and r["bytes"]["after fsdp"] * world == total, (rank, r["bytes"])


@pytest.mark.parametrize("world, ep", [(2, 2), (4, 4)])
def test_model_matches_one_process(world, ep):
    """Every error within TOL, or within twice what regrouping the one process's own sums moves it by."""
    want = model_reference(world)
    noise = order_noise(want, model_reference(1))
    res = launch.run(run_model, world, ep, 1)
    check_bytes(res, world, ep, want["experts"])
    for rank, r in enumerate(res):
        bad = errors_above(errors(r, want), TOL, noise)
        assert not bad, f"rank {rank} of {world} (ep {ep}): errors above {TOL} (or 2x the order noise): {bad}"


def test_ep2_by_cp2_matches_one_process():
    """EP2 x CP2 in 4 processes (dp 2; each ep group is the two cp ranks of its sequences, which run
    KDA and DSA through their CP context) against one process. The residual is attnres, not mHC:
    at mHC's initial point (identical streams) its residual-scale gradients are sums with heavy
    cancellation whose fp32 value moves by ~1e-5 of its size with the order of the additions
    alone (test_fsdp), and CP2 without EP already puts them 1.4e-5 from one process here."""
    want = model_reference(2, "attnres")
    res = launch.run(run_model, 4, 2, 2, "attnres")
    check_bytes(res, 4, 2, want["experts"])
    for rank, r in enumerate(res):
        bad = {k: v for k, v in errors(r, want).items() if not v <= TOL}
        assert not bad, f"rank {rank} of 4 (ep 2, cp 2): errors above {TOL}: {bad}"


# ----------------------------------------------------------------------------- DCP checkpoints
def write_ep(rank: int, world: int, path: str) -> dict:
    """One step at EP=2, then a DCP save; the full state dict (rank 0) and the next step's loss."""
    from longctx.distributed.checkpoint import save, to_full_state_dict

    from test_checkpoint import train

    model, mesh, cfg, _ = sharded_model(world, ep=world)
    opt = optimizer(model)
    train(model, opt, [10], rank, world, mesh)
    save(path, model, opt, {"step": 1})
    full = to_full_state_dict(model)
    return {"full": full, "next": train(model, opt, [11], rank, world, mesh)}


def read_ep(rank: int, world: int, path: str) -> dict:
    from longctx.distributed.checkpoint import load, to_full_state_dict

    model, mesh, cfg, _ = sharded_model(world, ep=world)
    load(path, model)
    return {"full": to_full_state_dict(model)}


def test_checkpoint_at_ep2_loads_into_one_process_and_back(tmp_path):
    from longctx.distributed.checkpoint import load, save

    from test_checkpoint import train

    path = str(tmp_path / "ep2")
    res = launch.run(write_ep, 2, path)
    full = res[0]["full"]
    assert any(".experts.gate_up" in k for k in full) and res[1]["full"] == {}
    model = build_model()  # one plain process, every expert
    opt = optimizer(model)
    assert load(path, model, opt)["step"] == 1
    plain = model.state_dict()
    assert sorted(plain) == sorted(full)
    bad = {k: rel(plain[k], full[k]) for k in full if not torch.equal(plain[k], full[k])}
    assert not bad, f"the plain model's tensors differ from the EP run's: {bad}"
    nxt = train(model, opt, [11], 0, 1)[0]  # the optimizer state came along too
    assert abs(nxt - res[0]["next"][0]) <= TOL * abs(nxt), (nxt, res[0]["next"])

    # and back: a plain process's checkpoint into EP=2, every tensor whole again equal
    back = str(tmp_path / "plain")
    save(back, model, None)
    for got in launch.run(read_ep, 2, back)[:1]:
        assert sorted(got["full"]) == sorted(plain)
        bad = [k for k, v in model.state_dict().items() if not torch.equal(got["full"][k], v)]
        assert not bad, bad


def test_ep_settings_are_one_sentence():
    from longctx.config import preset
    from longctx.distributed import ParallelConfig
    from longctx.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^parallel.ep = 3 does not divide the 4 processes torchrun started; "
                                          r"choose one of 1, 2, 4\.$"):
        ParallelConfig(ep=3).validate(4)
    with pytest.raises(ConfigError, match=r"^parallel.ep must be a positive integer \(got 0\); set it to 1"):
        ParallelConfig(ep=0).validate()
    with pytest.raises(ConfigError, match=r"^model.n_routed_experts = 4 is not a multiple of parallel.ep = 8; "
                                          r"choose an ep that divides 4\.$"):
        ParallelConfig(ep=8).check_model(preset("tiny"))
    ParallelConfig(ep=4).check_model(preset("tiny"))
    assert ParallelConfig.from_dict({"ep": 2}).ep == 2 and ParallelConfig().ep == 1
    assert B % 4 == 0 and S % 4 == 0  # the model checks split the batch over dp and the rows over 2 x cp
