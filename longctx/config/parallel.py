"""The `parallel` section of the training config: how the processes torchrun starts share the work.

    [parallel]
    cp = 2                  # ranks that share one sequence (context parallel); 1 = off
    dp = 4                  # data-parallel replicas; unset = the rest of the world (world // cp)
    kda_cp = "hidden_gather"
    ep = 2                  # ranks that split each MoE layer's routed experts (expert parallel); 1 = off

The settings are checked here without a process group; `longctx.distributed.mesh` checks them
against the world size (`validate(world)`) when it builds the (dp, cp) mesh. Expert parallelism
regroups the same ranks (ep consecutive ranks split the experts, whatever their dp and cp), so ep
need only divide the world.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import ConfigError, did_you_mean

KDA_CP_MODES = ("hidden_gather", "qkv_a2a", "chunk_state")


@dataclass
class ParallelConfig:
    """cp: ranks that share one sequence (context parallel), 1 = off. dp: data-parallel replicas;
    None = the rest of the world (world // cp). kda_cp: how KDA layers run under cp > 1 —
    "hidden_gather" (gather the hidden state, each rank projects and runs its share of the heads
    over the whole sequence), "qkv_a2a" (each rank projects its own tokens, an all-to-all moves the
    projected q/k/v/gate/beta from a token split to a head split), "chunk_state" (each rank runs its
    own tokens and receives the recurrent state of the tokens before them). ep: consecutive ranks
    that split every MoE layer's routed experts among them (expert parallel), 1 = off; it must
    divide the world and the expert count."""

    cp: int | str = 1  # or "auto": the smallest cp whose memory plan fits (longctx.memory.planner.resolve_parallel)
    dp: int | None = None
    kda_cp: str = "hidden_gather"
    ep: int = 1

    @classmethod
    def from_dict(cls, d: dict | None) -> "ParallelConfig":
        """The [parallel] table of a config, validated: unknown names and values are one ConfigError each."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ConfigError(f"parallel must be a table of settings (got {type(d).__name__}); for example [parallel] cp = 2.")
        known = [f.name for f in dataclasses.fields(cls)]
        for k in d:
            if k not in known:
                raise ConfigError(f"unknown setting parallel.{k}"
                                  + (did_you_mean(f"parallel.{k}", [f"parallel.{n}" for n in known])
                                     or f"; the settings are {', '.join(known)}."))
        return cls(**d).validate()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self, world: int | None = None) -> "ParallelConfig":
        """Check the settings (against the world size when given); returns a copy with dp filled in."""
        fix = {"cp": "set it to 1 for no context parallelism, or to auto for the smallest that fits", "dp": "leave it unset to use the rest of the world",
               "ep": "set it to 1 for no expert parallelism"}
        for name in ("cp", "dp", "ep"):
            v = getattr(self, name)
            if (v is None and name == "dp") or (v == "auto" and name == "cp"):
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"parallel.{name} must be a positive integer (got {v!r}); {fix[name]}.")
        if self.kda_cp not in KDA_CP_MODES:
            raise ConfigError(f"parallel.kda_cp must be one of {', '.join(KDA_CP_MODES)} (got {self.kda_cp!r})"
                              f"{did_you_mean(str(self.kda_cp), KDA_CP_MODES) or '.'}")
        if world is None:
            return dataclasses.replace(self)
        if self.cp == "auto":
            raise ValueError("parallel.cp = auto must be resolved for the world (longctx.memory.planner.resolve_parallel) "
                             "before the mesh is built.")
        if world % self.cp:
            ok = [d for d in range(1, world + 1) if world % d == 0]
            raise ConfigError(f"parallel.cp = {self.cp} does not divide the {world} processes torchrun started; "
                              f"choose one of {', '.join(map(str, ok))}.")
        if world % self.ep:
            ok = [d for d in range(1, world + 1) if world % d == 0]
            raise ConfigError(f"parallel.ep = {self.ep} does not divide the {world} processes torchrun started; "
                              f"choose one of {', '.join(map(str, ok))}.")
        dp = world // self.cp if self.dp is None else self.dp
        if dp * self.cp != world:
            raise ConfigError(f"parallel.dp x parallel.cp = {dp} x {self.cp} = {dp * self.cp}, but torchrun started "
                              f"{world} processes; set parallel.dp to {world // self.cp} or leave it unset.")
        return dataclasses.replace(self, dp=dp)

    def check_model(self, model_cfg) -> None:
        """The model-dependent rules: the head-split KDA modes need the KDA heads to divide by cp, and
        expert parallelism the routed experts to divide by ep."""
        if self.ep > 1 and "m" in model_cfg.mlp_pattern and model_cfg.n_routed_experts % self.ep:
            raise ConfigError(f"model.n_routed_experts = {model_cfg.n_routed_experts} is not a multiple of parallel.ep = "
                              f"{self.ep}; choose an ep that divides {model_cfg.n_routed_experts}.")
        if self.cp != "auto" and self.cp > 1 and self.kda_cp in ("hidden_gather", "qkv_a2a") and model_cfg.kda_heads % self.cp:
            raise ConfigError(f"model.kda_heads = {model_cfg.kda_heads} is not a multiple of parallel.cp = {self.cp}, "
                              f"and parallel.kda_cp = {self.kda_cp} gives each rank an equal share of the heads; choose "
                              f"a cp that divides {model_cfg.kda_heads} or set parallel.kda_cp = chunk_state.")
