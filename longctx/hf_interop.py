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
import tempfile

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
# transformers' Glm5NextTextConfig defaults: the value a text-config field has when config.json leaves it out.
HF_TEXT_DEFAULTS = {
    "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_hidden_layers": 45, "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
    "n_routed_experts": 288, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 0, "v_head_dim": 256, "qk_nope_head_dim": 256, "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "hidden_act": "silu", "initializer_range": 0.02,
    "rms_norm_eps": 1e-5, "pad_token_id": 154820, "attention_bias": False, "index_topk": 2048,
    "index_head_dim": 128, "index_n_heads": 32, "swiglu_limit": 10.0, "linear_head_dim": 128,
    "linear_num_heads": 64, "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0, "hc_mult": 4, "hc_eps": 1e-6,
    "hc_sinkhorn_iters": 20, "index_kpool": 16, "index_kpool_always_select_tail": True,
    "mlp_layer_types": None, "layer_types": None, "indexer_types": None,
}
# Fields that transformers types as optional: null is a value there; anywhere else it refuses null.
_HF_NULLABLE = {"pad_token_id", "linear_lower_bound", "mlp_layer_types", "layer_types", "indexer_types"}
# transformers' legacy layer names (configuration_utils._LEGACY_LAYER_TYPE_REMAP), applied after
# Glm5NextTextConfig has turned full_attention into indexed_attention: a legacy "attention" stays
# "full_attention", which its model builds but cannot run.
_HF_LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention",
                          "deepseek_sparse_attention": "indexed_attention", "qwen_sparse_attention": "indexed_attention"}


def hf_text_config(cfg: dict) -> dict:
    """The text-model fields of a GLM-5.3-Flash config.json, resolved as transformers' Glm5NextConfig and
    Glm5NextTextConfig resolve them, so that longctx builds the model transformers builds from the file:
    - a `text_config` that is present and not null is the text model (an empty one means all defaults);
      otherwise the top level is (a flat checkpoint);
    - a field left out takes transformers' default (HF_TEXT_DEFAULTS);
    - `num_local_experts` is transformers' alias of `n_routed_experts` and, being set after the fields, wins;
    - `linear_attn_config` keys (head_dim, num_heads, short_conv_kernel_size, gate_lower_bound) override the
      linear_* fields, and with its `safe_gate` (true unless given) a null lower bound becomes -5;
    - absent layer schedules get transformers' defaults; full_attention and the legacy DSA names are
      indexed_attention, mamba is linear_attention;
    - absent `indexer_types` come from `index_topk_pattern` (an F/S string or a list), else from
      `index_topk_freq` (default 1) and `index_skip_topk_offset` (default 2).
    `tie_word_embeddings` is not a text field here: transformers ties the head on the top-level flag
    (see `hf_ties_head`)."""
    src = cfg["text_config"] if cfg.get("text_config") is not None else cfg
    t = dict(HF_TEXT_DEFAULTS)
    for k, v in src.items():
        if k in HF_TEXT_DEFAULTS:
            if v is None and k not in _HF_NULLABLE:
                raise ConfigError(f"config.json text_config.{k} is null, which transformers refuses too; give it a value or leave it out.")
            t[k] = v
    if src.get("num_local_experts") is not None:
        t["n_routed_experts"] = src["num_local_experts"]
    n = t["num_hidden_layers"]
    if t["mlp_layer_types"] is None:
        t["mlp_layer_types"] = ["dense"] * min(3, n) + ["sparse"] * (n - 3)
    if t["layer_types"] is None:
        t["layer_types"] = ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]
    t["layer_types"] = [_HF_LEGACY_LAYER_TYPES.get(v, v) for v in
                        ("indexed_attention" if v == "full_attention" else v for v in t["layer_types"])]
    if t["indexer_types"] is None:
        if (pat := src.get("index_topk_pattern")) is not None:
            if isinstance(pat, str) and set(pat) - set("FS"):
                raise ConfigError(f"config.json text_config.index_topk_pattern {pat!r} may only use the letters F and S; "
                                  "give one F (full) or S (shared) per layer.")
            t["indexer_types"] = [{"F": "full", "S": "shared"}[c] for c in pat] if isinstance(pat, str) else list(pat)
        else:
            freq = max(src.get("index_topk_freq", 1), 1)
            offset = src.get("index_skip_topk_offset", 2)
            t["indexer_types"] = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if (lin := src.get("linear_attn_config")) is not None:
        t["linear_head_dim"] = lin.get("head_dim", t["linear_head_dim"])
        t["linear_num_heads"] = lin.get("num_heads", t["linear_num_heads"])
        t["linear_conv_kernel_dim"] = lin.get("short_conv_kernel_size", t["linear_conv_kernel_dim"])
        t["linear_lower_bound"] = lin.get("gate_lower_bound", t["linear_lower_bound"])
        if lin.get("safe_gate", True) and t["linear_lower_bound"] is None:
            t["linear_lower_bound"] = -5.0
    return t


