"""DSA under context parallelism, in 2 and 4 gloo processes: the zigzag-sharded layer gives this rank's
tokens of the single-process output and selection, the single-process input gradient there and
(summed over the ranks) every parameter gradient and the indexer KL, to fp32 precision.

S = 72 tokens with pools of 16 (4 complete pools and an 8-token tail) and of 5 (14 pools, a tail of 2):
spans of 18 or 9 tokens, so pools straddle rank boundaries and each pool needs another rank's keys
and gate scores. top-k 32 (16) keeps 2 pools of 16 (3 of 5) per query, so selection is really sparse
for the late queries. A second, shared ('s') layer reuses the first one's selection.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import launch
from cp_util import grads, randomize, rel, summed_grads, worst

S, B = 72, 2
TOL = 1e-5
CASES = {"pool16": dict(index_pool=16, index_topk=32), "pool5+kl": dict(index_pool=5, index_topk=15, indexer_loss=True)}


def _layers(case: str):
    from longctx.config import preset
    from longctx.layers.dsa import SparseMLA

    cfg = preset("tiny").replace(num_layers=2, layer_pattern="DD", mlp_pattern="dd", indexer_pattern="fs",
                                 index_heads=2, **CASES[case])
    full, shared = SparseMLA(cfg, 0), SparseMLA(cfg, 1)
    for i, layer in enumerate((full, shared)):
        randomize(layer, 10 + i)
        layer.kernels["sparse_attention"] = "torch"
    full.indexer.kernels["indexer"] = "torch"
    full.indexer.chunk = 7  # the query blocks of the torch selection do not line up with the rank spans
    return full, shared


def _loss(full, shared, x, w, fwd):
    """Both layers through `fwd` (the layer itself or its CP form): the weighted outputs plus the KL."""
    y0, sel = fwd(full, x, None)
    y1, _ = fwd(shared, x, sel)
    loss = (y0 * w).sum() + (y1 * w.flip(-1)).sum()
    kl = full.indexer_loss_value
    return (loss if kl is None else loss + kl), y0, y1, sel, kl


def check_dsa(rank: int, world: int) -> dict:
    from longctx.distributed import dsa_cp_forward, shard

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(3)
    out = {}
    for case in CASES:
        full, shared = _layers(case)
        x, w = torch.randn(B, S, 32, generator=g), torch.randn(B, S, 32, generator=g)

        xr = x.clone().requires_grad_()
        loss, y0, y1, sel, kl = _loss(full, shared, xr, w, lambda m, h, p: m(h, prev_selection=p))
        loss.backward()
        ref = {"x": xr.grad, **{f"full.{n}": v for n, v in grads(full).items()},
               **{f"shared.{n}": v for n, v in grads(shared).items()}}
        for m in (full, shared):
            m.zero_grad(set_to_none=True)

        xl = shard(x, world, rank).requires_grad_()
        loss_l, y0l, y1l, sell, kll = _loss(full, shared, xl, shard(w, world, rank),
                                           lambda m, h, p: dsa_cp_forward(m, h, group, prev_selection=p))
        loss_l.backward()
        got = {"x": xl.grad, **{f"full.{n}": v for n, v in summed_grads(full, group).items()},
               **{f"shared.{n}": v for n, v in summed_grads(shared, group).items()}}
        errs = {"output": rel(y0l, shard(y0, world, rank)), "shared output": rel(y1l, shard(y1, world, rank)),
                "input grad": rel(got["x"], shard(ref["x"], world, rank))}
        errs.update({f"grad {n}": rel(got[n], ref[n]) for n in ref if n != "x"})
        if kl is not None:
            errs["indexer KL"] = rel(_sum(kll, group), kl)
        same_selection = bool(torch.equal(sell, shard(sel, world, rank)))
        sparse = bool((sel >= 0).sum(-1).min() < S)  # some query attends to fewer than all tokens
        late = int((sel[:, -1] >= 0).sum(-1).min())  # tokens the last query attends to
        out[case] = (*worst(errs), same_selection, sell.dtype == torch.int32, late)
        assert sparse
    return out


def _sum(t: torch.Tensor, group) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t, group=group)
    return t


def check_bytes(rank: int, world: int) -> dict:
    from longctx.distributed import comm, dsa_cp_bytes, dsa_cp_forward, shard

    group = dist.group.WORLD
    sent = []
    real = comm.all_gather

    def gather(x, grp):
        sent.append((comm.group_size(grp) - 1) * x.numel() * x.element_size())
        return real(x, grp)

    comm.all_gather = gather
    try:
        full, shared = _layers("pool16")
        x = shard(torch.randn(B, S, 32, generator=torch.Generator().manual_seed(4)), world, rank)
        cfg = full.cfg
        with torch.no_grad():
            _, sel = dsa_cp_forward(full, x, group)
            n_full = sum(sent)
            dsa_cp_forward(shared, x, group, prev_selection=sel)
        want = [dsa_cp_bytes(seq_len=S, kv_lora=cfg.kv_lora_rank, index_head_dim=cfg.index_head_dim, cp=world, batch=B,
                             dtype_bytes=4, indexer=ix) for ix in (True, False)]
        return (n_full, sum(sent) - n_full), tuple(want)
    finally:
        comm.all_gather = real


@pytest.mark.parametrize("world", [2, 4])
def test_dsa_matches_one_process(world):
    for rank, res in enumerate(launch.run(check_dsa, world)):
        for case, (what, err, same_selection, int32, late) in res.items():
            assert same_selection and int32, f"rank {rank} {case}: the selection differs from the single-process one"
            assert err <= TOL, f"rank {rank} {case}: {what} relative error {err:.2e} > {TOL}"
            assert late < S, f"{case}: the last query attends to every token; the check would not be sparse"


@pytest.mark.parametrize("world", [2, 4])
def test_dsa_bytes_counted(world):
    for counted, computed in launch.run(check_bytes, world):
        assert counted == computed
