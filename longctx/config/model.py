"""The model configuration: one typed, validated, printable dataclass, and the named presets.

The per-layer mix reads as short strings, the way nanoGPT writes its window pattern:
  layer_pattern   K = Kimi Delta Attention, D = DeepSeek Sparse Attention   ("KKKD")
  mlp_pattern     d = dense SwiGLU, m = mixture of experts                    ("dmmm")
  indexer_pattern f = the DSA layer runs its indexer, s = it reuses the previous full layer's
                  selection (only read at D layers)                           ("f")
A pattern shorter than `num_layers` is tiled; it must divide `num_layers` evenly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass

from ..errors import ConfigError, did_you_mean

RESIDUALS = ("mhc", "attnres", "plain")
BALANCERS = ("quantile", "sign", "aux", "none")


@dataclass
class ModelConfig:
    # -- trunk --
    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 4
    layer_pattern: str = "KKKD"
    mlp_pattern: str = "dmmm"
    residual: str = "mhc"
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    init_std: float = 0.02
    pad_token_id: int | None = None
    # -- KDA (linear attention) --
    kda_heads: int = 2
    kda_head_dim: int = 64
    kda_conv_size: int = 4
    kda_gate_lower_bound: float | None = -5.0  # bounded decay g = lower_bound * sigmoid(.); None = softplus gate
    kda_chunk_size: int = 64
    # -- DSA (absorbed NoPE MLA + k-pool indexer) --
    attn_heads: int = 2
    q_lora_rank: int = 64
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    index_heads: int = 2
    index_head_dim: int = 32
    index_topk: int = 256
    index_pool: int = 4
    index_tail: bool = True
    indexer_pattern: str = "f"
    # -- MLP / MoE --
    intermediate_size: int = 384
    moe_intermediate_size: int = 128
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    experts_per_token: int = 2
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    balancer: str = "quantile"
    balancer_rate: float = 1e-3  # sign-step gamma
    aux_loss_coef: float = 1e-3
    # -- residual streams --
    hc_streams: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    attnres_blocks: int = 8
    # -- indexer training (DeepSeek-V3.2: KL to the attention distribution, detached from LM loss) --
    indexer_loss: bool = False
    indexer_loss_coef: float = 1.0
    indexer_loss_dense_below: int = 0  # dense KL (all causal keys) while seq_len <= this

    # ---------------------------------------------------------------- derived per-layer views
    def layer_kinds(self) -> str:
        return _tile(self.layer_pattern, self.num_layers, "layer_pattern")

    def mlp_kinds(self) -> str:
        return _tile(self.mlp_pattern, self.num_layers, "mlp_pattern")

    def indexer_kinds(self) -> str:
        return _tile(self.indexer_pattern, self.num_layers, "indexer_pattern")

    def index_width(self) -> int:
        """Indices per query: top-k tokens plus, with the tail on, up to pool-1 tail tokens."""
        return self.index_topk + (self.index_pool - 1 if self.index_tail else 0)

    # ---------------------------------------------------------------- validation
    def validate(self) -> "ModelConfig":
        _check_types(self, "model")
        pos = [
            "vocab_size", "hidden_size", "num_layers", "kda_heads", "kda_head_dim", "kda_conv_size",
            "kda_chunk_size", "attn_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "v_head_dim", "index_heads", "index_head_dim", "index_topk", "index_pool",
            "intermediate_size", "moe_intermediate_size", "n_routed_experts", "experts_per_token",
            "n_group", "topk_group", "hc_streams", "hc_sinkhorn_iters", "attnres_blocks",
        ]
        for name in pos:
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be >= 1 (got {getattr(self, name)}); set it to a positive integer.")
        if self.num_layers > 4096:
            raise ConfigError(f"model.num_layers ({self.num_layers}) is beyond any model longctx can build; use at most 4096.")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"model.{f.name} must be a finite number (got {v}).")
        for name in ("rms_norm_eps", "init_std", "hc_eps", "routed_scaling_factor", "swiglu_limit"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"model.{name} must be > 0 (got {getattr(self, name)}); set a positive number.")
        if self.n_shared_experts < 0:
            raise ConfigError(f"model.n_shared_experts must be >= 0 (got {self.n_shared_experts}).")
        for name, allowed in (("layer_pattern", "KD"), ("mlp_pattern", "dm"), ("indexer_pattern", "fs")):
            pat = getattr(self, name)
            bad = sorted(set(pat) - set(allowed))
            if not pat or bad:
                raise ConfigError(
                    f"model.{name} {pat!r} may only use the letters {' '.join(allowed)}"
                    f"{' (found ' + ' '.join(bad) + ')' if bad else ''}; for example {allowed[0] * 3 + allowed[-1]!r}."
                )
            _tile(pat, self.num_layers, name)
        if self.residual not in RESIDUALS:
            raise ConfigError(f"model.residual must be one of {', '.join(RESIDUALS)} (got {self.residual!r}){did_you_mean(self.residual, RESIDUALS)}")
        if self.balancer not in BALANCERS:
            raise ConfigError(f"model.balancer must be one of {', '.join(BALANCERS)} (got {self.balancer!r}){did_you_mean(self.balancer, BALANCERS)}")
        if self.kda_gate_lower_bound is not None and not self.kda_gate_lower_bound < 0:
            raise ConfigError(f"model.kda_gate_lower_bound must be negative (got {self.kda_gate_lower_bound}); set it to -5, the default.")
        if self.index_topk % self.index_pool:
            raise ConfigError(
                f"model.index_topk ({self.index_topk}) must be a multiple of model.index_pool ({self.index_pool}); "
                f"set index_topk to {max(self.index_pool, self.index_topk // self.index_pool * self.index_pool)}."
            )
        if self.experts_per_token > self.n_routed_experts:
            raise ConfigError(f"model.experts_per_token ({self.experts_per_token}) must be <= model.n_routed_experts ({self.n_routed_experts}).")
        if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
            raise ConfigError(f"model.n_group ({self.n_group}) must divide model.n_routed_experts and be >= model.topk_group ({self.topk_group}).")
        if self.experts_per_token > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ConfigError(
                f"model.experts_per_token ({self.experts_per_token}) exceeds the experts in the model.topk_group "
                f"({self.topk_group}) groups that routing may use; raise topk_group or lower experts_per_token."
            )
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise ConfigError("model.n_group leaves fewer than 2 experts per group; lower model.n_group.")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ConfigError(f"model.pad_token_id ({self.pad_token_id}) must be in [0, vocab_size).")
        kinds, idx = self.layer_kinds(), self.indexer_kinds()
        seen_full = False
        for i, k in enumerate(kinds):
            if k != "D":
                continue
            if idx[i] == "s" and not seen_full:
                raise ConfigError(
                    f"model.indexer_pattern makes DSA layer {i} shared ('s') but no earlier DSA layer runs the indexer; "
                    "make the first DSA layer 'f'."
                )
            seen_full |= idx[i] == "f"
        return self

    # ---------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict, where: str = "model") -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        for key in d:
            if key not in known:
                raise ConfigError(f"unknown setting {where}.{key}{did_you_mean(key, known) or '; see --print-config for the settings'}")
        return cls(**d).validate()

    def replace(self, **kw) -> "ModelConfig":
        return ModelConfig.from_dict({**self.to_dict(), **kw})

    def summary(self) -> str:
        return (
            f"{self.num_layers} layers {self.layer_kinds()} | mlp {self.mlp_kinds()} | residual {self.residual} | "
            f"hidden {self.hidden_size} | vocab {self.vocab_size}"
        )


def _tile(pattern: str, n: int, name: str) -> str:
    if not pattern or n % len(pattern):
        raise ConfigError(
            f"model.{name} has length {len(pattern)}, which does not divide model.num_layers ({n}); "
            f"give one letter per layer or a pattern whose length divides {n}."
        )
    return pattern * (n // len(pattern))


def _check_types(obj, where: str) -> None:
    """Check each dataclass field against its annotation (int, float, str, bool, Optional)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        val = getattr(obj, f.name)
        if not _is_instance(val, hints[f.name]):
            raise ConfigError(
                f"{where}.{f.name} must be {_type_name(hints[f.name])} (got {type(val).__name__} {val!r}); "
                f"set it to {'an' if _type_name(hints[f.name])[:1] in 'aeiou' else 'a'} {_type_name(hints[f.name])} value."
            )


