"""KDA under context parallelism, in 2 and 4 gloo processes: each mode and layout gives this rank's
tokens of the single-process layer's output, the single-process input gradient at those tokens, and
(summed over the ranks) every parameter gradient, to fp32 precision; and the bytes each mode sends
are what `kda_cp_bytes` says, and for GLM-5.3-Flash's shapes hidden_gather sends at most a quarter
of what qkv_a2a sends into the layer.

Shapes: S = 72 tokens (not a multiple of the KDA chunk of 16; spans of 18 or 9 tokens, so chunks,
the conv window and the packed documents all straddle rank boundaries), 4 heads of 8, hidden 32.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import launch
from cp_util import grads, randomize, rel, summed_grads, worst

S, B = 72, 2
DOCS = [0, 13, 36, 50, 72]  # inside spans, on a span boundary (36), and a short one
TOL = 1e-5
MODES = ("hidden_gather", "qkv_a2a", "chunk_state")
LAYOUTS = ("zigzag", "contiguous")


def _layer(seed: int = 0):
    from longctx.config import preset
    from longctx.layers.kda import KimiDeltaAttention

    cfg = preset("tiny").replace(kda_heads=4, kda_head_dim=8, kda_chunk_size=16)
    layer = KimiDeltaAttention(cfg, 0)
    randomize(layer, seed)
    layer.kernels["kda"] = "torch"
    return layer


def _reference(layer, x, w, cu):
    xr = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = layer(xr, cu_seqlens=cu)
    (y * w).sum().backward()
    return y.detach(), xr.grad, grads(layer)


def check_modes(rank: int, world: int, cp: int) -> dict:
    """Every mode x layout x (unpacked B=2, packed B=1), on the cp groups of a (world/cp, cp) mesh."""
    from longctx.distributed import ParallelConfig, build_mesh, cp_group, cp_rank, kda_cp_forward, shard

    mesh = build_mesh(world, ParallelConfig(cp=cp))
    group, r = cp_group(mesh), cp_rank(mesh)
    layer = _layer()
    g = torch.Generator().manual_seed(1)
    out = {}
    for packed in (False, True):
        b = 1 if packed else B
        x, w = torch.randn(b, S, 32, generator=g), torch.randn(b, S, 32, generator=g)
        cu = torch.tensor(DOCS) if packed else None
        y, gx, gp = _reference(layer, x, w, cu)
        for mode in MODES:
            for layout in LAYOUTS:
                layer.zero_grad(set_to_none=True)
                xl = shard(x, cp, r, layout=layout).requires_grad_()
                yl = kda_cp_forward(layer, xl, group, mode=mode, layout=layout, cu_seqlens=cu)
                (yl * shard(w, cp, r, layout=layout)).sum().backward()
                errs = {"output": rel(yl, shard(y, cp, r, layout=layout)), "input grad": rel(xl.grad, shard(gx, cp, r, layout=layout))}
                sg = summed_grads(layer, group)
                errs.update({f"grad {n}": rel(sg[n], gp[n]) for n in gp})
                out[(mode, layout, "packed" if packed else "unpacked")] = worst(errs)
    return out


def check_bytes(rank: int, world: int) -> dict:
    """The bytes each mode hands to the collectives in one forward, against kda_cp_bytes."""
    from longctx.distributed import comm, kda_cp_bytes, kda_cp_forward, shard

    group = dist.group.WORLD
    sent = []
    real_gather, real_a2a = comm.all_gather, comm.all_to_all

    def gather(x, grp):
        sent.append((comm.group_size(grp) - 1) * x.numel() * x.element_size())
        return real_gather(x, grp)

    def a2a(x, grp):
        n = comm.group_size(grp)
        sent.append((n - 1) * x.numel() * x.element_size() // n)
        return real_a2a(x, grp)

    comm.all_gather, comm.all_to_all = gather, a2a
    try:
        layer = _layer()
        x = torch.randn(B, S, 32, generator=torch.Generator().manual_seed(2))
        out = {}
        for mode in MODES:
            for layout in LAYOUTS:
                sent.clear()
                with torch.no_grad():
                    kda_cp_forward(layer, shard(x, world, rank, layout=layout), group, mode=mode, layout=layout)
                want = kda_cp_bytes(mode, seq_len=S, hidden=32, heads=4, head_dim=8, cp=world, batch=B, conv_size=4,
                                    dtype_bytes=4, state_bytes=4, layout=layout)["total"]
                out[(mode, layout)] = (sum(sent), want)
        return out
    finally:
        comm.all_gather, comm.all_to_all = real_gather, real_a2a


@pytest.mark.parametrize("world", [2, 4])
def test_kda_modes_match_one_process(world):
    results = launch.run(check_modes, world, world)
    if world == 4:  # the same checks on the cp groups of a dp2 x cp2 mesh
        results += launch.run(check_modes, world, 2)
    bad = {(i, k): v for i, res in enumerate(results) for k, v in res.items() if not v[1] <= TOL}
    assert not bad, f"worst relative errors above {TOL} (rank, case): {bad}"


@pytest.mark.parametrize("world", [2, 4])
def test_kda_bytes_counted(world):
    for rank, res in enumerate(launch.run(check_bytes, world)):
        for case, (counted, computed) in res.items():
            assert counted == computed, f"rank {rank} {case}: the collectives got {counted} bytes, kda_cp_bytes says {computed}"


def test_hidden_gather_sends_a_quarter_of_qkv_a2a_for_glm_shapes():
    from longctx.config import preset
    from longctx.distributed import kda_cp_bytes

    cfg = preset("glm-5.3-flash")
    shapes = dict(seq_len=1 << 20, hidden=cfg.hidden_size, heads=cfg.kda_heads, head_dim=cfg.kda_head_dim, cp=2,
                  conv_size=cfg.kda_conv_size, dtype_bytes=2)
    hg, qkv = kda_cp_bytes("hidden_gather", **shapes), kda_cp_bytes("qkv_a2a", **shapes)
    # into the layer: the gathered hidden state (4096 per token) against q, k, v, gate input and beta
    # of the other rank's 32 heads (32 * 513 = 16416 per token, for half the tokens)
    assert hg["inbound"] <= qkv["inbound"] / 4, (hg, qkv)
    # the return to the token owners is the same all-to-all in both modes
    assert hg["outbound"] == qkv["outbound"]
    cs = kda_cp_bytes("chunk_state", **shapes)
    assert cs["total"] < hg["total"] / 100  # O(H K (K+V)) per span, whatever the length
