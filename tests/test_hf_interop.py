"""Reading and writing GLM-5.3-Flash checkpoints as transformers does: the config fields it derives, the
tied head, a model without a shared expert, the dtypes kept in fp32, the Auto class that loads an export,
and an export that never deletes what it did not write."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from hf_reference import edit_config, make_checkpoint, text_config, VISION  # noqa: F401  (skips without transformers)

from longctx.errors import ConfigError
from longctx.hf_interop import config_from_hf, export_hf, load_pretrained

from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration  # noqa: E402


def _hf_reload(path):
    return Glm5NextForConditionalGeneration.from_pretrained(str(path)).eval()


def _assert_logits_close(got: torch.Tensor, ref: torch.Tensor):
    # fp32 on both sides in other op orders: ~5e-6 rel-RMS; a semantic difference is orders of magnitude larger
    assert got.shape == ref.shape
    err = (got - ref).abs().max().item()
    rel = ((got - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
    assert err <= 1e-4 * max(1.0, ref.abs().max().item()) and rel <= 2e-5, (err, rel)


def _compare_logits(path, seq: int = 19):
    hf, ours = _hf_reload(path), load_pretrained(str(path)).eval()
    ids = torch.randint(1, 97, (2, seq), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _assert_logits_close(ours(ids).logits, hf(input_ids=ids).logits)
    return hf, ours


# ---------------------------------------------------------------------------------- config fields
def _ours_from_hf_object(c: Glm5NextConfig) -> dict:
    """Our ModelConfig fields read off the config object transformers builds (the expectation)."""
    t = c.text_config
    kinds = {"linear_attention": "K", "indexed_attention": "D"}
    return dict(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_layers=t.num_hidden_layers,
        layer_pattern="".join(kinds[v] for v in t.layer_types),
        mlp_pattern="".join({"dense": "d", "sparse": "m"}[v] for v in t.mlp_layer_types),
        indexer_pattern="".join("s" if v == "shared" else "f" for v in t.indexer_types[: t.num_hidden_layers]),
        rms_norm_eps=t.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings, init_std=t.initializer_range,
        pad_token_id=t.pad_token_id, kda_heads=t.linear_num_heads, kda_head_dim=t.linear_head_dim,
        kda_conv_size=t.linear_conv_kernel_dim, kda_gate_lower_bound=t.linear_lower_bound,
        attn_heads=t.num_attention_heads, q_lora_rank=t.q_lora_rank, kv_lora_rank=t.kv_lora_rank,
        qk_nope_head_dim=t.qk_nope_head_dim, v_head_dim=t.v_head_dim, index_heads=t.index_n_heads,
        index_head_dim=t.index_head_dim, index_topk=t.index_topk, index_pool=t.index_kpool,
        index_tail=t.index_kpool_always_select_tail, intermediate_size=t.intermediate_size,
        moe_intermediate_size=t.moe_intermediate_size, n_routed_experts=t.n_routed_experts,
        n_shared_experts=t.n_shared_experts, experts_per_token=t.num_experts_per_tok, n_group=t.n_group,
        topk_group=t.topk_group, routed_scaling_factor=t.routed_scaling_factor, norm_topk_prob=t.norm_topk_prob,
        swiglu_limit=t.swiglu_limit, hc_streams=t.hc_mult, hc_sinkhorn_iters=t.hc_sinkhorn_iters, hc_eps=t.hc_eps,
    )


def _no_flat_linear(**kw) -> dict:
    t = text_config(**kw)
    for k in ("linear_head_dim", "linear_num_heads"):
        t.pop(k)
    return t


# KDA and DSA layers, dense and MoE MLPs, a full and a shared indexer
CASE_MIXED = dict(layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
                  indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["sparse", "dense", "sparse", "dense"])

# name -> config.json as a release might write it (transformers resolves each when it reads the file)
CONFIGS = {
    "plain": dict(text_config=text_config()),
    "safe_gate_null_bound": dict(text_config=_no_flat_linear(
        linear_attn_config=dict(safe_gate=True, gate_lower_bound=None, head_dim=8, num_heads=2))),
    "safe_gate_default_null_bound": dict(text_config=_no_flat_linear(
        linear_attn_config=dict(gate_lower_bound=None, head_dim=8, num_heads=2))),
    "unsafe_gate_null_bound": dict(text_config=_no_flat_linear(
        linear_attn_config=dict(safe_gate=False, gate_lower_bound=None, head_dim=8, num_heads=2))),
    "dict_overrides_flat": dict(text_config=text_config(
        linear_lower_bound=-3.0, linear_attn_config=dict(gate_lower_bound=-7.0, head_dim=4, num_heads=3,
                                                         short_conv_kernel_size=2))),
    "flat_null_bound_empty_dict": dict(text_config=text_config(linear_lower_bound=None, linear_attn_config={})),
    "flat_null_bound_no_dict": dict(text_config=text_config(linear_lower_bound=None)),
    "num_local_experts_alias": dict(text_config=text_config(num_local_experts=6, n_routed_experts=4)),
    "absent_kv_heads_is_64": dict(text_config={**text_config(num_attention_heads=64), "num_key_value_heads": 64}),
    "absent_q_lora_rank": dict(text_config={k: v for k, v in text_config().items() if k != "q_lora_rank"}),
    "absent_pad": dict(text_config={k: v for k, v in text_config(vocab_size=154880).items() if k != "pad_token_id"}),
    "all_defaults": dict(text_config={}),
    "flat": dict(text_config()),
    "flat_null_text_config": dict(text_config(), text_config=None),
    "topk_pattern": dict(text_config=text_config(index_topk_pattern="FFSF")),
    "topk_pattern_list": dict(text_config=text_config(index_topk_pattern=["full", "shared", "full", "full"])),
    "topk_freq": dict(text_config=text_config(num_hidden_layers=6, mlp_layer_types=["dense"] * 6,
                                              layer_types=["indexed_attention"] * 6,
                                              index_topk_freq=2, index_skip_topk_offset=1)),
    "topk_freq_default_offset": dict(text_config=text_config(num_hidden_layers=6, mlp_layer_types=["dense"] * 6,
                                                             layer_types=["indexed_attention"] * 6,
                                                             index_topk_freq=3)),
    "indexer_types_longer_and_unknown": dict(text_config=text_config(
        indexer_types=["full", "shared", "bogus", "full", "shared"])),
    "legacy_layer_types": dict(text_config=text_config(
        layer_types=["mamba", "deepseek_sparse_attention", "qwen_sparse_attention", "full_attention"])),
    "absent_schedules": dict(text_config={k: v for k, v in text_config(num_hidden_layers=7).items()
                                          if k != "mlp_layer_types"}),
    "absent_schedules_short": dict(text_config={k: v for k, v in text_config(num_hidden_layers=2).items()
                                                if k != "mlp_layer_types"}),
    "top_tie_text_untied": dict(text_config=text_config(tie_word_embeddings=False), tie_word_embeddings=True),
    "top_untied_text_tie": dict(text_config=text_config(tie_word_embeddings=True), tie_word_embeddings=False),
    "flat_tie": dict(text_config(tie_word_embeddings=True)),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_fields_resolve_as_in_transformers(tmp_path, name):
    """Every ModelConfig field read from config.json equals what transformers' config object holds."""
    cfg = {"model_type": "glm5_next", "vision_config": VISION, **CONFIGS[name]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    expect = _ours_from_hf_object(Glm5NextConfig.from_pretrained(str(tmp_path)))
    got = dataclasses.asdict(config_from_hf(json.loads((tmp_path / "config.json").read_text())))
    assert {k: got[k] for k in expect} == expect


def test_defaults_table_is_transformers_defaults():
    """The defaults longctx fills in are the dataclass defaults of transformers' Glm5NextTextConfig."""
    from transformers import Glm5NextTextConfig

    from longctx.hf_interop import HF_TEXT_DEFAULTS

    fields = {f.name: f.default for f in dataclasses.fields(Glm5NextTextConfig)}
    assert {k: fields[k] for k in HF_TEXT_DEFAULTS} == HF_TEXT_DEFAULTS


def test_safe_gate_without_bound_logits_match_transformers(tmp_path):
    """linear_attn_config {safe_gate: true, gate_lower_bound: null} and no flat linear_* fields: the bounded gate."""
    make_checkpoint(tmp_path, seed=11)

    def edit(c):
        t = c["text_config"]
        for k in ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "linear_lower_bound"):
            t.pop(k)
        t["linear_attn_config"] = dict(safe_gate=True, gate_lower_bound=None, head_dim=8, num_heads=2,
                                       short_conv_kernel_size=4)

    edit_config(tmp_path, edit)
    hf, ours = _compare_logits(tmp_path)
    assert hf.config.text_config.linear_lower_bound == ours.cfg.kda_gate_lower_bound == -5.0


