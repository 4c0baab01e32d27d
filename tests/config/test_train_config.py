"""The trainer's config loader: presets, files, --set, printing, and one-sentence errors for bad input."""

from __future__ import annotations

import dataclasses
import json
import string
import tempfile
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from longctx.config import ModelConfig, preset
from longctx.errors import ConfigError
from longctx.config.kernels import OPS, KernelConfig
from longctx.config.parallel import KDA_CP_MODES, ParallelConfig
from longctx.config.train import (
    DEVICES,
    DTYPES,
    SCHEDULES,
    DataConfig,
    Stage,
    TrainConfig,
)
from longctx.config.loading import load_train_config, to_toml


# ------------------------------------------------------------------------------ good input
def test_default_is_cpu_demo():
    c = TrainConfig().validate()
    assert c.preset == "small" and c.model == preset("small") and c.data.path is None
    assert [s.seq_len for s in c.stages] == [1024, 4096]
    assert load_train_config() == c


def test_h200_curriculum():
    c = load_train_config(None, "h200-curriculum", [])
    assert [s.seq_len for s in c.stages] == [8192, 65536, 262144, 1048576]
    assert c.model == preset("h200-ref") and c.dtype == "bfloat16"


def test_sft_retrieval():
    c = load_train_config(None, "sft-retrieval", [])
    assert c.task == "sft" and c.data.path is None and c.out_dir == "runs/sft" and c.model == preset("small")
    assert 4096 in c.sft.eval_lengths and min(c.sft.eval_lengths) == c.sft.min_len == c.stages[0].seq_len


def test_round_trip_toml_json_yaml(tmp_path):
    c = load_train_config(None, "tiny", ["model.vocab_size=256", "data.sources.long=/books",
                                         "stages.1.data_mix={main = 1.0, long = 3.0}", "memory.recompute=\"full\""])
    (tmp_path / "c.toml").write_text(to_toml(c))
    (tmp_path / "c.json").write_text(c.to_json())
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(c.to_dict()))
    tomllib.loads(to_toml(c))
    for name in ("c.toml", "c.json", "c.yaml"):
        assert load_train_config(str(tmp_path / name), None, []) == c, name


