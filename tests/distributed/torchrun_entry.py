"""What `torchrun --standalone --nproc-per-node N` runs in test_cp_torchrun.py: join the group from
torchrun's environment, build the (dp, cp) mesh, run one KDA layer in hidden_gather mode on the cp
group and print this rank's worst relative error against the single-process layer."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cp_util import grads, randomize, rel, summed_grads  # noqa: E402


def main() -> None:
    from longctx.config import preset
    from longctx.distributed import ParallelConfig, build_mesh, cp_group, cp_rank, init_distributed, kda_cp_forward, shard
    from longctx.layers.kda import KimiDeltaAttention

    torch.set_num_threads(1)
    rank, world, device = init_distributed()
    cfg = ParallelConfig(cp=int(os.environ.get("CP", world))).validate(world)
    mesh = build_mesh(world, cfg)
    group, r = cp_group(mesh), cp_rank(mesh)
    layer = KimiDeltaAttention(preset("tiny").replace(kda_heads=4, kda_head_dim=8, kda_chunk_size=16), 0)
    randomize(layer, 0)
    x, w = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(5)).unbind(0)
    x, w = x[None], w[None]
    xr = x.clone().requires_grad_()
    (layer(xr) * w).sum().backward()
    ref, gx = grads(layer), xr.grad
    layer.zero_grad(set_to_none=True)
    xl = shard(x, cfg.cp, r).requires_grad_()
    y = kda_cp_forward(layer, xl, group, mode=cfg.kda_cp)
    (y * shard(w, cfg.cp, r)).sum().backward()
    got = summed_grads(layer, group)
    err = max([rel(xl.grad, shard(gx, cfg.cp, r))] + [rel(got[n], ref[n]) for n in ref])
    print(f"rank {rank} of {world} backend {dist.get_backend()} mesh {tuple(mesh.mesh.shape)} device {device} "
          f"worst {err:.3e}", flush=True)
    dist.barrier()  # both ranks done before either tears gloo down: a peer leaving mid-teardown can abort the other
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