def test_legacy_attention_layer_type_is_refused(tmp_path):
    """transformers turns a legacy "attention" into "full_attention", which its model cannot run."""
    make_checkpoint(tmp_path, seed=2)
    edit_config(tmp_path, lambda c: c["text_config"].update(
        layer_types=["linear_attention", "attention", "linear_attention", "indexed_attention"]))
    with pytest.raises(ConfigError, match=r"layer_types\[1\]"):
        load_pretrained(str(tmp_path))


def test_out_of_vocabulary_default_pad_is_refused(tmp_path):
    make_checkpoint(tmp_path, seed=2)
    edit_config(tmp_path, lambda c: c["text_config"].pop("pad_token_id"))
    with pytest.raises(ConfigError, match="pad_token_id is 154820"):
        load_pretrained(str(tmp_path))


# ---------------------------------------------------------------------------------- tied head
@pytest.mark.parametrize("top,text", [(False, True), (True, False)])
def test_head_ties_on_the_top_level_flag(tmp_path, top, text):
    """transformers ties lm_head to the embedding on the top-level tie_word_embeddings only."""
    make_checkpoint(tmp_path / "hf", seed=4, top=dict(tie_word_embeddings=top), tie_word_embeddings=text)
    hf, ours = _compare_logits(tmp_path / "hf")
    hf_tied = hf.lm_head.weight is hf.model.language_model.embed_tokens.weight
    assert hf_tied == top and ours.cfg.tie_word_embeddings == top
    assert (ours.lm_head.weight is ours.embed.weight) == top
    export_hf(ours, str(tmp_path / "out"))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] == top
    back = _hf_reload(tmp_path / "out")
    assert (back.lm_head.weight is back.model.language_model.embed_tokens.weight) == top
    ids = torch.randint(1, 97, (1, 13), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, hf(input_ids=ids).logits)