def test_precedence_and_value_parsing(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('preset = "tiny"\nseed = 5\n[model]\nhidden_size = 64\nvocab_size = 256\n'
                 '[[stages]]\nseq_len = 128\nsteps = 3\nlr = 1e-3\n')
    c = load_train_config(str(f), None, [])
    assert c.preset == "tiny" and c.model.hidden_size == 64 and c.model.num_layers == preset("tiny").num_layers
    assert c.seed == 5 and c.stages == [Stage(seq_len=128, steps=3, lr=1e-3)]
    c = load_train_config(str(f), "small", ["seed=9", "stages.0.lr=2e-4", "data.path=2024", "betas=[0.8, 0.9]",
                                            "model.tie_word_embeddings=true", "model.pad_token_id=null",
                                            "stages.1={seq_len=256, steps=2, lr=1e-4}"])
    assert c.preset == "small" and c.model.hidden_size == 64 and c.model.kda_head_dim == preset("small").kda_head_dim
    assert c.seed == 9 and c.stages[0].lr == 2e-4 and c.data.path == "2024" and c.betas == [0.8, 0.9]
    assert c.model.tie_word_embeddings is True and c.model.pad_token_id is None and len(c.stages) == 2
    assert load_train_config(str(f), "small", ["preset=h200-ref"]).preset == "h200-ref"


# ------------------------------------------------------------------------------ implementation switches
# A tiny run on the CPU: the tiny model, one short stage, one held-out window.
TINY_RUN = ["model.vocab_size=256", "stages=[{seq_len = 64, steps = 1, lr = 1e-3}]", "data.eval_windows=1",
            "log_every=1000"]


def test_kernel_settings_default_round_trip_and_print():
    """The [kernels] table: one field per op, its values the op's own (`ops/<op>/__init__.py`), auto by
    default; --set reaches it, --print-config prints it as a table that loads back."""
    c = load_train_config()
    assert c.kernels == KernelConfig() and set(c.kernels.to_dict().values()) == {"auto"}
    for f in dataclasses.fields(KernelConfig):
        assert OPS[f.name].IMPLS[:2] == ("auto", "torch"), f.name
    c = load_train_config(None, "tiny", ["model.vocab_size=256", "kernels.loss=torch", "kernels.mhc=liger"])
    assert c.kernels.loss == "torch" and c.kernels.mhc == "liger" and c.kernels.kda == "auto"
    text = to_toml(c)
    assert "\n[kernels]\n" in text and 'loss = "torch"' in text and 'mhc = "liger"' in text
    assert tomllib.loads(text)["kernels"]["mhc"] == "liger" and c.to_dict()["kernels"]["loss"] == "torch"
    assert TrainConfig.from_dict(json.loads(c.to_json())) == c
    assert load_train_config(None, "tiny", ["model.vocab_size=256"]).to_dict()["kernels"]["mhc"] == "auto"


@pytest.mark.parametrize("old,new", [("backend", "kernels.kda, kernels.sparse_attention and kernels.indexer"),
                                     ("loss_impl", "kernels.loss"), ("residual_impl", "kernels.mhc"),
                                     ("kda_conv", "kernels.kda_conv"), ("kda_norm", "kernels.kda_norm"),
                                     ("norm_impl", "kernels.rms_norm"), ("swiglu_impl", "kernels.swiglu")])
def test_the_flat_kernel_settings_name_their_replacement(tmp_path, old, new):
    """A config of the old layout is one sentence naming the kernels.<op> that replaces the setting, from
    --set and from a file (a saved run's config too); no setting is read under its old name."""
    with pytest.raises(ConfigError, match=f"^{old} is now .*{new}; set"):
        load_train_config(None, "tiny", [f"{old}=torch"])
    (tmp_path / "old.toml").write_text(f'{old} = "auto"\n')
    with pytest.raises(ConfigError, match=f"^{old} is now"):
        load_train_config(str(tmp_path / "old.toml"), None, [])
    with pytest.raises(ConfigError, match="^indexer_kernel is gone: .*kernels.indexer"):
        load_train_config(None, "tiny", ["indexer_kernel=two_phase"])


def test_trainer_applies_kernel_settings(tmp_path):
    from longctx.kernels import apply_kernels
    from longctx.layers.kda import KimiDeltaAttention
    from longctx.layers.residual import MHC
    from longctx.train.trainer import Trainer

    cfg = load_train_config(None, "tiny", [*TINY_RUN, "kernels.loss=torch", "kernels.mhc=torch", "kernels.kda_conv=torch"])
    tr = Trainer(cfg, out_dir=str(tmp_path), quiet=True)
    mhc = [m for m in tr.model.modules() if isinstance(m, MHC)]
    assert mhc and all(m.kernels["mhc"] == "torch" for m in mhc) and tr.model.kernels["loss"] == "torch"
    kda = next(m for m in tr.model.modules() if isinstance(m, KimiDeltaAttention))
    assert kda.kernels == {"kda": "auto", "kda_conv": "torch", "kda_norm": "auto"}
    assert set(tr.kernels_planned.values()) == {"torch"}  # what runs on the CPU, said before the first step
    tr.run(stop_after=1)
    impl = next(r for r in tr.history if "impl" in r)["impl"]
    assert "loss:torch" in impl and "mhc:torch" in impl and "liger" not in impl, impl
    saved = list(tmp_path.rglob("train_config.json"))  # the checkpoint keeps the settings
    assert saved and all(json.loads(p.read_text())["kernels"]["loss"] == "torch" for p in saved)
    assert json.loads((tmp_path / "config.json").read_text())["kernels"]["mhc"] == "torch"
    # apply_kernels sets every op from the one config it is given, and refuses unknown values
    apply_kernels(tr.model, KernelConfig(loss="auto"))
    assert tr.model.kernels["loss"] == "auto" and all(m.kernels["mhc"] == "auto" for m in mhc)
    with pytest.raises(ConfigError, match="kernels.mhc must be one of"):
        apply_kernels(tr.model, KernelConfig(mhc="fast"))


@pytest.mark.parametrize("op,impl", [("loss", "liger"), ("mhc", "liger"), ("kda", "fla"), ("kda_conv", "fla"),
                                     ("kda_norm", "fla"), ("rms_norm", "triton"), ("swiglu", "triton"),
                                     ("sparse_attention", "triton"), ("indexer", "triton"), ("router", "bf16x3")])
def test_a_fast_path_on_the_cpu_is_a_clean_config_error(tmp_path, monkeypatch, op, impl):
    """Every op's fast backend asked for on the CPU stops the run before its first step, with one sentence
    naming the setting and the fix."""
    from longctx.train.trainer import Trainer

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = load_train_config(None, "tiny", [*TINY_RUN, "device=cpu", f"kernels.{op}={impl}"])
    with pytest.raises(ConfigError) as e:
        Trainer(cfg, out_dir=str(tmp_path), quiet=True).run(stop_after=1)
    msg = str(e.value)
    assert msg.startswith(f"kernels.{op} = '{impl}' cannot run here (it runs on CUDA tensors"), msg
    assert msg.endswith(f"set kernels.{op} to 'auto' or 'torch'."), msg
    with pytest.raises(ConfigError, match=f"kernels.{op} must be one of auto, torch, {impl}"):
        load_train_config(None, "tiny", [*TINY_RUN, f"kernels.{op}=fused"]).validate()


def test_liger_on_the_cpu_exits_2_from_the_cli(tmp_path):
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sets = [a for s in [*TINY_RUN, "device=cpu", "kernels.mhc=liger"] for a in ("--set", s)]
    r = subprocess.run([sys.executable, "-m", "longctx", "train", "--preset", "tiny", *sets, "--out", str(tmp_path)],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=repo), timeout=300,
                       check=False)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and r.stderr.strip().splitlines()[-1].startswith("error: kernels.mhc"), r.stderr


