"""Build small random GLM-5.3-Flash checkpoints with transformers' `glm5_next` (the semantic reference)."""

from __future__ import annotations

import json
import math
import os

import torch

transformers = __import__("pytest").importorskip("transformers")
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration  # noqa: E402

VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32,
              projection_intermediate_size=32)


def text_config(**kw) -> dict:
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, v_head_dim=8, index_topk=8, index_head_dim=8,
                index_n_heads=2, linear_head_dim=8, linear_num_heads=2, index_kpool=4,
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"], pad_token_id=0)
    base.update(kw)
    return base


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int):
    """Non-degenerate random weights: every parameter matters and no top-k has ties."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if name.endswith(("layernorm.weight", "norm.weight", "k_norm.weight")):
            v = 1 + 0.2 * r
        elif name.endswith("k_norm.bias"):
            v = 0.1 * r
        elif name.endswith("A_log"):
            v = 0.5 * r
        elif name.endswith("dt_bias"):
            v = r
        elif name.endswith(("hc.base", "hc_attn_base", "hc_ffn_base")) or ".base" in name and "hc" in name:
            v = 0.5 * r
        elif name.endswith("scale") and "hc" in name:
            v = 1 + 0.2 * r
        elif "index_kpool" in name:
            v = 0.5 * r
        elif p.dim() >= 2:
            v = r / math.sqrt(p.shape[-1])
        else:
            v = 0.5 * r
        p.copy_(v.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=g))


def make_checkpoint(path, seed: int = 0, top: dict | None = None, **text_kw) -> Glm5NextForConditionalGeneration:
    """A random model saved to `path`; `top` holds fields of the top-level (multimodal) config."""
    cfg = Glm5NextConfig(text_config=text_config(**text_kw), vision_config=VISION, **(top or {}))
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(cfg).eval()
    randomize(model, seed)
    model.save_pretrained(str(path))
    return model


def edit_config(path, edit) -> dict:
    """Rewrite `path`/config.json through `edit(dict)` (in place): configs as a hub release might write them."""
    p = os.path.join(str(path), "config.json")
    with open(p) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(p, "w") as f:
        json.dump(cfg, f)
    return cfg