def _is_instance(val, tp) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_is_instance(val, a) for a in typing.get_args(tp))
    if tp is type(None):
        return val is None
    if tp is bool:
        return isinstance(val, bool)
    if tp is int:
        return isinstance(val, int) and not isinstance(val, bool)
    if tp is float:
        return isinstance(val, (int, float)) and not isinstance(val, bool)
    if origin is list:
        return isinstance(val, list) and all(_is_instance(v, typing.get_args(tp)[0]) for v in val)
    if origin is dict:
        return isinstance(val, dict)
    if dataclasses.is_dataclass(tp):
        return isinstance(val, tp)
    return isinstance(val, tp)


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


# ------------------------------------------------------------------------------ presets
def _tiny() -> ModelConfig:
    return ModelConfig(
        vocab_size=97, hidden_size=32, num_layers=4, layer_pattern="KKKD", mlp_pattern="dmmm",
        kda_heads=2, kda_head_dim=8, kda_chunk_size=16, attn_heads=2, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, v_head_dim=8, index_heads=2, index_head_dim=8, index_topk=8, index_pool=4,
        intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4, experts_per_token=2,
    )


def _small() -> ModelConfig:
    # The CPU demo: byte-level, learns in minutes on 2 cores; top-k 256 < the 1k..4k curriculum so
    # the DSA layers are really sparse.
    return ModelConfig(
        vocab_size=256, hidden_size=128, num_layers=4, layer_pattern="KKKD", mlp_pattern="dmmm",
        kda_heads=2, kda_head_dim=64, attn_heads=2, q_lora_rank=64, kv_lora_rank=64,
        qk_nope_head_dim=32, v_head_dim=32, index_heads=2, index_head_dim=32, index_topk=256, index_pool=4,
        intermediate_size=384, moe_intermediate_size=128, n_routed_experts=8, experts_per_token=2,
        indexer_loss=True, indexer_loss_dense_below=1024,
    )


