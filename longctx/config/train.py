"""The trainer's configuration: typed dataclasses, validated, printable, loaded from TOML/YAML/JSON
plus `--set key=value` overrides.

Precedence, lowest first: the preset (a model preset such as "small", or a training preset such as
"h200-curriculum") < the config file < `--set`. Model settings start from the preset's
`ModelConfig` and are overridden field by field; a config file's `stages` list replaces the
preset's, while `--set stages.0.steps=10` edits one field (and `stages.N.x=...` with N = the number
of stages appends a stage). A model preset whose vocabulary has fewer ids than data.tokenizer (tiny:
97 < the byte tokenizer's 256) gets the tokenizer's, unless the file or `--set` gives model.vocab_size.
Every mistake is a `ConfigError` whose one sentence names the setting and the fix; nothing else escapes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

from . import PRESETS as MODEL_PRESETS
from .model import ModelConfig, _check_types, _is_instance, _type_name
from . import preset as model_preset
from ..errors import ConfigError, did_you_mean

DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "torch", "triton")
LOSS_IMPLS = ("auto", "torch", "liger")      # = longctx.ops.loss.liger.LOSS_IMPLS (kept here: no torch import)
RESIDUAL_IMPLS = ("auto", "torch", "liger")  # = longctx.layers.residual.RESIDUAL_IMPLS
INDEXER_KERNELS = ("fused", "two_phase", "two_phase_radix", "two_phase_grouped")  # = kpool_indexer.INDEXER_KERNELS
KDA_CONVS = ("auto", "torch", "fla")  # = longctx.layers.kda.CONV_IMPLS
KDA_NORMS = ("auto", "torch", "fla")  # = longctx.layers.kda.NORM_IMPLS
NORM_IMPLS = ("auto", "torch", "triton")  # = longctx.layers.norms.RMS_NORM_IMPLS
SWIGLU_IMPLS = ("auto", "torch", "triton")  # = longctx.layers.mlp.SWIGLU_IMPLS
SCHEDULES = ("cosine", "linear", "constant")
MAIN_SOURCE = "main"  # the name of data.path inside a stage's data_mix


@dataclass
class Stage:
    """One step of the context-extension curriculum.

    The learning rate warms up linearly for `warmup` steps, then follows `schedule` down to
    `min_lr_ratio * lr`. `data_mix` weighs named sources ("main" = data.path, others from
    data.sources); None = main only. `memory` overrides the top-level memory plan for this stage.
    """

    seq_len: int
    steps: int
    lr: float
    batch_size: int = 1
    warmup: int = 0
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    data_mix: dict[str, float] | None = None
    memory: dict | None = None

    @property
    def tokens(self) -> int:
        return self.steps * self.batch_size * self.seq_len


@dataclass
class DataConfig:
    """What to train on. path None = the embedded corpus (the Python standard library's sources).

    eval_docs: documents of data.path held out for evaluation (the embedded corpus has its own
    fixed split). eval_windows: held-out windows per evaluation, each from a document's start;
    0 = no evaluation (no held-out loss, per-position table or plot, and no eval records in metrics).
    separator: put the tokenizer's end-of-text token (NUL for bytes) between packed documents.
    sources: extra named corpora for stages.N.data_mix, e.g. {long = "/data/books"}.
    """

    path: str | None = None
    tokenizer: str = "byte"
    text_field: str = "text"
    separator: bool = True
    eval_docs: int = 2
    eval_windows: int = 8
    sources: dict[str, str] = field(default_factory=dict)


def _demo_stages() -> list[Stage]:
    # The CPU demo: ~250k tokens, a few minutes on 2 cores with the "small" model (1024 -> 4096).
    return [
        Stage(seq_len=1024, steps=80, lr=2e-3, batch_size=2, warmup=8),
        Stage(seq_len=4096, steps=20, lr=1e-3, batch_size=1, warmup=2),
    ]


@dataclass
class TrainConfig:
    """Everything a training run needs. The default is the CPU demo (preset small, embedded corpus,
    1024 then 4096 tokens). `preset` names where the config started; `model` is authoritative.

    Implementation switches (they change how, not what, the model computes): `backend` picks the
    KDA / DSA / indexer kernels; `loss_impl` the LM head + cross entropy (torch = chunked head under
    checkpoint, liger = liger-kernel's fused linear + cross entropy; see longctx.ops.loss.liger);
    `residual_impl` the mHC residual (torch, or liger-kernel's Triton mHC ops; see
    longctx.ops.mhc.liger); `indexer_kernel` the indexers' Triton path (two_phase: a score buffer and a
    k-th select, the default; fused: one radix-select kernel; two_phase_radix: our own k-th select,
    no faster than torch.topk on the H200; two_phase_grouped: the k-th by topk over group maxima, exact and slower on the H200); `kda_conv` KDA's short conv (auto = fla's causal_conv1d
    wherever KDA runs fla's kernel, a decoding or sequence-chunk state's window included); `kda_norm`
    KDA's gated output norm (auto = fla's fused kernel wherever KDA runs fla's kernel, as the conv);
    `norm_impl` every RMSNorm (auto, the default, = triton on CUDA: longctx.ops.rms_norm.triton, same
    arithmetic and saved tensors as torch's form, a 128k h200-ref step 4.13 -> 3.88 s on the H200);
    `swiglu_impl` every clamped SwiGLU, the dense MLPs' and the experts' (auto = triton on CUDA:
    longctx.ops.swiglu.triton, one pass forward and backward, same saved tensors). "liger" / "fla" /
    "triton" need CUDA and the library, and a run that asks for one where it cannot run stops at its first step with a ConfigError; "auto" takes torch there and warns on CUDA.
    """

    model: ModelConfig | None = None  # None = the preset's model
    preset: str = "small"
    data: DataConfig = field(default_factory=DataConfig)
    stages: list[Stage] = field(default_factory=_demo_stages)
    seed: int = 0
    out_dir: str = "runs/demo"
    log_every: int = 1
    eval_every: int = 0   # steps between evaluations; 0 = before training and at the end of each stage
    ckpt_every: int = 0   # steps between checkpoints; 0 = at the end of each stage
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0  # 0 = off
    dtype: str = "auto"     # auto = bfloat16 on CUDA, float32 on the CPU
    device: str = "auto"
    backend: str = "auto"   # auto = triton/fla kernels on CUDA, plain torch on the CPU
    loss_impl: str = "auto"      # auto | torch | liger; auto = liger on CUDA when it imports, torch otherwise
    residual_impl: str = "auto"  # auto | torch | liger (mHC only); auto = liger on CUDA when it imports, torch otherwise
    indexer_kernel: str = "two_phase"  # fused | two_phase | two_phase_radix | two_phase_grouped: the indexers' Triton path (GPU only)
    kda_conv: str = "auto"  # auto | torch | fla: KDA's short conv; auto = fla's where KDA runs fla's kernel
    kda_norm: str = "auto"  # auto | torch | fla: KDA's gated output norm; auto = fla's where KDA runs fla's kernel
    norm_impl: str = "auto"  # auto | torch | triton: the RMSNorms; auto = the fused Triton kernels on CUDA
    swiglu_impl: str = "auto"  # auto | torch | triton: the MLPs' and experts' clamped SwiGLU; auto = fused Triton on CUDA
    memory: dict = field(default_factory=dict)  # the memory plan; validated by the memory system
    cuda_alloc: str = "expandable_segments:True"  # CUDA allocator settings (longctx.memory.allocator); "" = torch's

    # One line for --print-config and the run's model line when a model preset's vocabulary is raised to
    # the tokenizer's (not a field: it describes how the config was resolved, not a setting).
    vocab_note = None

    def __post_init__(self):
        if self.model is None:
            self.model = _preset_model(self.preset)
            if self.preset in MODEL_PRESETS and isinstance(self.data, DataConfig):
                self.model, self.vocab_note = _fit_vocab(self.model, self.preset, self.data.tokenizer)

    # ---------------------------------------------------------------- validation
    def validate(self) -> "TrainConfig":
        hints = typing.get_type_hints(TrainConfig)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "stages" and isinstance(v, list):
                continue  # each entry is checked below, naming its index
            if not _is_instance(v, hints[f.name]) or (f.name == "model" and v is None):
                tn = _type_name(hints[f.name]).replace(" or null", "")
                raise ConfigError(f"{f.name} must be {tn} (got {type(v).__name__} {_short(v)}); set it to a value of that type.")
        self.model.validate()
        self._validate_data()
        if not self.stages:
            raise ConfigError("stages is empty; give at least one stage with seq_len, steps and lr.")
        for i, s in enumerate(self.stages):
            self._validate_stage(s, f"stages.{i}")
        _at_least("seed", self.seed, 0)
        if self.seed >= 2**63:
            raise ConfigError(f"seed ({_short(self.seed)}) must be below 2**63; pick a smaller seed.")
        if not self.out_dir.strip():
            raise ConfigError("out_dir is empty; set it to the folder for checkpoints and logs, e.g. runs/demo.")
        _check_path("out_dir", self.out_dir, home=False)
        _at_least("log_every", self.log_every, 1)
        _at_least("eval_every", self.eval_every, 0)
        _at_least("ckpt_every", self.ckpt_every, 0)
        _nonneg_float("weight_decay", self.weight_decay)
        _nonneg_float("grad_clip", self.grad_clip)
        if len(self.betas) != 2 or not all(_finite(b) and 0 <= b < 1 for b in self.betas):
            raise ConfigError(f"betas must be two numbers in [0, 1) (got {_short(self.betas)}); for example [0.9, 0.95].")
        _choice("dtype", self.dtype, DTYPES)
        _choice("device", self.device, DEVICES)
        _choice("backend", self.backend, BACKENDS)
        _choice("loss_impl", self.loss_impl, LOSS_IMPLS)
        _choice("residual_impl", self.residual_impl, RESIDUAL_IMPLS)
        _choice("indexer_kernel", self.indexer_kernel, INDEXER_KERNELS)
        _choice("kda_conv", self.kda_conv, KDA_CONVS)
        _choice("kda_norm", self.kda_norm, KDA_NORMS)
        _choice("norm_impl", self.norm_impl, NORM_IMPLS)
        _choice("swiglu_impl", self.swiglu_impl, SWIGLU_IMPLS)
        if self.data.tokenizer == "byte" and self.model.vocab_size < 256:
            raise ConfigError(
                f"model.vocab_size ({self.model.vocab_size}) is smaller than the byte tokenizer's 256 ids; "
                "set model.vocab_size=256 or more, or leave it unset so that a model preset sizes it to the tokenizer."
            )
        return self

    def _validate_data(self) -> None:
        d = self.data
        _check_types(d, "data")
        for name in ("tokenizer", "text_field"):
            if not getattr(d, name).strip():
                raise ConfigError(f"data.{name} is empty; set it (see --print-config for the default).")
        if d.path is not None and not d.path.strip():
            raise ConfigError("data.path is empty; set it to a text file, a folder, a .jsonl/.parquet or FASTA file, or leave it unset for the embedded corpus.")
        if d.path is not None:
            _check_path("data.path", d.path)
        if d.tokenizer != "byte":
            _check_path("data.tokenizer", d.tokenizer)
        _at_least("data.eval_docs", d.eval_docs, 0)
        _at_least("data.eval_windows", d.eval_windows, 0)
        for k, v in d.sources.items():
            if not isinstance(k, str) or k == MAIN_SOURCE or not k.strip():
                raise ConfigError(f"data.sources may not use the name {k!r} (\"main\" is data.path); rename that source.")
            if not isinstance(v, str) or not v.strip():
                raise ConfigError(f"data.sources.{k} must be a path (got {_short(v)}); set it to a text file or folder.")
            _check_path(f"data.sources.{k}", v)

    def _validate_stage(self, s: Stage, where: str) -> None:
        if not isinstance(s, Stage):
            raise ConfigError(f"{where} must be a table with seq_len, steps and lr (got {type(s).__name__}).")
        _check_types(s, where)
        _at_least(f"{where}.seq_len", s.seq_len, 1)
        _at_least(f"{where}.steps", s.steps, 1)
        _at_least(f"{where}.batch_size", s.batch_size, 1)
        _at_least(f"{where}.warmup", s.warmup, 0)
        if s.warmup > s.steps:
            raise ConfigError(f"{where}.warmup ({s.warmup}) is longer than {where}.steps ({s.steps}); lower the warmup.")
        if not (_finite(s.lr) and s.lr > 0):
            raise ConfigError(f"{where}.lr must be a positive number (got {_short(s.lr)}); for example 1e-3.")
        if not (_finite(s.min_lr_ratio) and 0 <= s.min_lr_ratio <= 1):
            raise ConfigError(f"{where}.min_lr_ratio must be in [0, 1] (got {_short(s.min_lr_ratio)}); for example 0.1.")
        _choice(f"{where}.schedule", s.schedule, SCHEDULES)
        if s.data_mix is not None:
            names = [MAIN_SOURCE, *self.data.sources]
            for k, w in s.data_mix.items():
                if not isinstance(k, str) or k not in names:
                    raise ConfigError(
                        f"{where}.data_mix names an unknown source {k!r}"
                        + (did_you_mean(str(k), names) or f"; use main (data.path) or a name from data.sources ({', '.join(names)}).")
                    )
                if isinstance(w, bool) or not isinstance(w, (int, float)) or not _finite(w) or w < 0:
                    raise ConfigError(f"{where}.data_mix.{k} must be a weight >= 0 (got {_short(w)}); for example 0.5.")
            if not s.data_mix or sum(s.data_mix.values()) <= 0:
                raise ConfigError(f"{where}.data_mix has no positive weight; give at least one source a weight > 0.")

    # ---------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_toml(self) -> str:
        """A TOML rendering for --print-config; it loads back with --config (TOML has no null,
        so unset values appear as comments)."""
        d = self.to_dict()
        lines = [f"# longctx training config: {self.summary()}"]
        if self.vocab_note:
            lines.append(f"# {self.vocab_note}")
        tables = ("model", "data", "stages")
        lines += _toml_items({k: v for k, v in d.items() if k not in tables})
        for t in ("model", "data"):
            lines += ["", f"[{t}]", *_toml_items(d[t])]
        for s in d["stages"]:
            lines += ["", "[[stages]]", *_toml_items(s)]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """Settings over the preset named by d["preset"] (default "small"), validated."""
        if not isinstance(d, dict):
            raise ConfigError(f"a training config must be a table of settings (got {type(d).__name__}); see --print-config.")
        _check_keys(d, "")
        known = [f.name for f in dataclasses.fields(cls)]
        _no_unknown(d, known, "")
        name = d.get("preset", "small")
        base = base_config(name)
        model_d = d.get("model", {})
        if not isinstance(model_d, dict):
            raise ConfigError(f"model must be a table of model settings (got {type(model_d).__name__}); e.g. [model] hidden_size = 256.")
        model = ModelConfig.from_dict({**base.model.to_dict(), **model_d})
        data_d = d.get("data", {})
        if not isinstance(data_d, dict):
            raise ConfigError(f"data must be a table of data settings (got {type(data_d).__name__}); e.g. [data] path = \"corpus/\".")
        _no_unknown(data_d, [f.name for f in dataclasses.fields(DataConfig)], "data.")
        data = DataConfig(**{**dataclasses.asdict(base.data), **data_d})
        stages = base.stages if d.get("stages") is None else _stages_from(d["stages"])
        rest = {k: v for k, v in d.items() if k not in ("model", "data", "stages", "preset")}
        note = None
        if name in MODEL_PRESETS and "vocab_size" not in model_d:
            model, note = _fit_vocab(model, name, data.tokenizer)
        cfg = dataclasses.replace(base, preset=name, model=model, data=data, stages=stages, **rest)
        cfg.vocab_note = note
        return cfg.validate()

    # ---------------------------------------------------------------- display
    def summary(self) -> str:
        st = " -> ".join(f"{s.seq_len} x {s.batch_size} for {s.steps} steps" for s in self.stages)
        return f"preset {self.preset}; data {self.data.path or 'embedded stdlib corpus'} ({self.data.tokenizer}); stages {st}"

    def total_steps(self) -> int:
        return sum(s.steps for s in self.stages)


# ------------------------------------------------------------------------------ presets
def _h200_curriculum() -> TrainConfig:
    # 8K -> 64K -> 256K -> 1M on the h200-ref model (seed 001 §5.1); the lead tunes steps and lr.
    return TrainConfig(
        model=model_preset("h200-ref"), preset="h200-curriculum",
        stages=[
            Stage(seq_len=8192, steps=400, lr=3e-4, warmup=100),
            Stage(seq_len=65536, steps=200, lr=2e-4, warmup=20),
            Stage(seq_len=262144, steps=100, lr=1e-4, warmup=10),
            Stage(seq_len=1048576, steps=50, lr=5e-5, warmup=5),
        ],
        out_dir="runs/h200-curriculum", log_every=1, eval_every=50, ckpt_every=50,
        dtype="bfloat16", device="cuda",
    )


TRAIN_PRESETS = {"h200-curriculum": _h200_curriculum}


def preset_names() -> list[str]:
    return [*MODEL_PRESETS, *TRAIN_PRESETS]


def _check_preset_name(name) -> None:
    if not isinstance(name, str):
        raise ConfigError(f"preset must be a preset name (got {type(name).__name__} {_short(name)}); choose one of {', '.join(preset_names())}.")
    if name not in MODEL_PRESETS and name not in TRAIN_PRESETS:
        raise ConfigError(f"unknown preset {name!r}{did_you_mean(name, preset_names()) or '; choose one of ' + ', '.join(preset_names()) + '.'}")


def _preset_model(name) -> ModelConfig:
    _check_preset_name(name)
    return model_preset(name) if name in MODEL_PRESETS else TRAIN_PRESETS[name]().model


def _fit_vocab(model: ModelConfig, name: str, tokenizer) -> tuple[ModelConfig, str | None]:
    """A model preset's model with its own vocabulary, or the tokenizer's when the preset has fewer ids
    (tiny's 97 < the byte tokenizer's 256), and the note that says so: every model preset trains on any
    data with no model.vocab_size setting. A larger vocabulary is kept (glm-5.3-flash's pad token and
    the h200-ref embedding sizes are part of those models). Only for a vocabulary the user did not set."""
    own = MODEL_PRESETS[name]().vocab_size
    n = _tokenizer_ids(tokenizer)
    if n is None or n <= own:
        return dataclasses.replace(model, vocab_size=own), None
    tok = "byte" if tokenizer == "byte" else repr(tokenizer)
    return dataclasses.replace(model, vocab_size=n), f"model.vocab_size = {n}: sized to the {tok} tokenizer (the {name} preset has {own})"


def _tokenizer_ids(spec) -> int | None:
    """The number of ids of data.tokenizer, or None when it cannot be read here (the trainer names the
    problem when it loads the tokenizer)."""
    if spec == "byte":
        return 256
    if not isinstance(spec, str) or not spec.strip():
        return None
    from ..errors import UserError

    try:
        from ..data.tokenizers import load_tokenizer

        return load_tokenizer(spec).vocab_size
    except (UserError, OSError, RuntimeError, ValueError):  # RuntimeError: "~nouser/..." has no home
        return None


def base_config(name) -> TrainConfig:
    """The config a preset name starts from: a training preset as is, or a model preset with the demo's
    training settings."""
    _check_preset_name(name)
    return TRAIN_PRESETS[name]() if name in TRAIN_PRESETS else TrainConfig(preset=name)


def _stages_from(raw) -> list[Stage]:
    if not isinstance(raw, list):
        raise ConfigError(f"stages must be a list of tables (got {type(raw).__name__}); in TOML write [[stages]] blocks.")
    out = []
    known = [f.name for f in dataclasses.fields(Stage)]
    required = [f.name for f in dataclasses.fields(Stage) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for i, s in enumerate(raw):
        if not isinstance(s, dict):
            raise ConfigError(f"stages.{i} must be a table with seq_len, steps and lr (got {type(s).__name__} {_short(s)}).")
        _no_unknown(s, known, f"stages.{i}.")
        missing = [k for k in required if k not in s]
        if missing:
            raise ConfigError(f"stages.{i} is missing {', '.join(missing)}; give every stage seq_len, steps and lr.")
        out.append(Stage(**s))
    return out


# ------------------------------------------------------------------------------ loading
def load_train_config(config_file: str | None = None, preset: str | None = None, sets: list[str] | tuple = ()) -> TrainConfig:
    """The config from a preset, an optional TOML/YAML/JSON file and `--set key=value` overrides."""
    raw = _read_config_file(config_file) if config_file else {}
    _check_keys(raw, "")
    pairs = [_split_set(s) for s in sets]
    name = raw.pop("preset", None)
    if preset is not None:
        name = preset
    for k, v in pairs:
        if k == "preset":
            name = v
    name = "small" if name is None else name
    d = base_config(name).to_dict()
    if name in MODEL_PRESETS:  # sized to data.tokenizer as resolved below, unless the file or --set gives it
        del d["model"]["vocab_size"]
    _merge(d, raw)
    d["preset"] = name
    for k, v in pairs:
        if k != "preset":
            _assign(d, k, v)
    return TrainConfig.from_dict(d)


def _read_config_file(path: str) -> dict:
    try:
        p = Path(path).expanduser()
    except RuntimeError:
        raise ConfigError(f"config file {path!r} starts with the home folder of a user this machine does not have; "
                          "write the path out in full.") from None
    if not p.is_file():
        raise ConfigError(f"config file '{path}' does not exist; pass the path of a .toml, .yaml or .json file to --config.")
    suffix = p.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise ConfigError(f"config file '{path}' must end in .toml, .yaml, .yml or .json; rename it to say its format.")
    try:
        text = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as e:
        raise ConfigError(f"config file '{path}' could not be read as UTF-8 text ({e}); save it as UTF-8.") from e
    if suffix == ".toml":
        toml = _tomllib()
        if toml is None:
            raise ConfigError(f"config file '{path}' is TOML, which needs the tomli package on Python 3.10; `pip install tomli` or write it as YAML.")
        try:
            data = toml.loads(text)
        except Exception as e:  # TOMLDecodeError says "(at line L, column C)"
            raise ConfigError(f"config file '{path}' is not valid TOML ({e}); fix the syntax there.") from e
    elif suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file '{path}' is not valid JSON (line {e.lineno}: {e.msg}); fix the syntax there.") from e
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except Exception as e:  # YAMLError, or a Python error from an odd construct
            mark = getattr(e, "problem_mark", None)
            at = f"line {mark.line + 1}: " if mark is not None else ""
            what = getattr(e, "problem", None) or (str(e).splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"config file '{path}' is not valid YAML ({at}{what}); fix the syntax there.") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a table of settings at the top (got {type(data).__name__}); see --print-config.")
    return data


def _tomllib():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            return None
    return tomllib


def _split_set(s) -> tuple[str, object]:
    if not isinstance(s, str) or "=" not in s or not s.split("=", 1)[0].strip():
        raise ConfigError(f"--set {_short(s)} is not key=value; write it like --set model.hidden_size=256.")
    key, text = s.split("=", 1)
    key = key.strip()
    return key, (_coerce_str(key, text, _parse_value(text)))


def _parse_value(text: str):
    """A TOML scalar/array/inline table, else null, else a plain number, else the text itself."""
    t = text.strip()
    toml = _tomllib()
    if toml is not None:
        try:
            parsed = toml.loads(f"v = {t}")
            if list(parsed) == ["v"]:  # not "1\nx = 2" smuggling in a second key
                return parsed["v"]
        except Exception:
            pass
    if t.lower() in ("null", "none", "~"):
        return None
    if re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", t):
        return float(t) if re.search(r"[.eE]", t) else int(t)
    if toml is None:  # Python 3.10 without tomli: YAML flow syntax for true/false and [lists]
        import yaml

        try:
            v = yaml.safe_load(t)
            if isinstance(v, (bool, list, dict)):
                return v
        except Exception:
            pass
    return t


def _coerce_str(key: str, text: str, value):
    """For a text setting (a path, a name), keep what was typed: data.path=2024 means the folder "2024"."""
    tp = _field_type(key.split("."))
    if tp is not None and value is not None and not isinstance(value, str):
        args = typing.get_args(tp) or (tp,)
        if str in args and all(a in (str, type(None)) for a in args):
            return text.strip()
    return value


def _field_type(parts: list[str]):
    """The annotation of the setting a dotted --set key names, or None when it names no field."""
    cls, i = TrainConfig, 0
    while True:
        hints = typing.get_type_hints(cls)
        if parts[i] not in hints:
            return None
        if i == len(parts) - 1:
            return hints[parts[i]]
        if cls is TrainConfig and parts[i] in ("model", "data"):
            cls, i = (ModelConfig if parts[i] == "model" else DataConfig), i + 1
        elif cls is TrainConfig and parts[i] == "stages" and parts[i + 1].isdigit() and i + 2 < len(parts):
            cls, i = Stage, i + 2
        elif cls is DataConfig and parts[i] == "sources" and i + 2 == len(parts):
            return str
        else:
            return None


def _merge(base: dict, over: dict) -> None:
    """Tables merge key by key; lists (stages) and values replace."""
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


def _assign(d: dict, key: str, value) -> None:
    parts = key.split(".")
    if any(not p.strip() for p in parts):
        raise ConfigError(f"--set {key!r} has an empty name part; write dotted names like model.hidden_size=256.")
    node, path = d, []
    for p in parts[:-1]:
        path.append(p)
        if isinstance(node, dict):
            if not isinstance(node.get(p), (dict, list)):
                if p in node and node[p] is not None:
                    raise ConfigError(f"{'.'.join(path)} is a single value, not a table; use --set {'.'.join(path)}=VALUE.")
                node[p] = {}
            node = node[p]
        else:
            idx = _index(node, p, path, key)
            if idx == len(node):
                node.append({})
            node = node[idx]
            if not isinstance(node, (dict, list)):
                raise ConfigError(f"{'.'.join(path)} is a single value, not a table; use --set {'.'.join(path)}=VALUE.")
    last = parts[-1]
    if isinstance(node, dict):
        node[last] = value
    else:
        idx = _index(node, last, [*path, last], key)
        if idx == len(node):
            node.append(value)
        else:
            node[idx] = value


def _index(node: list, p: str, path: list[str], key: str) -> int:
    where = ".".join(path[:-1])
    if not p.isdigit():
        raise ConfigError(f"--set {key}: {where} is a list, so the next part must be an index 0..{len(node)} (got {p!r}).")
    idx = int(p)
    if idx > len(node):
        raise ConfigError(
            f"--set {key}: {where} has {len(node)} entries ({where}.0 .. {where}.{len(node) - 1}); "
            f"use one of those, or {where}.{len(node)} to add one."
        )
    return idx


# ------------------------------------------------------------------------------ small checks
def _check_keys(obj, where: str) -> None:
    """YAML allows non-text keys (1: 2, null: x); settings are always named by text."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise ConfigError(f"setting names must be text, but {where or 'the top level'} has the key {_short(k)}; quote it or remove it.")
            _check_keys(v, f"{where}{k}.")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _check_keys(v, f"{where}{i}.")


def _no_unknown(d: dict, known: list[str], prefix: str) -> None:
    for k in d:
        if k not in known:
            hint = did_you_mean(prefix + k, [prefix + n for n in known]) or "; see --print-config for the settings."
            raise ConfigError(f"unknown setting {prefix}{k}{hint}")


def _finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (OverflowError, TypeError, ValueError):
        return False


def _check_path(name: str, v: str, home: bool = True) -> None:
    """A path no file system refuses outright: no NUL, and (for the paths the readers expand) a leading
    ~user that names a user of this machine."""
    if "\0" in v:
        raise ConfigError(f"{name} {_short(v)} has a NUL character, which no path can hold; set it to a real path.")
    if home and v.startswith("~"):
        try:
            Path(v).expanduser()
        except RuntimeError:
            raise ConfigError(f"{name} {_short(v)} starts with the home folder of a user this machine does not have; "
                              "write the path out in full.") from None


def _at_least(name: str, v: int, lo: int) -> None:
    if v < lo:
        raise ConfigError(f"{name} must be >= {lo} (got {_short(v)}); set it to {'a positive' if lo > 0 else 'a non-negative'} integer.")


def _nonneg_float(name: str, v: float) -> None:
    if not (_finite(v) and v >= 0):
        raise ConfigError(f"{name} must be a finite number >= 0 (got {_short(v)}); set it to a non-negative number.")


def _choice(name: str, v: str, allowed) -> None:
    if v not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)} (got {v!r}){did_you_mean(v, allowed) or '.'}")


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


# ------------------------------------------------------------------------------ TOML writer
_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(k: str) -> str:
    return k if _BARE.match(k) else _toml_str(k)


def _toml_str(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v if x is not None) + "]"
    if isinstance(v, dict):
        items = [f"{_toml_key(str(k))} = {_toml_value(x)}" for k, x in v.items() if x is not None]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    return _toml_str(str(v))


def _toml_items(d: dict) -> list[str]:
    return [f"# {_toml_key(k)} = (unset)" if v is None else f"{_toml_key(k)} = {_toml_value(v)}" for k, v in d.items()]
