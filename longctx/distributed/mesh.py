"""The parallel settings (`longctx.config.parallel`), the process group from torchrun's environment, and
the (dp, cp) device mesh.

    cfg = ParallelConfig(cp=2, kda_cp="hidden_gather")
    rank, world, device = init_distributed()          # torchrun's RANK / WORLD_SIZE / LOCAL_RANK
    mesh = build_mesh(world, cfg)                      # DeviceMesh, dims ("dp", "cp")
    group = cp_group(mesh)                             # what the CP layer functions take

The mesh is dp-major: the cp ranks of one sequence are consecutive global ranks, so on a multi-GPU
node a sequence's exchanges stay among neighbouring GPUs (NVLink) and only the once-per-step
gradient reduction crosses the dp dimension.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config.parallel import KDA_CP_MODES, ParallelConfig  # noqa: F401 - the settings live in the config

MESH_DIMS = ("dp", "cp")


def init_distributed(backend: str | None = None) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT);
    NCCL when CUDA is present, gloo otherwise. Returns (rank, world, this process's device).
    Without torchrun's environment (a plain `python -m longctx`) it starts nothing: (0, 1, device)."""
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return 0, 1, device
    if not dist.is_available():
        raise RuntimeError("torchrun started several processes but this torch build has no torch.distributed")
    backend = backend or ("nccl" if cuda else "gloo")
    kw = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, **kw)
    return dist.get_rank(), dist.get_world_size(), device


def build_mesh(world: int, cfg: ParallelConfig, device_type: str | None = None):
    """DeviceMesh of shape (dp, cp) named ("dp", "cp") over all `world` processes (the process group
    must be up). device_type: "cuda" under NCCL, else "cpu"."""
    from torch.distributed.device_mesh import init_device_mesh

    cfg = cfg.validate(world)
    if device_type is None:
        device_type = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (cfg.dp, cfg.cp), mesh_dim_names=MESH_DIMS)


@dataclass
class CPContext:
    """What a layer needs to run under context parallelism: its cp group, this rank's place in it,
    the KDA mode and the layout of the tokens between layers (a layer holding one runs its CP form)."""

    group: object
    size: int
    rank: int
    kda_cp: str = "hidden_gather"
    layout: str = "zigzag"

    # What a layer's forward calls when its `cp` holds this context (the layers sit below
    # longctx.distributed, so they receive the context object rather than importing these functions).
    def kda(self, layer, x, cu_seqlens=None):
        from .kda_cp import kda_cp_forward

        return kda_cp_forward(layer, x, self.group, self.kda_cp, self.layout, cu_seqlens)

    def dsa(self, layer, x, prev_selection=None, forced_selection=None):
        from .dsa_cp import dsa_cp_forward

        return dsa_cp_forward(layer, x, self.group, prev_selection, forced_selection, self.layout)


def cp_context(mesh, cfg: ParallelConfig) -> CPContext | None:
    """The CPContext of this rank on `mesh`, or None without context parallelism (cp == 1)."""
    if cfg.cp == 1:
        return None
    return CPContext(group=cp_group(mesh), size=cp_size(mesh), rank=cp_rank(mesh), kda_cp=cfg.kda_cp)


def cp_group(mesh):
    """The process group of this rank's cp ranks (the ranks sharing its sequences)."""
    return mesh.get_group("cp")


def dp_group(mesh):
    return mesh.get_group("dp")


def cp_rank(mesh) -> int:
    """This rank's place among its cp ranks (which tokens of the sequence it holds)."""
    return mesh.get_local_rank("cp")


def cp_size(mesh) -> int:
    return mesh.size(mesh.mesh_dim_names.index("cp"))


def dp_rank(mesh) -> int:
    return mesh.get_local_rank("dp")