def test_tied_flag_with_distinct_head_keeps_both(tmp_path):
    """Top-level tie with an lm_head that differs from the embedding: transformers keeps both, untied."""
    from safetensors import safe_open

    # seed 11: at seed 7 one logit sits where fp32 rounding alone moves it by 2.3e-4 (our fp32 run against our
    # fp64 run), past the fp32 comparison's bound, though both sides compute the same function
    make_checkpoint(tmp_path, seed=11)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys()
    edit_config(tmp_path, lambda c: c.update(tie_word_embeddings=True))
    hf, ours = _compare_logits(tmp_path)
    assert hf.lm_head.weight is not hf.model.language_model.embed_tokens.weight
    assert not ours.cfg.tie_word_embeddings


# ---------------------------------------------------------------------------------- dtypes
_HF_RUNTIME_RENAMES = [  # transformers' module name inside a layer -> ours (its names differ from the hub's)
    ("self_attn.forget_gate.", "mixer."), ("attn_hc.", "mixer_res."), ("ffn_hc.", "mlp_res."),
    ("input_layernorm.", "mixer_norm."), ("post_attention_layernorm.", "mlp_norm."),
    ("mlp.gate.weight", "mlp.router.weight"), ("mlp.gate.e_score_correction_bias", "mlp.router.bias"),
    ("mlp.experts.gate_up_proj", "mlp.experts.gate_up"), ("mlp.experts.down_proj", "mlp.experts.down"),
    ("mlp.shared_experts.", "mlp.shared."), ("self_attn.q_a_layernorm.", "mixer.q_a_norm."),
    ("self_attn.kv_a_proj_with_mqa.", "mixer.kv_a_proj."), ("self_attn.kv_a_layernorm.", "mixer.kv_a_norm."),
    ("self_attn.indexer.index_kpool_compress_ape", "mixer.indexer.pool_ape"),
    ("self_attn.indexer.index_kpool_compress_gate", "mixer.indexer.pool_gate"), ("self_attn.", "mixer."),
]


def _ours_for_hf_tensor(name: str) -> list[str]:
    """Our state-dict names that hold what transformers' tensor `name` holds (its fused conv is our three)."""
    if name == "lm_head.weight":
        return [name]
    name = name.removeprefix("model.language_model.")
    if name in ("embed_tokens.weight", "norm.weight"):
        return ["embed.weight" if name.startswith("embed") else name]
    layer, _, rest = name.partition(".")[2].partition(".")
    if rest == "self_attn.conv1d.weight":
        return [f"layers.{layer}.mixer.{c}_conv.weight" for c in "qkv"]
    for theirs, ours in _HF_RUNTIME_RENAMES:
        if rest.startswith(theirs):
            return [f"layers.{layer}.{ours}{rest[len(theirs):]}"]
    return [f"layers.{layer}.{rest}"]