# ------------------------------------------------------------------------------ each kind of bad input
BAD_SETS = [
    (["modle.hidden_size=3"], "unknown setting modle"),
    (["model.hiden_size=3"], "hiden_size"),
    (["data.pth=x"], "data.pth; did you mean data.path"),
    (["stages.0.stpes=3"], "stages.0.stpes; did you mean stages.0.steps"),
    (["learning_rate=1"], "unknown setting learning_rate"),
    (["seed=1.5"], "seed must be int"),
    (["seed=-1"], "seed must be >= 0"),
    (["model.hidden_size=big"], "model.hidden_size must be int"),
    (["model.hidden_size=0"], "model.hidden_size must be >= 1"),
    (["model.layer_pattern=KXD"], "model.layer_pattern"),
    (["stages.0.lr=-1"], "stages.0.lr"),
    (["stages.0.lr=nan"], "stages.0.lr"),
    (["stages.1.seq_len=0"], "stages.1.seq_len"),
    (["stages.0.warmup=1000"], "stages.0.warmup"),
    (["stages.0.schedule=cosin"], "did you mean cosine"),
    (["stages.5.lr=1"], "stages has 2 entries"),
    (["stages.x.lr=1"], "stages is a list"),
    (["stages.2.lr=1"], "stages.2 is missing seq_len, steps"),
    (["stages=[]"], "stages is empty"),
    (["stages.0.data_mix.lng=1"], "stages.0.data_mix"),
    (["stages.0.data_mix.main=-1"], "stages.0.data_mix.main"),
    (["dtype=bf16"], "did you mean bfloat16"),
    (["device=gpu"], "device must be one of"),
    (["backend=fla"], "backend is now three settings, kernels.kda, kernels.sparse_attention and kernels.indexer"),
    (["loss_impl=fused"], "loss_impl is now kernels.loss"),
    (["kernels.loss=fused"], "kernels.loss must be one of auto, torch, liger (got 'fused')"),
    (["kernels.mhc=ligr"], "kernels.mhc must be one of auto, torch, liger (got 'ligr'); did you mean liger"),
    (["indexer_kernel=radix"], "indexer_kernel is gone"),
    (["kernels.kda_conv=cuda"], "kernels.kda_conv must be one of auto, torch, fla (got 'cuda')"),
    (["kernels.kda_norm=cuda"], "kernels.kda_norm must be one of auto, torch, fla (got 'cuda')"),
    (["kernels.kda_nrom=fla"], "unknown setting kernels.kda_nrom; did you mean kda_norm"),
    (["kernels=3"], "kernels must be a table"),
    (["betas=[0.9]"], "betas"),
    (["grad_clip=-1"], "grad_clip"),
    (["data.eval_docs=-2"], "data.eval_docs"),
    (["data.separator=3"], "data.separator must be bool"),
    (["data.sources.main=/x"], "data.sources"),
    (["model.vocab_size=100"], "model.vocab_size"),
    (["preset=smal"], "did you mean small"),
    (["seed.x=1"], "seed is a single value"),
    (["model..x=1"], "empty name part"),
    (["no_equals_sign"], "is not key=value"),
    (["model=3"], "model must be a table"),
    (["memory=3"], "memory must be dict"),
    (["memory.recompute=9"], "memory.recompute = 9 names more blocks than the model's 4; use a number up to 4, or on"),
    (["stages.1.memory={recompute = 5}"], "stages.1.memory.recompute = 5 names more blocks than the model's 4"),
    (["out_dir=runs/a\x00b"], "out_dir 'runs/a\\x00b' has a NUL character"),
    (["data.path=~nosuchuser/corpus"], "data.path '~nosuchuser/corpus' starts with the home folder of a user"),
    (["data.tokenizer=~nosuchuser/t.json"], "data.tokenizer '~nosuchuser/t.json' starts with the home folder"),
    (["data.sources.long=~nosuchuser/books"], "data.sources.long '~nosuchuser/books' starts with the home folder"),
]


