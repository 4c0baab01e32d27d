"""The training run's configuration: typed dataclasses (`TrainConfig`, `Stage`, `DataConfig`), their
validation, and the training presets. `longctx.config.loading` reads one from a preset, a file and
`--set` overrides, and writes one back as TOML.

Every mistake is a `ConfigError` whose one sentence names the setting and the fix; nothing else escapes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .kernels import KernelConfig, check_replaced
from .model import PRESETS as MODEL_PRESETS, ModelConfig, _check_types, _is_instance, _type_name
from .model import preset as model_preset
from .parallel import ParallelConfig
from ..errors import ConfigError, did_you_mean

DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
SCHEDULES = ("cosine", "linear", "constant")
TASKS = ("pretrain", "sft", "rl")
OLD_LOGPROBS = ("trainer", "rollout")  # what an RL update's ratio divides by (RLConfig.old_logprobs)
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


@dataclass
class SFTConfig:
    """Supervised fine-tuning on conversations (task = "sft"; longctx.train.sft, docs/design/post_training.md).

    data.path: conversations (.jsonl or .parquet, or a folder of them; the messages under
    `messages_field`), data.eval_docs of them held out; None = the embedded retrieval task.
    template: "auto" (the byte tokenizer's longctx template, or a HF tokenizer's own), "longctx", or a
    .jinja file. The task's settings: `questions` per haystack, the question `kinds`, `ask_first` (the
    first user turn states every question before the haystack too, as a user states the task before
    the files are read), `min_len` (the shortest training conversation; a stage shorter than it trains
    at its own length), and its held-out
    evaluation: `eval_examples` per length in `eval_lengths` ([] = 4096 and its doublings up to the
    longest stage, or the longest stage when that is shorter than 4096).
    """

    template: str = "auto"
    messages_field: str = "messages"
    questions: int = 4
    kinds: list[str] = field(default_factory=lambda: ["signature", "returns", "file"])
    ask_first: bool = False
    min_len: int = 4096
    eval_lengths: list[int] = field(default_factory=list)
    eval_examples: int = 16


@dataclass
class RLConfig:
    """Reinforcement learning with group-relative advantages (task = "rl"; longctx.train.rl,
    docs/design/post_training.md). A stage's batch_size is the prompts per step, each sampled `group`
    times; the task, the template and the held-out evaluation are the `sft` settings'.

    reward: "module:function" or "path/to/file.py:function", called as f(completion, answer) -> float.
    Advantages: (r - group mean) / (group std + 1e-4). Loss: the PPO-clipped ratio (`clip`), token
    mean over the batch's completions, plus `kl_coef` x the k3 estimate of the KL to the frozen starting
    policy (0: no reference model). `updates` optimizer steps per rollout batch; `old_logprobs` is what
    the ratio divides by: "trainer" (the trainer's own log-probs before the batch's first update, so
    that update's ratio is exactly 1) or "rollout" (the sampler's). Sampling: temperature (> 0),
    top_p, top_k (0: all), max_new_tokens, stop strings (the template's stop token always stops).
    rollouts: a .jsonl of rollouts from another engine, trained on instead of sampling. save_rollouts:
    write each step's rollouts to OUT/rollouts.jsonl in that format. export_every: write the policy in
    the transformers layout to OUT/policy every N steps (0: never). micro_batch: sequences per
    forward and backward (0: all of a step's at once). replay_routing: the training forward sends each
    token to the experts the sampler chose for it (recorded while sampling; not for a rollouts file's), so
    the ratio compares one function's log-probs, not two routings' (MoE models; bf16 flips near-tied router
    scores between the decode step and the training forward).
    """

    group: int = 4
    reward: str = "longctx.data.retrieval_task:exact_match"
    clip: float = 0.2
    kl_coef: float = 0.0
    updates: int = 1
    old_logprobs: str = "trainer"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 96
    stop: list[str] = field(default_factory=list)
    rollouts: str | None = None
    save_rollouts: bool = False
    export_every: int = 0
    micro_batch: int = 0
    replay_routing: bool = True


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

    `kernels` (the [kernels] table, longctx.config.kernels) says which backend runs each op: it changes
    how, not what, the model computes. `parallel` (longctx.config.parallel) says how the processes of a
    torchrun launch split the work; a stage's batch_size is the global batch at any world size.

    `init_from` starts the run from a checkpoint's weights instead of random ones: a transformers
    GLM-5.3-Flash folder, a longctx checkpoint folder or a run folder. The model is then the
    checkpoint's (its config.json as transformers reads it, or its longctx_config.json), whatever the
    preset; model settings the run gives are laid over it and must agree with it, except the few that
    say how to train it (longctx.distributed.loading.TRAINING_FIELDS); the trainer checks that, as it
    reads the checkpoint's config. The preset still gives the training settings.
    """

    model: ModelConfig | None = None  # None = the preset's model
    preset: str = "small"
    init_from: str | None = None  # a checkpoint to start from; None = random weights
    data: DataConfig = field(default_factory=DataConfig)
    task: str = "pretrain"  # "sft": supervised fine-tuning on conversations (the `sft` settings); "rl" (the `rl` settings)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rl: RLConfig = field(default_factory=RLConfig)  # task = "rl": the RL settings
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
    kernels: KernelConfig = field(default_factory=KernelConfig)  # which backend runs each op
    memory: dict = field(default_factory=dict)  # the memory plan; validated by the memory system
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # how torchrun's processes share the work
    cuda_alloc: str = "expandable_segments:True"  # CUDA allocator settings (longctx.memory.allocator); "" = torch's

    # One line for --print-config and the run's model line when a model preset's vocabulary is raised to
    # the tokenizer's (not a field: it describes how the config was resolved, not a setting).
    vocab_note = None
    # The model settings the user gave (names), which `init_from` lays over the checkpoint's model; None:
    # every field of `model` counts as given (a model passed whole, or a run's saved config). Not a field,
    # like vocab_note: it says where the values came from.
    model_given = None

    def __post_init__(self):
        if self.model is None:
            self.model_given = frozenset()
            self.model = preset_model(self.preset)
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
        _choice("task", self.task, TASKS)
        self._validate_sft()
        self._validate_rl()
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
        if self.init_from is not None:
            _check_init_from(self.init_from)
        _at_least("log_every", self.log_every, 1)
        _at_least("eval_every", self.eval_every, 0)
        _at_least("ckpt_every", self.ckpt_every, 0)
        _nonneg_float("weight_decay", self.weight_decay)
        _nonneg_float("grad_clip", self.grad_clip)
        if len(self.betas) != 2 or not all(_finite(b) and 0 <= b < 1 for b in self.betas):
            raise ConfigError(f"betas must be two numbers in [0, 1) (got {_short(self.betas)}); for example [0.9, 0.95].")
        _choice("dtype", self.dtype, DTYPES)
        _choice("device", self.device, DEVICES)
        self.kernels.validate()
        self.parallel.validate()
        self.parallel.check_model(self.model)
        # the memory system checks its settings when a stage starts; a count of blocks that the model does not
        # have is said now, not after the stages before it have trained
        for where, mem in [("memory", self.memory), *((f"stages.{i}.memory", s.memory) for i, s in enumerate(self.stages))]:
            check_recompute_count((mem or {}).get("recompute"), self.model.num_layers, f"{where}.recompute")
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

    def _validate_sft(self) -> None:
        s = self.sft
        _check_types(s, "sft")
        for name in ("template", "messages_field"):
            if not getattr(s, name).strip():
                raise ConfigError(f"sft.{name} is empty; set it (see --print-config for the default).")
        if s.template not in ("auto", "longctx"):
            _check_path("sft.template", s.template)
        _at_least("sft.questions", s.questions, 1)
        _at_least("sft.min_len", s.min_len, 64)
        _at_least("sft.eval_examples", s.eval_examples, 0)
        from ..data.retrieval_task import KINDS  # the embedded task's questions (torch-free, as config is)

        if not s.kinds:
            raise ConfigError(f"sft.kinds is empty; give some of {', '.join(KINDS)}.")
        for k in s.kinds:
            if k not in KINDS:
                raise ConfigError(f"sft.kinds has the unknown kind {k!r}"
                                  + (did_you_mean(str(k), KINDS) or f"; choose from {', '.join(KINDS)}."))
        for L in s.eval_lengths:
            if isinstance(L, bool) or not isinstance(L, int) or L < 256:
                raise ConfigError(f"sft.eval_lengths has {_short(L)}; give lengths in tokens, each >= 256.")

    def _validate_rl(self) -> None:
        r = self.rl
        _check_types(r, "rl")
        if r.group < 2:
            raise ConfigError(f"rl.group must be >= 2 (got {_short(r.group)}); group-relative advantages compare "
                              "several completions of one prompt, e.g. rl.group = 4.")
        if not (_finite(r.clip) and r.clip > 0):
            raise ConfigError(f"rl.clip must be a positive number (got {_short(r.clip)}); for example 0.2.")
        _nonneg_float("rl.kl_coef", r.kl_coef)
        _at_least("rl.updates", r.updates, 1)
        _choice("rl.old_logprobs", r.old_logprobs, OLD_LOGPROBS)
        if not (_finite(r.temperature) and r.temperature > 0):
            raise ConfigError(f"rl.temperature must be a number > 0 (got {_short(r.temperature)}); RL samples its "
                              "completions (greedy ones would all be alike), e.g. 1.0.")
        if not (_finite(r.top_p) and 0 < r.top_p <= 1):
            raise ConfigError(f"rl.top_p must be in (0, 1] (got {_short(r.top_p)}); 1.0 keeps every id.")
        _at_least("rl.top_k", r.top_k, 0)
        _at_least("rl.max_new_tokens", r.max_new_tokens, 1)
        _at_least("rl.export_every", r.export_every, 0)
        _at_least("rl.micro_batch", r.micro_batch, 0)
        for x in r.stop:
            if not isinstance(x, str) or not x:
                raise ConfigError(f"rl.stop has {_short(x)}; give stop strings, each non-empty.")
        module, sep, fn = r.reward.rpartition(":")
        if not sep or not module.strip() or not fn.strip().isidentifier():
            raise ConfigError(f"rl.reward {r.reward!r} is not MODULE:FUNCTION or FILE.py:FUNCTION; for example "
                              "\"longctx.data.retrieval_task:exact_match\".")
        if r.rollouts is not None:
            if not r.rollouts.strip():
                raise ConfigError("rl.rollouts is empty; set it to a .jsonl file of rollouts, or leave it unset to sample them.")
            _check_path("rl.rollouts", r.rollouts)
        if self.task == "rl" and self.data.path is not None and r.rollouts is None:
            raise ConfigError("task = rl draws its prompts from the embedded retrieval task, or takes rollouts from "
                              "rl.rollouts; unset data.path, or give the rollouts of your prompts in rl.rollouts.")

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

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """Settings over the preset named by d["preset"] (default "small"), validated."""
        if not isinstance(d, dict):
            raise ConfigError(f"a training config must be a table of settings (got {type(d).__name__}); see --print-config.")
        _check_keys(d, "")
        check_replaced(d)
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
        sft_d = d.get("sft", {})
        if not isinstance(sft_d, dict):
            raise ConfigError(f"sft must be a table of SFT settings (got {type(sft_d).__name__}); e.g. [sft] questions = 4.")
        _no_unknown(sft_d, [f.name for f in dataclasses.fields(SFTConfig)], "sft.")
        sft = SFTConfig(**{**dataclasses.asdict(base.sft), **sft_d})
        rl_d = d.get("rl", {})
        if not isinstance(rl_d, dict):
            raise ConfigError(f"rl must be a table of RL settings (got {type(rl_d).__name__}); e.g. [rl] group = 4.")
        _no_unknown(rl_d, [f.name for f in dataclasses.fields(RLConfig)], "rl.")
        rl = RLConfig(**{**dataclasses.asdict(base.rl), **rl_d})
        stages = base.stages if d.get("stages") is None else _stages_from(d["stages"])
        kernels_d = d.get("kernels", {})
        kernels = KernelConfig.from_dict({**base.kernels.to_dict(), **kernels_d} if isinstance(kernels_d, dict) else kernels_d)
        parallel_d = d.get("parallel", {})
        parallel = ParallelConfig.from_dict({**base.parallel.to_dict(), **parallel_d} if isinstance(parallel_d, dict)
                                            else parallel_d)
        rest = {k: v for k, v in d.items() if k not in ("model", "data", "sft", "rl", "stages", "preset", "kernels", "parallel")}
        note = None
        if name in MODEL_PRESETS and "vocab_size" not in model_d:
            model, note = _fit_vocab(model, name, data.tokenizer)
        cfg = dataclasses.replace(base, preset=name, model=model, data=data, sft=sft, rl=rl, stages=stages, kernels=kernels,
                                  parallel=parallel, **rest)
        cfg.vocab_note = note
        return cfg.validate()

    # ---------------------------------------------------------------- display
    def summary(self) -> str:
        st = " -> ".join(f"{s.seq_len} x {s.batch_size} for {s.steps} steps" for s in self.stages)
        if self.task == "sft":
            data = f"sft on {self.data.path or 'the embedded retrieval task'}"
        elif self.task == "rl":
            data = f"rl on {self.rl.rollouts or 'the embedded retrieval task'}"
        else:
            data = f"data {self.data.path or 'embedded stdlib corpus'}"
        return f"preset {self.preset}; {data} ({self.data.tokenizer}); stages {st}"

    def total_steps(self) -> int:
        return sum(s.steps for s in self.stages)


# ------------------------------------------------------------------------------ presets
def _h200_curriculum() -> TrainConfig:
    # 8K -> 64K -> 256K -> 1M tokens on the h200-ref model, each stage a few times shorter than the last.
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


def _sft_retrieval() -> TrainConfig:
    # The CPU SFT run of the embedded task (bench/sft_retrieval.py) that `rl-retrieval` starts from
    # (init_from=runs/sft): the small model from scratch on signature questions. Short haystacks, where an
    # answer costs the fewest tokens, four to a step (for the same tokens, more and smaller steps learn to
    # copy sooner than 16 to a step); then 256-512 tokens as the learning rate decays. Scored from 256 to
    # 4096 tokens, past what it trained on.
    return TrainConfig(
        model=model_preset("small"), preset="sft-retrieval", task="sft",
        sft=SFTConfig(questions=2, kinds=["signature"], min_len=256, eval_lengths=[256, 512, 1024, 2048, 4096],
                      eval_examples=16),
        stages=[Stage(seq_len=256, steps=900, lr=2e-3, batch_size=4, warmup=20, schedule="constant"),
                Stage(seq_len=512, steps=300, lr=2e-3, batch_size=2, schedule="linear")],
        out_dir="runs/sft", log_every=50,
    )


def _rl_retrieval() -> TrainConfig:
    # The CPU demonstration of RL: an SFT checkpoint of the small model (init_from) on the embedded task's
    # signature questions, haystacks of 256 to 512 tokens (80 new tokens hold the longest answer), 6 prompts
    # x 8 completions a step; the held-out exact match at 256, 512 and 1024 tokens. About 12 minutes on 2 cores.
    # AdamW's first steps move every weight by about lr whatever its gradient, so the rate is small: at 1e-3,
    # RL on four fixed prompts raised their reward in one step and by the fifth had undone SFT's copying.
    return TrainConfig(
        model=model_preset("small"), preset="rl-retrieval", task="rl",
        sft=SFTConfig(questions=2, kinds=["signature"], min_len=256, eval_lengths=[256, 512, 1024], eval_examples=16),
        rl=RLConfig(group=8, temperature=1.0, max_new_tokens=80),
        stages=[Stage(seq_len=592, steps=40, lr=1e-4, batch_size=6, schedule="constant")],
        out_dir="runs/rl", log_every=1,
    )


TRAIN_PRESETS = {"h200-curriculum": _h200_curriculum, "sft-retrieval": _sft_retrieval, "rl-retrieval": _rl_retrieval}


def preset_names() -> list[str]:
    return [*MODEL_PRESETS, *TRAIN_PRESETS]


def _check_preset_name(name) -> None:
    if not isinstance(name, str):
        raise ConfigError(f"preset must be a preset name (got {type(name).__name__} {_short(name)}); choose one of {', '.join(preset_names())}.")
    if name not in MODEL_PRESETS and name not in TRAIN_PRESETS:
        raise ConfigError(f"unknown preset {name!r}{did_you_mean(name, preset_names()) or '; choose one of ' + ', '.join(preset_names()) + '.'}")


def preset_model(name) -> ModelConfig:
    """The model a preset name trains: a model preset's own, or a training preset's."""
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


def _check_init_from(v: str) -> None:
    """A folder that holds a checkpoint of some kind; which kind, and whether it fits, the trainer reads."""
    fix = ("point it at a transformers GLM-5.3-Flash folder, a longctx checkpoint or a run folder, or leave it "
           "unset to start from random weights")
    if not v.strip():
        raise ConfigError(f"init_from is empty; {fix}.")
    _check_path("init_from", v)
    p = Path(v).expanduser()
    if not p.exists():
        raise ConfigError(f"init_from {v!r} does not exist; {fix}.")
    if not p.is_dir() or not any((p / n).exists() or (p / n).is_symlink()
                                 for n in ("config.json", "longctx_config.json", "checkpoint")):
        raise ConfigError(f"init_from {v!r} is not a checkpoint folder (no config.json, longctx_config.json "
                          f"or checkpoint link in it); {fix}.")


def check_recompute_count(n, num_layers: int, name: str = "memory.recompute") -> None:
    """`memory.recompute` as a number of blocks (the first N recompute) must not pass the model's blocks."""
    if isinstance(n, (int, str)) and not isinstance(n, bool) and str(n).isdigit() and int(n) > num_layers:
        raise ConfigError(f"{name} = {n} names more blocks than the model's {num_layers}; "
                          f"use a number up to {num_layers}, or on.")


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