def _h200_ref() -> ModelConfig:
    return ModelConfig(
        vocab_size=32768, hidden_size=1536, num_layers=12, layer_pattern="KKKD", mlp_pattern="d" + "m" * 11,
        kda_heads=12, kda_head_dim=128, attn_heads=16, q_lora_rank=768, kv_lora_rank=512,
        qk_nope_head_dim=128, v_head_dim=128, index_heads=16, index_head_dim=64, index_topk=2048,
        index_pool=4, index_tail=True, intermediate_size=4096, moe_intermediate_size=768,
        n_routed_experts=32, experts_per_token=4, n_shared_experts=1, hc_streams=4,
    )


def _glm53_flash() -> ModelConfig:
    return ModelConfig(
        vocab_size=154880, hidden_size=4096, num_layers=45, layer_pattern="KKKD" * 11 + "K",
        mlp_pattern="ddd" + "m" * 42, kda_heads=64, kda_head_dim=128, attn_heads=64, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=256, v_head_dim=256, index_heads=32, index_head_dim=128,
        index_topk=2048, index_pool=4, intermediate_size=12288, moe_intermediate_size=2048,
        n_routed_experts=288, experts_per_token=8, n_shared_experts=1, pad_token_id=154820,
    )


PRESETS = {"tiny": _tiny, "small": _small, "h200-ref": _h200_ref, "glm-5.3-flash": _glm53_flash}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}{did_you_mean(name, PRESETS) or ''}; choose one of {', '.join(PRESETS)}.")
    return PRESETS[name]().validate()