def hf_ties_head(cfg: dict) -> bool:
    """Whether transformers ties `lm_head` to the embedding for this config.json: Glm5NextForConditionalGeneration
    reads `tie_word_embeddings` of the top-level (multimodal) config, default false; `text_config`'s own flag
    plays no part. A flat config's flag is that top-level one."""
    return bool(cfg.get("tie_word_embeddings", False))


def config_from_hf(cfg: dict) -> ModelConfig:
    """Our ModelConfig from a GLM-5.3-Flash config.json (nested text_config or flat), field by field the
    model transformers builds from it (`hf_text_config`, `hf_ties_head`)."""
    t = hf_text_config(cfg)
    if int(t["qk_rope_head_dim"] or 0) > 0:
        raise ConfigError(
            f"config.json text_config.qk_rope_head_dim is {t['qk_rope_head_dim']}, but longctx's DSA layers are NoPE; "
            "only checkpoints with qk_rope_head_dim = 0 (GLM-5.3-Flash) can be loaded."
        )
    if t["hidden_act"] != "silu":
        raise ConfigError(f"config.json text_config.hidden_act is {t['hidden_act']!r}; only 'silu' is supported.")
    if t["attention_bias"]:
        raise ConfigError("config.json text_config.attention_bias is true; longctx's MLA has no biases.")
    heads = t["num_attention_heads"]
    if t["num_key_value_heads"] != heads:
        raise ConfigError("config.json text_config.num_key_value_heads must equal num_attention_heads for MLA.")
    n = t["num_hidden_layers"]

    def pattern(field, mapping):
        vals = t[field]
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

    layer_types = pattern("layer_types", {"linear_attention": "K", "indexed_attention": "D"})
    mlp_types = pattern("mlp_layer_types", {"dense": "d", "sparse": "m"})
    # transformers reads indexer_types[i] for layer i and takes anything but "shared" as a full indexer,
    # so a longer list is fine and only a shorter one is an error.
    if len(t["indexer_types"]) < n:
        raise ConfigError(f"config.json text_config.indexer_types has {len(t['indexer_types'])} entries for {n} layers; "
                          "give one per layer.")
    indexer_types = "".join("s" if v == "shared" else "f" for v in t["indexer_types"][:n])
    lower, pad = t["linear_lower_bound"], t["pad_token_id"]
    if pad is not None and not (isinstance(pad, int) and 0 <= pad < t["vocab_size"]):
        raise ConfigError(f"config.json text_config.pad_token_id is {pad!r} (an absent field takes transformers' default), "
                          f"outside the vocabulary of {t['vocab_size']}; set it to a token id below that or to null.")
    return ModelConfig(
        vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], num_layers=n,
        layer_pattern=layer_types, mlp_pattern=mlp_types, indexer_pattern=indexer_types, residual="mhc",
        rms_norm_eps=float(t["rms_norm_eps"]), tie_word_embeddings=hf_ties_head(cfg),
        init_std=float(t["initializer_range"]), pad_token_id=t["pad_token_id"],
        kda_heads=t["linear_num_heads"], kda_head_dim=t["linear_head_dim"],
        kda_conv_size=t["linear_conv_kernel_dim"], kda_gate_lower_bound=None if lower is None else float(lower),
        attn_heads=heads, q_lora_rank=t["q_lora_rank"], kv_lora_rank=t["kv_lora_rank"],
        qk_nope_head_dim=t["qk_nope_head_dim"], v_head_dim=t["v_head_dim"],
        index_heads=t["index_n_heads"], index_head_dim=t["index_head_dim"],
        index_topk=t["index_topk"], index_pool=t["index_kpool"],
        index_tail=bool(t["index_kpool_always_select_tail"]),
        intermediate_size=t["intermediate_size"], moe_intermediate_size=t["moe_intermediate_size"],
        n_routed_experts=t["n_routed_experts"], n_shared_experts=t["n_shared_experts"],
        experts_per_token=t["num_experts_per_tok"], n_group=t["n_group"],
        topk_group=t["topk_group"], routed_scaling_factor=float(t["routed_scaling_factor"]),
        norm_topk_prob=bool(t["norm_topk_prob"]), swiglu_limit=float(t["swiglu_limit"]),
        hc_streams=t["hc_mult"], hc_sinkhorn_iters=t["hc_sinkhorn_iters"],
        hc_eps=float(t["hc_eps"]), balancer="quantile", indexer_loss=False,
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
        if cfg.n_shared_experts == 0 and suffix.startswith("mlp.shared_experts.") and t.numel() == 0:
            continue  # transformers' shared MLP of width moe_intermediate_size * 0: it adds exactly nothing
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
    """Our keys -> hub keys, for the whole state dict or any part of it (an exporter converts one layer
    at a time): each of our tensors maps on its own. The fused experts become per-expert views of their
    rows (`gate_up` [E, 2I, h] -> experts.e.gate_proj / up_proj, `down` [E, h, I] -> experts.e.down_proj),
    which are contiguous: nothing is copied."""
    out = {}
    for k, t in sd.items():
        if k == "lm_head.weight":
            out[k] = t
        elif k in ("embed.weight", "norm.weight"):
            out[HF_PREFIX + ("embed_tokens.weight" if k == "embed.weight" else "norm.weight")] = t
        else:
            m = re.match(r"layers\.(\d+)\.(.*)$", k)
            if m is None:
                raise CheckpointError(f"model tensor {k!r} has no GLM-5.3-Flash equivalent; it cannot be exported.")
            i, suffix = int(m.group(1)), m.group(2)
            pre = f"{HF_PREFIX}layers.{i}."
            if suffix == "mlp.experts.gate_up":
                inter = t.shape[1] // 2
                for j in range(t.shape[0]):
                    out[f"{pre}mlp.experts.{j}.gate_proj.weight"] = t[j, :inter]
                    out[f"{pre}mlp.experts.{j}.up_proj.weight"] = t[j, inter:]
            elif suffix == "mlp.experts.down":
                for j in range(t.shape[0]):
                    out[f"{pre}mlp.experts.{j}.down_proj.weight"] = t[j]
                if cfg.n_shared_experts == 0:
                    # transformers always builds a shared MLP, of width 0 here, and saves its empty weights:
                    # write them the same
                    h = t.shape[1]
                    out[pre + "mlp.shared_experts.gate_proj.weight"] = t.new_zeros(0, h)
                    out[pre + "mlp.shared_experts.up_proj.weight"] = t.new_zeros(0, h)
                    out[pre + "mlp.shared_experts.down_proj.weight"] = t.new_zeros(h, 0)
            else:
                hub = _rename_layer_key(suffix, to_ours=False)
                if hub is None:
                    raise CheckpointError(f"model tensor {k!r} has no GLM-5.3-Flash equivalent; it cannot be exported.")
                out[pre + hub] = t
    return {k: v.contiguous() for k, v in out.items()}


