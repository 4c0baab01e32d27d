"""Shared by the tests of tests/memory: a tiny model with every kind of block, its batches, one
training step under a memory plan, and the comparison of two steps' loss and gradients."""

from __future__ import annotations

import torch

from longctx.config import preset
from longctx.memory.plan import MemoryPlan, apply_plan
from longctx.model import LongCtxModel

S, B = 64, 2
PLAIN = MemoryPlan.from_dict({"recompute": "off", "offload": "off"})
RECOMPUTE = MemoryPlan.from_dict({"recompute": "on", "offload": "off", "reuse_attention": False})  # full recompute: a block keeps its input


def _cfg(residual="mhc", **kw):
    # layers K, D(full indexer), D(shared selection), D(full): every kind of block and selection hand-off
    base = {"residual": residual, "num_layers": 4, "layer_pattern": "KDDD", "indexer_pattern": "ffsf", "index_topk": 16}
    return preset("tiny").replace(**{**base, **kw})


def _model(cfg, seed=0):
    torch.manual_seed(seed)
    return LongCtxModel(cfg)


def _batch(cfg, seed=1, s=S, b=B):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (b, s), generator=g),
            torch.randint(0, cfg.vocab_size, (b, s), generator=g))


def _step(model, ids, labels, plan=None, policy=None, autocast=False):
    """One forward + backward; returns (loss, {name: grad})."""
    if plan is not None:
        apply_plan(model, plan)
    if policy is not None:
        model.block_fn = policy
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(ids, labels=labels, return_logits=False)
    out.loss.backward()
    model.clear_aux()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.block_fn = None
    return out.loss.detach(), grads


def _assert_same(ref, got, rtol=1e-5, atol=1e-7):
    (l0, g0), (l1, g1) = ref, got
    torch.testing.assert_close(l1, l0, rtol=rtol, atol=atol)
    assert set(g0) == set(g1), set(g0) ^ set(g1)
    assert len(g0) > 40  # every block's parameters took part
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=rtol, atol=atol, msg=lambda m, n=n: f"{n}: {m}")


def _nbytes(t):
    return t.untyped_storage().nbytes()
