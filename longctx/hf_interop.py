"""Load GLM-5.3-Flash checkpoints written by transformers, and export ours back to that layout.

A checkpoint from `Glm5NextForConditionalGeneration.save_pretrained` is config.json plus
safetensors in the hub key layout (`model.language_model.layers.N...`, per-expert weights,
`hc_attn_fn`, separate q/k/v convs). Only the text model is used; vision tensors are ignored on
load and, when the model was loaded from such a directory, carried over unchanged on export.

Our own checkpoints (`longctx_config.json` + `model.safetensors` in our key layout) load through
the same `load_pretrained`.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .checkpoint import write_model_files
from .config import ModelConfig
from .errors import CheckpointError, ConfigError
from .model import LongCtxModel

HF_PREFIX = "model.language_model."
OUR_CONFIG = "longctx_config.json"

# (hub name inside a layer, our name inside a layer), both as regex fragments on the suffix.
_LAYER_RENAMES = [
    ("input_layernorm.weight", "mixer_norm.weight"),
    ("post_attention_layernorm.weight", "mlp_norm.weight"),
    ("hc_attn_fn", "mixer_res.fn"), ("hc_attn_base", "mixer_res.base"), ("hc_attn_scale", "mixer_res.scale"),
    ("hc_ffn_fn", "mlp_res.fn"), ("hc_ffn_base", "mlp_res.base"), ("hc_ffn_scale", "mlp_res.scale"),
    ("self_attn.q_conv1d.weight", "mixer.q_conv.weight"),
    ("self_attn.k_conv1d.weight", "mixer.k_conv.weight"),
    ("self_attn.v_conv1d.weight", "mixer.v_conv.weight"),
    ("self_attn.q_a_layernorm.weight", "mixer.q_a_norm.weight"),
    ("self_attn.kv_a_proj_with_mqa.weight", "mixer.kv_a_proj.weight"),
    ("self_attn.kv_a_layernorm.weight", "mixer.kv_a_norm.weight"),
    ("self_attn.indexer.index_kpool_compress_ape", "mixer.indexer.pool_ape"),
    ("self_attn.indexer.index_kpool_compress_gate", "mixer.indexer.pool_gate"),
    ("mlp.gate.weight", "mlp.router.weight"),
    ("mlp.gate.e_score_correction_bias", "mlp.router.bias"),
    ("mlp.shared_experts.", "mlp.shared."),
    ("self_attn.", "mixer."),  # everything else under self_attn keeps its name
]
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _rename_layer_key(suffix: str, to_ours: bool) -> str | None:
    for hub, ours in _LAYER_RENAMES:
        src, dst = (hub, ours) if to_ours else (ours, hub)
        if suffix.startswith(src):
            return dst + suffix[len(src):]
    plain = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
    return suffix if suffix in plain else None


# ------------------------------------------------------------------------------------ config
def config_from_hf(cfg: dict) -> ModelConfig:
    """Our ModelConfig from a GLM-5.3-Flash config.json (nested text_config or flat)."""
    t = dict(cfg.get("text_config") or cfg)
    if (lin := t.get("linear_attn_config")) is not None:
        t.setdefault("linear_head_dim", lin.get("head_dim", 128))
        t.setdefault("linear_num_heads", lin.get("num_heads", 64))
        t.setdefault("linear_conv_kernel_dim", lin.get("short_conv_kernel_size", 4))
        t.setdefault("linear_lower_bound", lin.get("gate_lower_bound", -5.0))

    def need(name, default=None):
        if name in t and t[name] is not None:
            return t[name]
        if default is not None:
            return default
        raise ConfigError(f"config.json lacks text_config.{name}; this is not a GLM-5.3-Flash config (add the field).")

    if int(t.get("qk_rope_head_dim", 0) or 0) > 0:
        raise ConfigError(
            f"config.json text_config.qk_rope_head_dim is {t['qk_rope_head_dim']}, but longctx's DSA layers are NoPE; "
            "only checkpoints with qk_rope_head_dim = 0 (GLM-5.3-Flash) can be loaded."
        )
    if t.get("q_lora_rank") is None:
        raise ConfigError("config.json text_config.q_lora_rank is null; DSA layers need a q LoRA rank.")
    if t.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json text_config.hidden_act is {t['hidden_act']!r}; only 'silu' is supported.")
    if t.get("attention_bias", False):
        raise ConfigError("config.json text_config.attention_bias is true; longctx's MLA has no biases.")
    heads = need("num_attention_heads", 64)
    if t.get("num_key_value_heads", heads) != heads:
        raise ConfigError("config.json text_config.num_key_value_heads must equal num_attention_heads for MLA.")
    n = need("num_hidden_layers", 45)

    def pattern(field, mapping, default):
        vals = t.get(field) or default
        if len(vals) != n:
            raise ConfigError(f"config.json text_config.{field} has {len(vals)} entries for {n} layers; give one per layer.")
        out = []
        for i, v in enumerate(vals):
            if v not in mapping:
                raise ConfigError(
                    f"config.json text_config.{field}[{i}] is {v!r}, which longctx cannot represent; "
                    f"use one of {', '.join(sorted(mapping))}."
                )
            out.append(mapping[v])
        return "".join(out)

    layer_types = pattern("layer_types", {"linear_attention": "K", "indexed_attention": "D", "full_attention": "D"},
                          ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)])
    mlp_types = pattern("mlp_layer_types", {"dense": "d", "sparse": "m"},
                        ["dense"] * min(3, n) + ["sparse"] * max(0, n - 3))
    indexer_types = pattern("indexer_types", {"full": "f", "shared": "s"}, ["full"] * n)
    lower = t.get("linear_lower_bound", -5.0)
    return ModelConfig(
        vocab_size=need("vocab_size"), hidden_size=need("hidden_size"), num_layers=n,
        layer_pattern=layer_types, mlp_pattern=mlp_types, indexer_pattern=indexer_types, residual="mhc",
        rms_norm_eps=float(need("rms_norm_eps", 1e-5)), tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
        init_std=float(t.get("initializer_range", 0.02)), pad_token_id=t.get("pad_token_id"),
        kda_heads=need("linear_num_heads", 64), kda_head_dim=need("linear_head_dim", 128),
        kda_conv_size=need("linear_conv_kernel_dim", 4), kda_gate_lower_bound=None if lower is None else float(lower),
        attn_heads=heads, q_lora_rank=need("q_lora_rank"), kv_lora_rank=need("kv_lora_rank", 512),
        qk_nope_head_dim=need("qk_nope_head_dim", 256), v_head_dim=need("v_head_dim", 256),
        index_heads=need("index_n_heads", 32), index_head_dim=need("index_head_dim", 128),
        index_topk=need("index_topk", 2048), index_pool=need("index_kpool", 16),
        index_tail=bool(t.get("index_kpool_always_select_tail", True)),
        intermediate_size=need("intermediate_size", 12288), moe_intermediate_size=need("moe_intermediate_size", 2048),
        n_routed_experts=need("n_routed_experts", 288), n_shared_experts=int(t.get("n_shared_experts", 1)),
        experts_per_token=need("num_experts_per_tok", 8), n_group=int(t.get("n_group", 1) or 1),
        topk_group=int(t.get("topk_group", 1) or 1), routed_scaling_factor=float(t.get("routed_scaling_factor", 2.5)),
        norm_topk_prob=bool(t.get("norm_topk_prob", True)), swiglu_limit=float(t.get("swiglu_limit", 10.0)),
        hc_streams=int(t.get("hc_mult", 4)), hc_sinkhorn_iters=int(t.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(t.get("hc_eps", 1e-6)), balancer="quantile", indexer_loss=False,
    ).validate()


def config_to_hf(cfg: ModelConfig) -> dict:
    if cfg.residual != "mhc":
        raise ConfigError(f"model.residual is {cfg.residual!r}; only mHC models can be exported to the GLM-5.3-Flash layout.")
    kinds = {"K": "linear_attention", "D": "indexed_attention"}
    return {
        "model_type": "glm5_next_text", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "layer_types": [kinds[k] for k in cfg.layer_kinds()],
        "mlp_layer_types": ["dense" if k == "d" else "sparse" for k in cfg.mlp_kinds()],
        "indexer_types": ["full" if k == "f" else "shared" for k in cfg.indexer_kinds()],
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.init_std, "pad_token_id": cfg.pad_token_id,
        "linear_num_heads": cfg.kda_heads, "linear_head_dim": cfg.kda_head_dim,
        "linear_conv_kernel_dim": cfg.kda_conv_size, "linear_lower_bound": cfg.kda_gate_lower_bound,
        "num_attention_heads": cfg.attn_heads, "num_key_value_heads": cfg.attn_heads,
        "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": 0, "v_head_dim": cfg.v_head_dim, "index_n_heads": cfg.index_heads,
        "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk, "index_kpool": cfg.index_pool,
        "index_kpool_always_select_tail": cfg.index_tail, "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size, "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts, "num_experts_per_tok": cfg.experts_per_token,
        "n_group": cfg.n_group, "topk_group": cfg.topk_group, "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": cfg.norm_topk_prob, "swiglu_limit": cfg.swiglu_limit, "hc_mult": cfg.hc_streams,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps, "hidden_act": "silu",
        "attention_bias": False,
    }


# ------------------------------------------------------------------------------ state dicts
def state_dict_from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig, origin: dict | None = None) -> tuple[dict, list[str]]:
    """Hub keys -> our keys. Returns (state dict, unexpected hub keys); `origin` collects our key -> hub key."""
    out, unexpected, experts = {}, [], {}
    origin = {} if origin is None else origin
    for key, t in hf.items():
        if key == "lm_head.weight":
            out["lm_head.weight"] = t
            continue
        if not key.startswith(HF_PREFIX):
            unexpected.append(key)
            continue
        k = key[len(HF_PREFIX):]
        if k in ("embed_tokens.weight", "norm.weight"):
            out["embed.weight" if k.startswith("embed") else "norm.weight"] = t
            continue
        m = re.match(r"layers\.(\d+)\.(.*)$", k)
        if not m:
            unexpected.append(key)
            continue
        i, suffix = int(m.group(1)), m.group(2)
        if (e := _EXPERT.match(suffix)) is not None:
            experts.setdefault((i, int(e.group(1))), {})[e.group(2)] = t
            continue
        ours = _rename_layer_key(suffix, to_ours=True)
        if ours is None:
            unexpected.append(key)
            continue
        out[f"layers.{i}.{ours}"] = t
        origin[f"layers.{i}.{ours}"] = key
    by_layer: dict[int, dict[int, dict]] = {}
    for (i, j), parts in experts.items():
        by_layer.setdefault(i, {})[j] = parts
    for i, per in by_layer.items():
        n = max(per) + 1
        try:
            out[f"layers.{i}.mlp.experts.gate_up"] = torch.stack(
                [torch.cat([per[j]["gate_proj"], per[j]["up_proj"]], 0) for j in range(n)])
            out[f"layers.{i}.mlp.experts.down"] = torch.stack([per[j]["down_proj"] for j in range(n)])
        except KeyError as exc:
            raise CheckpointError(
                f"checkpoint layer {i} is missing expert tensor {exc.args[0]!r} for some expert; "
                "the safetensors files are incomplete — re-save the checkpoint."
            ) from None
    return out, unexpected


def state_dict_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {}
    for k, t in sd.items():
        if k == "lm_head.weight":
            out[k] = t
        elif k in ("embed.weight", "norm.weight"):
            out[HF_PREFIX + ("embed_tokens.weight" if k == "embed.weight" else "norm.weight")] = t
        else:
            m = re.match(r"layers\.(\d+)\.(.*)$", k)
            i, suffix = int(m.group(1)), m.group(2)
            if suffix == "mlp.experts.gate_up":
                inter = t.shape[1] // 2
                for j in range(t.shape[0]):
                    out[f"{HF_PREFIX}layers.{i}.mlp.experts.{j}.gate_proj.weight"] = t[j, :inter]
                    out[f"{HF_PREFIX}layers.{i}.mlp.experts.{j}.up_proj.weight"] = t[j, inter:]
            elif suffix == "mlp.experts.down":
                for j in range(t.shape[0]):
                    out[f"{HF_PREFIX}layers.{i}.mlp.experts.{j}.down_proj.weight"] = t[j]
            else:
                hub = _rename_layer_key(suffix, to_ours=False)
                if hub is None:
                    raise CheckpointError(f"model tensor {k!r} has no GLM-5.3-Flash equivalent; it cannot be exported.")
                out[f"{HF_PREFIX}layers.{i}.{hub}"] = t
    return {k: v.contiguous() for k, v in out.items()}


# ------------------------------------------------------------------------------ files
def _read_safetensors(path: str, skip=lambda k: False) -> dict[str, torch.Tensor]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors files in {path!r}; point load_pretrained at a checkpoint directory.")
    out = {}
    for name in files:
        try:
            with safe_open(os.path.join(path, name), "pt") as f:
                for k in f.keys():
                    if not skip(k):
                        out[k] = f.get_tensor(k)
        except CheckpointError:
            raise
        except Exception as exc:  # corrupt or truncated file
            raise CheckpointError(f"checkpoint file {os.path.join(path, name)!r} cannot be read ({exc}); it is corrupt — re-save it.") from None
    return out


def _is_vision(k: str) -> bool:
    return k.startswith(("model.visual.", "visual.", "model.vision"))


def hub_name(key: str) -> str:
    """Our state-dict key -> its name in the GLM-5.3-Flash hub layout (for messages)."""
    if key in ("embed.weight", "norm.weight"):
        return HF_PREFIX + ("embed_tokens.weight" if key == "embed.weight" else "norm.weight")
    m = re.match(r"layers\.(\d+)\.(.*)$", key)
    if not m:
        return key
    if m.group(2).startswith("mlp.experts."):
        return f"{HF_PREFIX}layers.{m.group(1)}.mlp.experts.*"
    hub = _rename_layer_key(m.group(2), to_ours=False)
    return f"{HF_PREFIX}layers.{m.group(1)}.{hub}" if hub else key


def _check_keys(model: LongCtxModel, sd: dict, unexpected: list[str], path: str, origin: dict | None = None):
    expected = set(model.state_dict())
    if model.cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    name = (lambda k: hub_name(k)) if origin is not None else (lambda k: k)
    missing = sorted(name(k) for k in expected - set(sd))
    unexpected = sorted(set(unexpected) | {(origin or {}).get(k, k) for k in set(sd) - expected})
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s): {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}")
        raise CheckpointError(f"checkpoint {path!r} does not match its config: {'; '.join(parts)}.")
    for k, t in model.state_dict().items():
        if k in sd and tuple(sd[k].shape) != tuple(t.shape):
            raise CheckpointError(
                f"checkpoint {path!r} tensor {k!r} has shape {tuple(sd[k].shape)} but the config gives {tuple(t.shape)}; "
                "the config and the weights disagree.")


def load_pretrained(path: str, device=None, dtype: torch.dtype | None = None) -> LongCtxModel:
    """A GLM-5.3-Flash directory (transformers layout) or a longctx checkpoint -> LongCtxModel."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint path {path!r} is not a directory; pass the folder holding config.json and the .safetensors files.")
    if os.path.exists(os.path.join(path, OUR_CONFIG)):
        with open(os.path.join(path, OUR_CONFIG)) as f:
            cfg = ModelConfig.from_dict(json.load(f))
        sd, unexpected = _read_safetensors(path), []
        hf_source, origin = None, None
    else:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.exists(cfg_path):
            raise CheckpointError(f"{path!r} has neither {OUR_CONFIG} nor config.json; it is not a checkpoint directory.")
        with open(cfg_path) as f:
            hf_cfg = json.load(f)
        mt = hf_cfg.get("model_type")
        if mt not in ("glm5_next", "glm5_next_text", None):
            raise ConfigError(f"config.json model_type is {mt!r}; longctx loads GLM-5.3-Flash ('glm5_next') checkpoints.")
        cfg = config_from_hf(hf_cfg)
        raw = _read_safetensors(path, skip=_is_vision)
        # Multi-token-prediction layers (index >= num_layers) are not part of the trunk.
        raw = {k: v for k, v in raw.items()
               if not ((m := re.match(r"model\.language_model\.layers\.(\d+)\.", k)) and int(m.group(1)) >= cfg.num_layers)}
        origin = {}
        sd, unexpected = state_dict_from_hf(raw, cfg, origin)
        hf_source = path
    with torch.device("meta"):
        model = LongCtxModel(cfg)
    _check_keys(model, sd, unexpected, path, origin)
    model = model.to_empty(device=device or "cpu")
    missing, unexp = model.load_state_dict(sd, strict=False, assign=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.hf_source = hf_source
    if dtype is not None:
        model.to(dtype)
    return model


def save_checkpoint_dir(model: LongCtxModel, path: str):
    """Our own checkpoint layout (weights only), written atomically: temp dir, then rename."""
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write_model_files(model, tmp)
    _replace_dir(tmp, path)


def export_hf(model: LongCtxModel, path: str, vision_from: str | None = None):
    """Write `model` in the GLM-5.3-Flash hub layout so `Glm5NextForConditionalGeneration.from_pretrained`
    loads it. Vision tensors and config are copied from `vision_from` (default: the directory the model
    was loaded from, if any); without one, a minimal vision config is written and transformers
    initialises the (unused) vision tower itself."""
    vision_from = vision_from or getattr(model, "hf_source", None)
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    hf = state_dict_to_hf(sd, model.cfg)
    config = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
              "text_config": config_to_hf(model.cfg), "tie_word_embeddings": model.cfg.tie_word_embeddings}
    if vision_from:
        with open(os.path.join(vision_from, "config.json")) as f:
            src = json.load(f)
        for k, v in src.items():
            if k not in ("text_config", "architectures", "model_type", "tie_word_embeddings"):
                config[k] = v
        hf.update(_read_safetensors(vision_from, skip=lambda k: not _is_vision(k)))
    else:
        config["vision_config"] = {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 32,
                                   "out_hidden_size": model.cfg.hidden_size, "projection_intermediate_size": 32}
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(hf, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    _replace_dir(tmp, path)


def _replace_dir(tmp: str, path: str):
    if os.path.exists(path):
        old = path.rstrip("/") + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)