def export_pieces(names, num_layers: int) -> list[list[str]]:
    """Our tensor names in the pieces an export converts and writes one after another: the embedding,
    then each layer's tensors, then the rest (final norm, head). A piece is what an exporter holds at
    once; at GLM-5.3-Flash's size a layer is the natural unit (its experts are most of it)."""
    def place(name: str) -> int:
        m = re.match(r"layers\.(\d+)\.", name)
        return 1 + int(m.group(1)) if m else (0 if name == "embed.weight" else num_layers + 1)

    groups: dict[int, list[str]] = {}
    for n in names:
        groups.setdefault(place(n), []).append(n)
    return [groups[k] for k in sorted(groups)]


# ------------------------------------------------------------------------------ files
def _read_safetensors(path: str, skip=lambda k: False) -> dict[str, torch.Tensor]:
    out = {}
    for part in _safetensors_files(path, skip):
        out.update(part)
    return out


def _safetensors_files(path: str, skip=lambda k: False):
    """The tensors of a folder's safetensors (those of its index, if it has one), one file at a time."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors files in {path!r}; point load_pretrained at a checkpoint directory.")
    for name in files:
        try:
            with safe_open(os.path.join(path, name), "pt") as f:
                part = {k: f.get_tensor(k) for k in f.keys() if not skip(k)}
        except Exception as exc:  # corrupt or truncated file
            raise CheckpointError(f"checkpoint file {os.path.join(path, name)!r} cannot be read ({exc}); it is corrupt — re-save it.") from None
        yield part


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
    """A GLM-5.3-Flash directory (transformers layout) or a longctx checkpoint -> LongCtxModel.

    The config is read as transformers reads it (`config_from_hf`), and the head is tied as transformers
    ties it. With `dtype` bf16 or fp16, the tensors of KEEP_FP32 stay fp32, as in transformers."""
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
        if cfg.tie_word_embeddings and "lm_head.weight" in sd:
            # transformers ties symmetrically on load: a head without an embedding becomes the embedding, and a
            # head that differs from the embedding stays a head of its own (untied, with a warning).
            if "embed.weight" not in sd:
                sd["embed.weight"] = sd["lm_head.weight"]
            elif not torch.equal(sd["embed.weight"], sd["lm_head.weight"]):
                cfg = cfg.replace(tie_word_embeddings=False)
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
        _to_dtype(model, dtype)
    return model


# The tensors transformers keeps in fp32 when it loads GLM-5.3-Flash in bf16 or fp16
# (Glm5NextPreTrainedModel._keep_in_fp32_modules_strict; it has no `_keep_in_fp32_modules`): our name
# inside a layer -> transformers' name there, each with the reason it needs the precision:
KEEP_FP32 = {
    # gate.weight: the router's logits are computed in fp32, and top-k over near-tied sigmoid scores
    # flips expert choices when the weight itself is rounded to bf16.
    "mlp.router.weight": "gate.weight",
    # e_score_correction_bias: the balancer moves it in steps far below bf16's resolution at its size.
    "mlp.router.bias": "gate.e_score_correction_bias",
    # conv1d: the short conv runs in fp32 (as fla's kernel does); its output is L2-normalised into the
    # keys and queries of the recurrence, where rounding of the 4 taps would bias every token.
    "mixer.q_conv.weight": "self_attn.conv1d.weight", "mixer.k_conv.weight": "self_attn.conv1d.weight",
    "mixer.v_conv.weight": "self_attn.conv1d.weight",
    # dt_bias, A_log: the forget gate is computed in fp32 and its log-decay is summed over the whole
    # sequence by the recurrence, so an error in exp(A_log) or the bias compounds with length.
    "mixer.dt_bias": "self_attn.forget_gate.dt_bias", "mixer.A_log": "self_attn.forget_gate.A_log",
    # mHC base and scale: the pre/post/comb coefficients (sigmoid, Sinkhorn) are fp32 maths on these
    # few numbers, and each layer's streams are mixed by them; fp32 costs nothing at this size.
    "mixer_res.base": "attn_hc.base", "mixer_res.scale": "attn_hc.scale",
    "mlp_res.base": "ffn_hc.base", "mlp_res.scale": "ffn_hc.scale",
}


def _to_dtype(model: LongCtxModel, dtype: torch.dtype):
    """`model.to(dtype)`, except that in bf16 or fp16 the KEEP_FP32 tensors stay fp32 (from their fp32
    values, not a round trip through `dtype`), as transformers loads the same checkpoint."""
    keep = {}
    if dtype in (torch.float16, torch.bfloat16):
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            m = re.match(r"layers\.\d+\.(.*)$", name)
            if m and m.group(1) in KEEP_FP32:
                keep[name] = t.detach().float().clone()
    model.to(dtype)
    for name, t in keep.items():
        owner, _, attr = name.rpartition(".")
        mod = model.get_submodule(owner)
        if attr in mod._parameters:
            mod._parameters[attr].data = t
        else:
            mod._buffers[attr] = t


def save_checkpoint_dir(model: LongCtxModel, path: str):
    """Our own checkpoint layout (weights only), written atomically through a temporary folder of our
    own next to `path`, then renamed into place; an existing `path` is replaced."""
    _write_dir(path, lambda tmp: write_model_files(model, tmp), force=True)


def check_export_target(path: str, force: bool = False):
    """Refuse an export target that holds something we did not write: a file (or link) named `path`, or a
    folder that is not empty, unless `force`. An absent path or an empty folder is fine."""
    if not path or "\x00" in path:
        raise CheckpointError(f"--out {path!r} is not a usable folder name; give the folder to write the export to.")
    if force or not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        raise CheckpointError(f"export target {path!r} exists and is not a folder; choose another --out, "
                              "or pass --force (force=True) to replace it.")
    if os.listdir(path):
        raise CheckpointError(f"export target {path!r} is a folder that is not empty; choose another --out, "
                              "or pass --force (force=True) to replace what is in it.")


def check_vision_source(path: str | None):
    """A `vision_from` the user named must be a GLM-5.3-Flash folder (its config.json is what gets copied)."""
    if path is not None and not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointError(f"--vision-from {path!r} is not a GLM-5.3-Flash folder with a config.json; "
                              "give the checkpoint folder to copy the vision tower from, or leave it out.")


# transformers' save_pretrained shards at 50GB since 5.0; hub releases (and transformers before 5.0) at 5GB,
# which keeps every file well under the hub's 50GB upload limit and lets downloads run in parallel.
DEFAULT_MAX_SHARD_SIZE = "5GB"
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def shard_bytes(size: int | str) -> int:
    """A shard size as transformers' `max_shard_size` takes it (bytes, or "5GB" with KB/MB/GB/TB powers of
    1000; KiB/MiB/GiB/TiB are powers of 1024) -> bytes, at least 1."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", str(size), re.I)
        if m is None or m.group(2).upper() not in _SIZE_UNITS:
            raise ConfigError(f"max_shard_size {size!r} is not a size; give bytes or a number with a unit, "
                              "for example 5GB or 500MiB.")
        n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
    if n < 1:
        raise ConfigError(f"max_shard_size {size!r} is below one byte; give a size such as 5GB.")
    return n


