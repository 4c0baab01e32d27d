"""The parallel settings (`longctx.config.parallel`), the process group from torchrun's environment, and
the (dp, cp) device mesh.

    cfg = ParallelConfig(cp=2, kda_cp="hidden_gather")
    rank, world, device = init_distributed()          # torchrun's RANK / WORLD_SIZE / LOCAL_RANK
    mesh = build_mesh(world, cfg)                      # DeviceMesh, dims ("dp", "cp")
    group = cp_group(mesh)                             # what the CP layer functions take

The mesh is dp-major: the cp ranks of one sequence are consecutive global ranks, so on a multi-GPU
node a sequence's exchanges stay among neighbouring GPUs (NVLink) and only the once-per-step
gradient reduction crosses the dp dimension.

Expert parallelism (`parallel.ep`) splits nothing of the data: it regroups the same ranks. The
(dp, cp) ranks, flattened in that dp-major order, are unflattened into an (efsdp, ep) mesh
(`expert_mesh`): an ep group is `ep` consecutive global ranks, so the token exchanges of the MoE
layers stay among neighbouring GPUs too, and efsdp = world / ep counts the ranks holding the same
experts. Both meshes come from one root, which FSDP2 needs to shard a DTensor over efsdp that is
already sharded over ep.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config.parallel import KDA_CP_MODES, ParallelConfig  # noqa: F401 - the settings live in the config
from ..errors import ConfigError

MESH_DIMS = ("dp", "cp")
EXPERT_MESH_DIMS = ("efsdp", "ep")


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
    store = _restart_store()
    if store is not None:
        kw.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend, **kw)
    return dist.get_rank(), dist.get_world_size(), device


def _restart_store():
    """For workers torchrun has restarted (TORCHELASTIC_RESTART_COUNT > 0) on the store its agent
    serves (TORCHELASTIC_USE_AGENT_STORE): that store, under a prefix of the attempt; else None (the
    env:// store of init_process_group). The agent keeps one store for the job's whole life, so the
    restarted group would otherwise read what the failed one left there (a dead rank's gloo address,
    an old NCCL id; pytorch issue 135712). On several nodes the restart counts agree only when every
    node's workers failed; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each attempt a store of its own."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt in ("", "0"):
        return None
    from torch.distributed.constants import default_pg_timeout

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=default_pg_timeout)
    return dist.PrefixStore(f"longctx/attempt_{attempt}", store)


def build_mesh(world: int, cfg: ParallelConfig, device_type: str | None = None):
    """DeviceMesh of shape (dp, cp) named ("dp", "cp") over all `world` processes (the process group
    must be up). device_type: "cuda" under NCCL, else "cpu"."""
    from torch.distributed.device_mesh import init_device_mesh

    cfg = cfg.validate(world)
    if device_type is None:
        device_type = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (cfg.dp, cfg.cp), mesh_dim_names=MESH_DIMS)


_EXPERT_MESHES: dict = {}


def expert_mesh(mesh, ep: int):
    """The (efsdp, ep) DeviceMesh over the ranks of the (dp, cp) `mesh`: ep groups of `ep`
    consecutive global ranks. Built once per (mesh, ep), so every caller gets the same process
    groups."""
    from .fsdp import shard_mesh

    world = mesh.size()
    if ep < 1 or world % ep:
        raise ConfigError(f"parallel.ep = {ep} does not divide the {world} processes; choose one of "
                          f"{', '.join(str(d) for d in range(1, world + 1) if world % d == 0)}.")
    key = (mesh, ep)
    if key not in _EXPERT_MESHES:
        flat = shard_mesh(mesh)
        _EXPERT_MESHES[key] = flat._unflatten(0, (world // ep, ep), EXPERT_MESH_DIMS)
    return _EXPERT_MESHES[key]


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