@pytest.mark.parametrize("sets,needle", BAD_SETS)
def test_bad_set_names_the_setting(sets, needle):
    with pytest.raises(ConfigError) as e:
        load_train_config(None, None, sets)
    assert needle in str(e.value), str(e.value)


def test_bad_files(tmp_path):
    cases = {
        "a.toml": ('seed = 1\nlog_every = 2\nout_dir = "x\n', ["a.toml", "line 3"]),
        "b.yaml": ("seed: 1\nmodel: [1, 2\nfoo: 3\n", ["b.yaml", "line"]),
        "c.json": ('{"seed": 1,\n "x": }', ["c.json", "line 2"]),
        "d.yaml": ("- 1\n- 2\n", ["d.yaml", "table of settings"]),
        "e.yaml": ("model:\n  1: 2\n", ["model", "setting names must be text"]),
        "f.ini": ("seed = 1\n", ["f.ini", ".toml"]),
        "g.toml": ("[model]\nhidden_sise = 3\n", ["model.hidden_sise"]),
        "h.yaml": ("stages:\n  - {seq_len: 8, steps: 1}\n", ["stages.0 is missing lr"]),
        "i.yaml": ("stages: {seq_len: 8}\n", ["stages must be a list"]),
        "j.toml": ('preset = 3\n', ["preset must be a preset name"]),
        "k.yaml": ("data: [1]\n", ["data must be a table"]),
    }
    for name, (text, needles) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError) as e:
            load_train_config(str(tmp_path / name), None, [])
        for n in needles:
            assert n in str(e.value), (name, str(e.value))
    with pytest.raises(ConfigError, match="does not exist"):
        load_train_config(str(tmp_path / "missing.toml"), None, [])
    with pytest.raises(ConfigError, match="home folder of a user"):
        load_train_config("~nosuchuser/run.toml", None, [])
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="UTF-8"):
        load_train_config(str(tmp_path / "bin.toml"), None, [])


# ------------------------------------------------------------------------------ property: random invalid configs
def _typed_fields():
    """(section, field, allowed base types) for every scalar setting."""
    out = []
    for section, cls, skip in (("", TrainConfig, {"model", "data", "stages", "preset", "memory", "betas", "kernels",
                                                     "parallel"}),
                               ("model", ModelConfig, set()), ("data", DataConfig, {"sources"}),
                               ("stage", Stage, {"data_mix", "memory"}), ("kernels", KernelConfig, set()),
                               ("parallel", ParallelConfig, set())):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            tp = hints[f.name]
            out.append((section, f.name, set(typing.get_args(tp) or (tp,))))
    return out


TYPED = _typed_fields()
POSITIVE = [("model", n) for n in ("vocab_size", "hidden_size", "num_layers", "kda_heads", "kda_head_dim",
                                   "index_topk", "index_pool", "n_routed_experts", "hc_streams")] + \
    [("stage", "seq_len"), ("stage", "steps"), ("stage", "batch_size"), ("", "log_every"), ("parallel", "cp"),
     ("parallel", "dp")]
NON_NEGATIVE = [("stage", "warmup"), ("", "seed"), ("", "eval_every"), ("", "ckpt_every"),
                ("data", "eval_docs"), ("data", "eval_windows"), ("model", "n_shared_experts")]
ENUMS = [("", "dtype", DTYPES), ("", "device", DEVICES), ("stage", "schedule", SCHEDULES),
         ("model", "residual", ("mhc", "attnres", "plain")), ("model", "balancer", ("quantile", "sign", "aux", "none"))] + \
    [("kernels", op, pkg.IMPLS) for op, pkg in OPS.items()] + [("parallel", "kda_cp", KDA_CP_MODES)]
KNOWN = {name for _, name, _ in TYPED} | {"model", "data", "stages", "preset", "memory", "betas", "sources", "data_mix",
                                          "kernels", "parallel"}