class _ShardWriter:
    """Hub tensors, in the order given, into safetensors files of at most `limit` bytes each, grouped as
    transformers groups them (huggingface_hub's `split_torch_state_dict_into_shards`): a tensor that
    would take the file being filled past the limit starts the next one, and a tensor larger than the
    limit is a file of its own, numbered before the one being filled. A file is written as soon as it
    is complete, so only its tensors are held; it has a provisional name until `finish` knows how many
    there are: one is `model.safetensors` (no index, as transformers writes it), N are
    `model-0000k-of-0000N.safetensors` with `model.safetensors.index.json`."""

    def __init__(self, folder: str, limit: int):
        self.folder, self.limit = folder, limit
        self.filling: dict[str, torch.Tensor] = {}
        self.filling_bytes = 0
        self.files: list[list[str]] = []  # the tensor names of each file written, in file order
        self.total = 0

    def add(self, tensors: dict[str, torch.Tensor]):
        for name, t in tensors.items():
            n = t.numel() * t.element_size()
            self.total += n
            if n > self.limit:
                self._write({name: t})
                continue
            if self.filling and self.filling_bytes + n > self.limit:
                self._write(self.filling)
                self.filling, self.filling_bytes = {}, 0
            self.filling[name] = t
            self.filling_bytes += n

    def _write(self, tensors: dict[str, torch.Tensor]):
        save_file(tensors, self._provisional(len(self.files)), metadata={"format": "pt"})
        self.files.append(list(tensors))

    def _provisional(self, i: int) -> str:
        return os.path.join(self.folder, f".shard-{i}.safetensors")

    def finish(self):
        if self.filling or not self.files:
            self._write(self.filling)
            self.filling = {}
        n = len(self.files)
        if n == 1:
            os.rename(self._provisional(0), os.path.join(self.folder, "model.safetensors"))
            return
        weight_map = {}
        for i, names in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(self._provisional(i), os.path.join(self.folder, final))
            weight_map.update(dict.fromkeys(names, final))
        with open(os.path.join(self.folder, "model.safetensors.index.json"), "w") as f:
            f.write(json.dumps({"metadata": {"total_size": self.total}, "weight_map": weight_map},
                               indent=2, sort_keys=True) + "\n")