def test_bf16_load_keeps_the_fp32_tensors_transformers_keeps(tmp_path):
    """Per tensor, the dtype after loading in bf16 is the one transformers gives the same checkpoint."""
    make_checkpoint(tmp_path, seed=8, **CASE_MIXED)
    hf = Glm5NextForConditionalGeneration.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    ours = load_pretrained(str(tmp_path), dtype=torch.bfloat16)
    ours_sd = ours.state_dict()
    expect, checked = {}, set()
    for name, t in hf.state_dict().items():
        if name.startswith("model.visual."):
            continue
        for k in _ours_for_hf_tensor(name):
            expect[k] = t.dtype
    assert set(expect) == set(ours_sd)  # every tensor of ours is checked, and every one of transformers'
    got = {k: t.dtype for k, t in ours_sd.items()}
    assert got == expect
    assert {k for k, d in expect.items() if d == torch.float32} != set()
    ids = torch.randint(1, 97, (1, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.isfinite(ours(ids).logits.float()).all()


# ---------------------------------------------------------------------------------- shared expert
def _tensors(path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize("n_shared", [0, 1])
def test_shared_experts_roundtrip_exactly(tmp_path, n_shared):
    """n_shared_experts = 0: transformers saves a zero-width shared MLP; it loads as none and exports back as it was."""
    make_checkpoint(tmp_path / "hf", seed=9, n_shared_experts=n_shared)
    hf, ours = _compare_logits(tmp_path / "hf")
    assert ours.cfg.n_shared_experts == n_shared
    moe = [b.mlp for b in ours.layers if hasattr(b.mlp, "router")]
    assert moe and all((m.shared is None) == (n_shared == 0) for m in moe)
    export_hf(ours, str(tmp_path / "out"))
    src, out = _tensors(tmp_path / "hf"), _tensors(tmp_path / "out")
    assert sorted(src) == sorted(out)
    for k in src:
        assert src[k].dtype == out[k].dtype and torch.equal(src[k], out[k]), k
    back = _hf_reload(tmp_path / "out")
    ids = torch.randint(1, 97, (1, 13), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, hf(input_ids=ids).logits)


# ---------------------------------------------------------------------------------- Auto class
def test_auto_image_text_to_text_loads_an_export(tmp_path):
    """The class export_hf's docstring names loads the export and computes our logits."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    import longctx

    model = longctx.build_model(longctx.preset("tiny")).eval()
    export_hf(model, str(tmp_path / "out"))
    back = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "out")).eval()
    assert type(back) is Glm5NextForConditionalGeneration
    ids = torch.randint(1, 97, (2, 21), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        _assert_logits_close(back(input_ids=ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match="AutoModelForCausalLM"):  # as the docstring says
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))


# ---------------------------------------------------------------------------------- export target
@pytest.fixture
def own_checkpoint(tmp_path):
    import longctx

    model = longctx.build_model(longctx.preset("tiny")).eval()
    longctx.save_checkpoint_dir(model, str(tmp_path / "ck"))
    return model, str(tmp_path / "ck")


def _export_cli(ck, out, *extra):
    from longctx.cli import main

    return main(["export", "--checkpoint", ck, "--out", str(out), *extra])


def test_export_refuses_a_non_empty_folder(tmp_path, own_checkpoint, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert _export_cli(own_checkpoint[1], out) == 2
    err = capsys.readouterr()
    assert "wrote" not in err.out and err.err.startswith("error: ") and "--force" in err.err
    assert err.err.count("\n") == 1
    assert sorted(os.listdir(out)) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["ck", "out"]  # no temporary folder left behind


def test_export_refuses_a_file(tmp_path, own_checkpoint, capsys):
    out = tmp_path / "out"
    out.write_text("mine")
    assert _export_cli(own_checkpoint[1], out) == 2
    assert "--force" in capsys.readouterr().err
    assert out.is_file() and out.read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["ck", "out"]


def test_export_leaves_siblings_alone(tmp_path, own_checkpoint, capsys):
    for sib in ("out.tmp", "out.old"):
        (tmp_path / sib).mkdir()
        (tmp_path / sib / "keep.txt").write_text(sib)
    (tmp_path / "empty").mkdir()
    assert _export_cli(own_checkpoint[1], tmp_path / "out") == 0
    assert _export_cli(own_checkpoint[1], tmp_path / "empty") == 0  # an empty folder is ours to fill
    assert "wrote" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["ck", "empty", "out", "out.old", "out.tmp"]
    for sib in ("out.tmp", "out.old"):
        assert (tmp_path / sib / "keep.txt").read_text() == sib
    for d in ("out", "empty"):
        assert sorted(os.listdir(tmp_path / d)) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_export_force_replaces(tmp_path, own_checkpoint, kind):
    model, ck = own_checkpoint
    out = tmp_path / "out"
    if kind == "folder":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    else:
        out.write_text("mine")
    assert _export_cli(ck, out, "--force") == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["ck", "out"]
    back = _hf_reload(out)
    ids = torch.randint(1, 97, (1, 15), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        _assert_logits_close(back(input_ids=ids).logits, model(ids).logits)


def test_export_hf_force_kwarg(tmp_path):
    import longctx

    from longctx.errors import CheckpointError

    model = longctx.build_model(longctx.preset("tiny")).eval()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty"):
        export_hf(model, str(tmp_path / "out"))
    export_hf(model, str(tmp_path / "out"), force=True)
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