def _wrong_value(allowed: set):
    opts = []
    if str not in allowed:
        opts.append(st.text(max_size=8))
    if int not in allowed and float not in allowed:
        opts.append(st.integers(-5, 5))
    if int in allowed and float not in allowed:
        opts.append(st.floats(allow_nan=False).filter(lambda x: x != int(x) if abs(x) < 1e300 else True))
    if bool not in allowed:
        opts.append(st.booleans())
    opts += [st.lists(st.integers(), max_size=3), st.dictionaries(st.sampled_from("abc"), st.integers(), max_size=2)]
    return st.one_of(opts)


def _place(section: str, name: str, value) -> dict:
    stage = {"seq_len": 64, "steps": 2, "lr": 1e-3}
    if section == "":
        return {name: value}
    if section == "stage":
        return {"stages": [{**stage, name: value}]}
    return {section: {name: value}}


unknown_name = st.text(string.ascii_letters + "_", min_size=1, max_size=10).filter(lambda s: s not in KNOWN)


@st.composite
def invalid_config(draw):
    kind = draw(st.sampled_from(["unknown", "type", "negative", "enum", "pattern"]))
    if kind == "unknown":
        return _place(draw(st.sampled_from(["", "model", "data", "stage"])), draw(unknown_name), draw(st.integers()))
    if kind == "type":
        section, name, allowed = draw(st.sampled_from(TYPED))
        return _place(section, name, draw(_wrong_value(allowed)))
    if kind == "negative":
        section, name = draw(st.sampled_from(POSITIVE + NON_NEGATIVE))
        hi = 0 if (section, name) in POSITIVE else -1
        return _place(section, name, draw(st.integers(min_value=-10**12, max_value=hi)))
    if kind == "enum":
        section, name, allowed = draw(st.sampled_from(ENUMS))
        return _place(section, name, draw(st.text(max_size=10).filter(lambda s: s not in allowed)))
    name, letters = draw(st.sampled_from([("layer_pattern", "KD"), ("mlp_pattern", "dm"), ("indexer_pattern", "fs")]))
    bad = draw(st.text(max_size=6).filter(lambda s: not s or set(s) - set(letters)))
    return _place("model", name, bad)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=invalid_config(), fmt=st.sampled_from(["dict", "yaml", "json"]))
def test_random_invalid_configs_raise_config_error(cfg, fmt):
    with pytest.raises(ConfigError):
        if fmt == "dict":
            TrainConfig.from_dict(cfg)
        else:
            with tempfile.TemporaryDirectory() as d:
                p = Path(d) / f"c.{fmt}"
                p.write_text(yaml.safe_dump(cfg) if fmt == "yaml" else json.dumps(cfg))
                load_train_config(str(p), None, [])


_SET_VALUE_CHARS = st.text(st.characters(blacklist_characters="\"'\x00", blacklist_categories=("Cs",)), max_size=10)


@st.composite
def invalid_set(draw):
    kind = draw(st.sampled_from(["unknown", "negative", "enum", "noeq", "index"]))
    if kind == "unknown":
        prefix = draw(st.sampled_from(["", "model.", "data.", "stages.0."]))
        return f"{prefix}{draw(unknown_name)}={draw(_SET_VALUE_CHARS)}"
    if kind == "negative":
        section, name = draw(st.sampled_from(POSITIVE + NON_NEGATIVE))
        hi = 0 if (section, name) in POSITIVE else -1
        where = {"": "", "stage": "stages.1."}.get(section, section + ".")
        return f"{where}{name}={draw(st.integers(min_value=-10**9, max_value=hi))}"
    if kind == "enum":
        section, name, allowed = draw(st.sampled_from(ENUMS))
        where = {"": "", "stage": "stages.0."}.get(section, section + ".")
        return f"{where}{name}={draw(_SET_VALUE_CHARS.filter(lambda s: s.strip() not in allowed))}"
    if kind == "noeq":
        return draw(st.text(max_size=15).filter(lambda s: "=" not in s))
    return f"stages.{draw(st.integers(3, 10**6))}.lr=1e-3"


@settings(max_examples=150, deadline=None)
@given(sets=st.lists(invalid_set(), min_size=1, max_size=3))
def test_random_invalid_sets_raise_config_error(sets):
    with pytest.raises(ConfigError):
        load_train_config(None, None, sets)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=40), fmt=st.sampled_from(["toml", "yaml", "json"]))