def hf_config(cfg: ModelConfig, vision_from: str | None = None) -> dict:
    """The config.json of an export: our text config, and the vision config of `vision_from` (a GLM-5.3-Flash
    folder) or, without one, a minimal vision tower that transformers initialises itself."""
    config = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
              "text_config": config_to_hf(cfg), "tie_word_embeddings": cfg.tie_word_embeddings}
    if vision_from:
        with open(os.path.join(vision_from, "config.json")) as f:
            src = json.load(f)
        for k, v in src.items():
            if k not in ("text_config", "architectures", "model_type", "tie_word_embeddings"):
                config[k] = v
    else:
        config["vision_config"] = {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 32,
                                   "out_hidden_size": cfg.hidden_size, "projection_intermediate_size": 32}
    return config


def write_hf(path: str, cfg: ModelConfig, pieces, vision_from: str | None = None, force: bool = False,
             max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE):
    """Write a model given as `pieces` (an iterable of dicts of our tensors, e.g. one layer each: see
    `export_pieces`) in the GLM-5.3-Flash hub layout, converting and writing each piece before the next
    is asked for: what is held at once is one piece and the file being filled (`_ShardWriter`). The
    vision tensors of `vision_from` follow, a file at a time. Target, vision source and atomic folder
    as in `export_hf`."""
    check_export_target(path, force)
    check_vision_source(vision_from)
    limit = shard_bytes(max_shard_size)
    config = hf_config(cfg, vision_from)

    def write(tmp):
        shards = _ShardWriter(tmp, limit)
        for piece in pieces:
            shards.add(state_dict_to_hf(piece, cfg))
            del piece  # before the next piece is read: the loop would hold this one until then
        if vision_from:
            for part in _safetensors_files(vision_from, skip=lambda k: not _is_vision(k)):
                shards.add(part)
                del part
        shards.finish()
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)

    _write_dir(path, write, force)


