"""The parallel settings, the process group from torchrun's environment, and the (dp, cp) device mesh.

    cfg = ParallelConfig(cp=2, kda_cp="hidden_gather")
    rank, world, device = init_distributed()          # torchrun's RANK / WORLD_SIZE / LOCAL_RANK
    mesh = build_mesh(world, cfg)                      # DeviceMesh, dims ("dp", "cp")
    group = cp_group(mesh)                             # what the CP layer functions take

The mesh is dp-major: the cp ranks of one sequence are consecutive global ranks, so on a multi-GPU
node a sequence's exchanges stay among neighbouring GPUs (NVLink) and only the once-per-step
gradient reduction crosses the dp dimension.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

KDA_CP_MODES = ("hidden_gather", "qkv_a2a", "chunk_state")
MESH_DIMS = ("dp", "cp")


def _error(msg: str):
    from ..errors import ConfigError

    return ConfigError(msg)


@dataclass
class ParallelConfig:
    """cp: ranks that share one sequence (context parallel), 1 = off. dp: data-parallel replicas;
    None = the rest of the world (world // cp). kda_cp: how KDA layers run under cp > 1 —
    "hidden_gather" (gather the hidden state, each rank projects and runs its share of the heads
    over the whole sequence), "qkv_a2a" (each rank projects its own tokens, an all-to-all moves the
    projected q/k/v/gate/beta from a token split to a head split), "chunk_state" (each rank runs its
    own tokens and receives the recurrent state of the tokens before them)."""

    cp: int = 1
    dp: int | None = None
    kda_cp: str = "hidden_gather"

    def validate(self, world: int | None = None) -> "ParallelConfig":
        """Check the settings (against the world size when given); returns a copy with dp filled in."""
        for name in ("cp", "dp"):
            v = getattr(self, name)
            if v is None and name == "dp":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise _error(f"parallel.{name} must be a positive integer (got {v!r}); "
                             f"{'set it to 1 for no context parallelism' if name == 'cp' else 'leave it unset to use the rest of the world'}.")
        if self.kda_cp not in KDA_CP_MODES:
            from ..errors import did_you_mean

            raise _error(f"parallel.kda_cp must be one of {', '.join(KDA_CP_MODES)} (got {self.kda_cp!r})"
                         f"{did_you_mean(str(self.kda_cp), KDA_CP_MODES)}.")
        if world is None:
            return dataclasses.replace(self)
        if world % self.cp:
            ok = [d for d in range(1, world + 1) if world % d == 0]
            raise _error(f"parallel.cp = {self.cp} does not divide the {world} processes torchrun started; "
                         f"choose one of {', '.join(map(str, ok))}.")
        dp = world // self.cp if self.dp is None else self.dp
        if dp * self.cp != world:
            raise _error(f"parallel.dp x parallel.cp = {dp} x {self.cp} = {dp * self.cp}, but torchrun started {world} "
                         f"processes; set parallel.dp to {world // self.cp} or leave it unset.")
        return dataclasses.replace(self, dp=dp)

    def check_model(self, model_cfg) -> None:
        """The model-dependent rules: the head-split KDA modes need the KDA heads to divide by cp."""
        if self.cp > 1 and self.kda_cp in ("hidden_gather", "qkv_a2a") and model_cfg.kda_heads % self.cp:
            raise _error(f"model.kda_heads = {model_cfg.kda_heads} is not a multiple of parallel.cp = {self.cp}, and "
                         f"parallel.kda_cp = {self.kda_cp} gives each rank an equal share of the heads; choose a cp "
                         f"that divides {model_cfg.kda_heads} or set parallel.kda_cp = chunk_state.")


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
