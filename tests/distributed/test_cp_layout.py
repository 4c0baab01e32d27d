"""The parallel settings, the (dp, cp) mesh, and zigzag / contiguous sharding of a sequence."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import launch
from longctx.distributed import ParallelConfig, check_seq_len, positions, segments, shard
from longctx.errors import ConfigError


# ------------------------------------------------------------------------------ settings (one process)
def test_parallel_config_defaults_and_dp():
    assert ParallelConfig().validate(8).dp == 8
    assert ParallelConfig(cp=2).validate(8).dp == 4
    assert ParallelConfig(cp=2, dp=4, kda_cp="chunk_state").validate(8).kda_cp == "chunk_state"


@pytest.mark.parametrize("kw, world, words", [
    (dict(cp=0), 4, "parallel.cp must be a positive integer"),
    (dict(cp=3), 4, "does not divide the 4 processes"),
    (dict(cp=2, dp=4), 4, "set parallel.dp to 2"),
    (dict(kda_cp="hidden_gathr"), 4, "did you mean hidden_gather"),
    (dict(dp=0), 4, "parallel.dp must be a positive integer"),
])
def test_parallel_config_errors(kw, world, words):
    with pytest.raises(ConfigError, match=words):
        ParallelConfig(**kw).validate(world)


def test_head_split_needs_heads_divisible_by_cp():
    from longctx.config import preset

    cfg = preset("tiny").replace(kda_heads=6)
    ParallelConfig(cp=3).check_model(cfg)
    ParallelConfig(cp=4, kda_cp="chunk_state").check_model(cfg)
    with pytest.raises(ConfigError, match="kda_heads = 6 is not a multiple of parallel.cp = 4"):
        ParallelConfig(cp=4).check_model(cfg)


def test_sequence_length_rule():
    check_seq_len(72, 4)
    check_seq_len(6, 3, "contiguous")
    with pytest.raises(ConfigError, match="multiple of 8, e.g. 64 or 72"):
        check_seq_len(70, 4)
    with pytest.raises(ConfigError, match="multiple of 4, e.g. 4"):
        check_seq_len(3, 2)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_segments_cover_the_sequence_once(cp, layout):
    S = 24 * cp
    every = torch.cat([positions(S, cp, r, layout) for r in range(cp)])
    assert torch.equal(every.sort().values, torch.arange(S))
    x = torch.arange(S).view(1, S)
    for r in range(cp):
        assert torch.equal(shard(x, cp, r, layout=layout)[0], positions(S, cp, r, layout))
    if layout == "zigzag":  # one early and one late chunk: rank r holds chunks r and 2cp-1-r
        c = S // (2 * cp)
        assert segments(S, cp, 0, layout) == ((0, c), (S - c, S))


# ------------------------------------------------------------------------------ in gloo processes
def check_round_trip(rank: int, world: int) -> dict:
    from longctx.distributed import unshard

    out = {}
    for layout in ("zigzag", "contiguous"):
        S = 8 * world + 2 * world  # not a multiple of anything but 2*cp
        x = torch.randn(3, S, 5, generator=torch.Generator().manual_seed(7))
        w = torch.randn(3, S, 5, generator=torch.Generator().manual_seed(8))
        xl = shard(x, world, rank, layout=layout).requires_grad_()
        full = unshard(xl, dist.group.WORLD, layout=layout)
        (full * w).sum().backward()  # every rank's loss sends each token its w: world * w in all
        out[layout] = (bool(torch.equal(full, x)), bool(torch.allclose(xl.grad, world * shard(w, world, rank, layout=layout))))
        # along another dimension: [S, B, D]
        full_t = unshard(shard(x.transpose(0, 1), world, rank, dim=0, layout=layout), dist.group.WORLD, dim=0, layout=layout)
        out[layout + " dim0"] = (bool(torch.equal(full_t, x.transpose(0, 1))), True)
    return out


def check_mesh(rank: int, world: int) -> tuple:
    from longctx.distributed import build_mesh, cp_context, cp_group, cp_rank, cp_size, dp_rank

    cfg = ParallelConfig(cp=2, kda_cp="qkv_a2a")
    mesh = build_mesh(world, cfg)
    mates = [torch.zeros(1, dtype=torch.long) for _ in range(2)]
    dist.all_gather(mates, torch.tensor([rank]), group=cp_group(mesh))
    ctx = cp_context(mesh, cfg)
    assert (ctx.size, ctx.rank, ctx.kda_cp, ctx.layout) == (2, cp_rank(mesh), "qkv_a2a", "zigzag")
    assert cp_context(build_mesh(world, ParallelConfig()), ParallelConfig()) is None
    return tuple(mesh.mesh.shape), cp_size(mesh), cp_rank(mesh), dp_rank(mesh), [int(m) for m in mates]


@pytest.mark.parametrize("world", [2, 4])
def test_shard_unshard_round_trip(world):
    for rank, res in enumerate(launch.run(check_round_trip, world)):
        for layout, (same, grad_ok) in res.items():
            assert same and grad_ok, f"rank {rank} {layout}: round trip {same}, gradient {grad_ok}"


@pytest.mark.parametrize("world", [2, 4])
def test_mesh_is_dp_major(world):
    for rank, (shape, size, r, d, mates) in enumerate(launch.run(check_mesh, world)):
        assert shape == (world // 2, 2) and size == 2
        assert (d, r) == divmod(rank, 2)  # cp ranks of one sequence are neighbours
        assert mates == [rank - r, rank - r + 1]