def export_hf(model: LongCtxModel, path: str, vision_from: str | None = None, force: bool = False,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE):
    """Write `model` in the GLM-5.3-Flash hub layout. transformers 5.24 loads the folder with
    `AutoModelForImageTextToText.from_pretrained(path)` (or `Glm5NextForConditionalGeneration` itself);
    `AutoModelForCausalLM` does not, as transformers maps `glm5_next` to no causal-LM class.

    The weights are safetensors of at most `max_shard_size` each (bytes, or e.g. "5GB"): one
    `model.safetensors` when they fit, else numbered files and `model.safetensors.index.json`, as
    transformers' `save_pretrained` writes them. A checkpoint too large for one process is exported by
    `longctx.distributed.export.export_checkpoint`, a layer at a time, into the same layout.

    Vision tensors and config are copied from `vision_from` (default: the directory the model was
    loaded from, if any); without one, a minimal vision config is written and transformers initialises
    the (unused) vision tower itself. A `path` that exists as a file or a non-empty folder is refused
    (CheckpointError) unless `force`, which replaces it; the files go to a temporary folder of our own
    next to `path` that is renamed into place once complete, so nothing else there is touched."""
    check_export_target(path, force)
    check_vision_source(vision_from)
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    pieces = ({n: sd[n] for n in names} for names in export_pieces(sd, model.cfg.num_layers))
    write_hf(path, model.cfg, pieces, vision_from=vision_from or getattr(model, "hf_source", None), force=force,
             max_shard_size=max_shard_size)


def _write_dir(path: str, write, force: bool):
    """`write(tmp)` into a fresh, uniquely named folder next to `path`, then rename it to `path`. Without
    `force` only an absent path or an empty folder is replaced (a rename onto anything else fails, so a
    target that filled up meanwhile is not lost); with it, the old `path` is moved into a second folder
    of our own and removed only after the new one is in place."""
    target = os.path.abspath(path)
    parent, base = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{base}.", suffix=".partial", dir=parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary folder
        write(tmp)
        replace = os.path.lexists(target) and not (
            os.path.isdir(target) and not os.path.islink(target) and not os.listdir(target))
        if not replace:
            os.rename(tmp, target)
            return
        if not force:
            raise CheckpointError(f"export target {path!r} was filled while the export was written; "
                                  "choose another --out, or pass --force (force=True) to replace it.")
        holder = tempfile.mkdtemp(prefix=f".{base}.", suffix=".old", dir=parent)
        old = os.path.join(holder, "old")
        os.rename(target, old)
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(old, target)  # the old one goes back where it was
            os.rmdir(holder)
            raise
        shutil.rmtree(holder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