def test_random_file_text_raises_config_error(text, fmt):
    """Random text as a config file: either it fails to parse, or it names unknown/invalid settings."""
    try:  # skip the rare text that parses to an empty table (a valid, empty config)
        parsed = {"toml": tomllib.loads, "yaml": yaml.safe_load, "json": json.loads}[fmt](text)
    except Exception:
        parsed = "unparseable"
    assume(parsed not in (None, {}))
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / f"c.{fmt}"
        p.write_text(text, encoding="utf-8")
        with pytest.raises(ConfigError):
            load_train_config(str(p), None, [])


# ------------------------------------------------------------------------------ every preset trains on the default data
def _cli_presets() -> list[str]:
    """The preset names `longctx train --help` lists for --preset."""
    import re

    from longctx.cli import build_parser

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    help_text = next(a.help for a in train._actions if "--preset" in a.option_strings)
    return re.search(r"\(([^)]*)\)", help_text).group(1).split(", ")


def test_the_cli_lists_every_preset():
    from longctx.config.train import preset_names

    assert _cli_presets() == preset_names()


@pytest.mark.parametrize("name", _cli_presets())
def test_every_listed_preset_prints_and_fits_the_byte_tokenizer(name, capsys):
    from longctx.cli import main

    c = load_train_config(None, name, [])  # resolved and validated; the huge ones are never built
    assert c.model.vocab_size >= 256 and c.data.tokenizer == "byte"
    assert main(["train", "--preset", name, "--print-config"]) == 0
    text = capsys.readouterr().out
    assert tomllib.loads(text)["model"]["vocab_size"] == c.model.vocab_size
    assert load_train_config(None, name, [f"model.vocab_size={c.model.vocab_size}"]) == c


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_cpu_sized_presets_train_a_step_without_a_vocab_setting(name, tmp_path, capsys):
    from longctx.cli import main

    sets = ["stages=[{seq_len = 32, steps = 1, lr = 1e-3}]", "data.eval_windows=1", "log_every=1000"]
    assert main(["train", "--preset", name, *[a for s in sets for a in ("--set", s)], "--out", str(tmp_path)]) == 0
    assert (tmp_path / "checkpoint").exists()


def test_a_model_preset_sizes_its_vocabulary_to_the_tokenizer(tmp_path, capsys):
    from tokenizers import Tokenizer, models

    from longctx.cli import main

    c = load_train_config(None, "tiny", [])
    assert c.model.vocab_size == 256 and c.model.hidden_size == preset("tiny").hidden_size
    assert "tiny preset has 97" in to_toml(c).splitlines()[1]
    assert "tiny preset has 97" in to_toml(TrainConfig(preset="tiny").validate())
    assert "preset has" not in to_toml(load_train_config(None, "small", []))  # 256 already
    assert load_train_config(None, "h200-ref", []).model.vocab_size == preset("h200-ref").vocab_size  # never shrunk
    (tmp_path / "run.toml").write_text(to_toml(c))
    assert load_train_config(str(tmp_path / "run.toml"), None, []) == c
    assert TrainConfig.from_dict({"preset": "tiny"}).model.vocab_size == 256
    for n, want in ((300, 300), (50, 97)):  # a larger tokenizer grows it; a smaller one keeps the preset's
        words = {f"w{i}": i for i in range(n - 1)} | {"[UNK]": n - 1}
        Tokenizer(models.WordLevel(words, unk_token="[UNK]")).save(str(tmp_path / f"t{n}.json"))
        assert load_train_config(None, "tiny", [f"data.tokenizer={tmp_path / f't{n}.json'}"]).model.vocab_size == want
    # an explicit vocabulary is the user's: too small for the tokenizer is refused in one sentence
    for sets in (["model.vocab_size=97"], ["model.vocab_size=100"], ["preset=small", "model.vocab_size=200"]):
        with pytest.raises(ConfigError) as e:
            load_train_config(None, "tiny", sets)
        msg = str(e.value)
        assert msg.startswith("model.vocab_size (") and "256" in msg and msg.count(". ") == 0, msg
    assert main(["train", "--preset", "tiny", "--set", "model.vocab_size=97", "--print-config"]) == 2
    assert capsys.readouterr().err.startswith("error: model.vocab_size (97)")
    (tmp_path / "small.toml").write_text('preset = "tiny"\n[model]\nvocab_size = 97\n')
    with pytest.raises(ConfigError, match=r"model.vocab_size \(97\)"):
        load_train_config(str(tmp_path / "small.toml"), None, [])
