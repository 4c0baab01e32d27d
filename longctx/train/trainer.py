"""The training loop: curriculum stages, logging, evaluation, checkpoints, resume.

    longctx train                      # the CPU demo: small model, stdlib corpus, 1k -> 4k tokens
    longctx train --preset h200-curriculum --out runs/h200

One short line per step (`progress.step_line`: step N/total, loss, tokens/s, time left, peak memory,
then stage, sequence length, grad norm and MoE balance) and a `kernels:` line whenever the kernels
the layers ran change; metrics.jsonl always, TensorBoard when installed (and a note when it is not).
Held-out per-position loss before and after training; PNG plots; atomic checkpoints (periodic, at
the end of each stage, and at the step boundary after a SIGINT or SIGTERM). A resumed run takes
the run's saved config and continues the data stream, optimizer, RNG, router balancing state and
the stage's memory plan exactly, so its loss curve equals the uninterrupted one.

Under torchrun (WORLD_SIZE > 1) the run is sharded over a (dp, cp) mesh (the `parallel` settings):
FSDP2 per block, each dp rank taking its rows of the stage's global batch and each cp rank its zigzag
chunks of every row, each rank's loss its share of the global mean, MoE statistics over all ranks'
tokens, checkpoints through torch.distributed.checkpoint; rank 0 alone prints and writes the run files.
A checkpoint resumes by its format at any world size. Workers that torchrun restarts (--max-restarts)
resume from the run's last checkpoint by themselves (`Trainer._restarted`, OUT/torchrun_job).
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import shlex
import shutil
import signal
import sys
import threading
import time

import torch

from .. import checkpoint as ckpt
from ..data.packing import MixedStream, PackedStream, eval_windows
from ..data.sources import load_documents, load_split
from ..data.tokenizers import load_tokenizer, separator_id, tokenize_documents
from ..errors import ConfigError, UserError
from .evaluate import format_table, per_position_loss
from .progress import Eta, TensorBoard, step_line
from ..memory import allocator
from ..kernels import apply_kernels
from ..model import LongCtxModel
from ..config.train import TrainConfig
from ..devices import resolve_device, resolve_dtype


def lr_at(stage, step_in_stage: int) -> float:
    if stage.warmup and step_in_stage < stage.warmup:
        return stage.lr * (step_in_stage + 1) / stage.warmup
    span = max(1, stage.steps - stage.warmup)
    frac = min(1.0, (step_in_stage - stage.warmup) / span)
    lo = stage.lr * stage.min_lr_ratio
    if stage.schedule == "constant":
        return stage.lr
    if stage.schedule == "linear":
        return stage.lr - (stage.lr - lo) * frac
    return lo + 0.5 * (stage.lr - lo) * (1 + math.cos(math.pi * frac))


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "router" not in n else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    extra = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=cfg.stages[0].lr, betas=tuple(cfg.betas), **extra)


# ---------------------------------------------------------------------- the run folder
JOB_FILE = "torchrun_job"  # which torchrun job writes the run (see `Trainer._restarted`)
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "loss.png", "per_position_loss.png", "accuracy.png", JOB_FILE,
             "reward.png", "rollouts.jsonl", "policy.json")  # the last three: task = rl's
TB_DIR = "tb"  # TensorBoard's event files (events.out.tfevents.*)


class RunFolderError(UserError):
    """An output folder that holds a run where none is expected, or none where --resume needs one."""


def _is_checkpoint_dir(name: str) -> bool:
    return ckpt.step_of_name(name.removesuffix(".partial")) is not None


def run_markers(out: str) -> list[str]:
    """What in `out` says a run lives there: its config, metrics, checkpoint link or checkpoints."""
    if not os.path.isdir(out):
        return []
    names = sorted(os.listdir(out))
    return ([n for n in ("config.json", "metrics.jsonl") if n in names]
            + ([ckpt.LINK] if os.path.lexists(os.path.join(out, ckpt.LINK)) else [])
            + [n for n in names if _is_checkpoint_dir(n)])


def clear_run(out: str) -> list[str]:
    """Delete what a run writes into `out`, and nothing else: the ckpt-<step> folders (whole or
    .partial), the checkpoint link, config.json, metrics.jsonl, summary.json, the two plots, the
    torchrun job file and the TensorBoard event files in tb/ (tb/ itself when that leaves it empty).
    Returns what it removed."""
    if not os.path.isdir(out):
        return []
    removed = []
    for n in sorted(os.listdir(out)):
        p = os.path.join(out, n)
        if _is_checkpoint_dir(n) and os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        elif n in (ckpt.LINK, ckpt.LINK + ".new") and os.path.islink(p):
            os.remove(p)
        elif n in RUN_FILES and os.path.isfile(p):
            os.remove(p)
        else:
            continue
        removed.append(n)
    tb = os.path.join(out, TB_DIR)
    if os.path.isdir(tb) and not os.path.islink(tb):
        events = [n for n in os.listdir(tb) if n.startswith("events.out.tfevents.")]
        for n in events:
            os.remove(os.path.join(tb, n))
        if events:
            removed.append(f"{TB_DIR}/events.out.tfevents.* ({len(events)})")
        if not os.listdir(tb):
            os.rmdir(tb)
    return removed


def check_out_dir(out: str, resume: bool, force: bool) -> None:
    """Refuse a fresh run over an existing one (unless `force`), and a resume where no run is."""
    if resume and force:
        raise RunFolderError("--resume and --force contradict each other (continue the run, or delete it and start "
                             "afresh); pass only one of them.")
    held = run_markers(out)
    if resume and not held:
        raise RunFolderError(f"--resume: --out {out} holds no run (no config.json or checkpoint there); check the "
                             "folder, or drop --resume to start a run in it.")
    if not resume and held and not force:
        raise RunFolderError(f"--out {out} already holds a run ({', '.join(held[:4])}); pass --resume to continue "
                             "it, or --force to start afresh (deleting its checkpoints, metrics, config, plots and "
                             "TensorBoard events).")


# ---------------------------------------------------------------------- restarts (torchrun --max-restarts)
def restart_count() -> int:
    """How many times torchrun has restarted this node's workers (0 outside torchrun)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def torchrun_job() -> str | None:
    """This torchrun job as rank 0 sees it: the rendezvous id, the host and the agent process (this
    worker's parent, with its start time), which outlives the job's restarts and no longer. None
    outside torchrun. The id alone would not do: without --standalone or --rdzv-id it is "none" for
    every job."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    import socket

    agent, started = os.getppid(), ""
    try:
        with open(f"/proc/{agent}/stat") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]  # field 22, the start time in clock ticks
    except (OSError, IndexError):
        pass
    return f"{run_id} {socket.gethostname()} {agent} {started}"


def job_file_is_ours(out: str) -> bool:
    """Whether OUT/torchrun_job names this process's torchrun job (as rank 0 wrote it)."""
    job = torchrun_job()
    try:
        with open(os.path.join(out, JOB_FILE)) as f:
            return job is not None and f.read().strip() == job
    except OSError:
        return False


# ---------------------------------------------------------------------- interruptions
class Interrupted(KeyboardInterrupt):
    """The run stopped on SIGINT or SIGTERM at `step`; `checkpoint_step` is the step of the checkpoint
    to resume from (the same step when the run saved one on its way out; None: the run has none).
    The CLI prints `resume_hint()` and exits with 128 + signum."""

    def __init__(self, signum: int, step: int, out: str, checkpoint_step: int | None):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.step, self.out, self.checkpoint_step = int(signum), step, out, checkpoint_step

    def resume_hint(self) -> str:
        out = shlex.quote(self.out)
        if self.checkpoint_step is None:
            return f"interrupted at step {self.step} before any checkpoint; start again with: longctx train --out {out} --force"
        hint = f"interrupted at step {self.step}; resume with: longctx train --out {out} --resume"
        if self.checkpoint_step != self.step:
            hint += f" (it continues from the checkpoint of step {self.checkpoint_step})"
        return hint


def _say(msg: str) -> None:
    """A line on stderr from a signal handler or after stdout's reader left: a raw write, never a
    second exception (print may be half way through a line, and stderr may be a closed pipe too)."""
    try:
        os.write(2, (msg + "\n").encode())
    except OSError:
        pass


class StopSignals:
    """SIGINT and SIGTERM during `Trainer.run`. The first only records the signal; the step loop
    reads it between steps, so the checkpoint it then writes holds the data cursor, optimizer and
    RNG of one step boundary. A second one raises Interrupted at once, without a checkpoint (the
    previous one stays whole: checkpoints are written aside and linked atomically). A signal the
    process ignores (nohup, a background job) stays ignored; off the main thread nothing is installed."""

    def __init__(self, trainer: "Trainer"):
        self.trainer, self.signum, self._old = trainer, None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(s) is not signal.SIG_IGN:
                    self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old if old is not None else signal.SIG_DFL)
        self._old.clear()

    def _handle(self, signum, frame):
        t = self.trainer
        if self.signum is not None:
            _say(f"{signal.Signals(signum).name} again: stopping now, without a checkpoint of step {t.step}")
            raise Interrupted(signum, t.step, t.out, t._saved_step)
        self.signum = signum
        _say(f"{signal.Signals(signum).name}: stopping with a checkpoint at the end of the step in flight "
             "(send it again to stop at once, without one)")


def _pipe_safe(log):
    """`log`, except that a reader of stdout that has gone (`longctx train | tee` when Ctrl-C kills
    tee, `| head`) does not end the run before its checkpoint: stdout then goes to /dev/null."""
    def safe(msg):
        try:
            log(msg)
        except BrokenPipeError:
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
            except (OSError, ValueError):
                pass
            _say("stdout's reader has gone; the run goes on without printing (metrics.jsonl has every step)")
    return safe


# ---------------------------------------------------------------------- resuming with the run's own config
# What a resume may change: how long the stages run and how often the run logs, evaluates and
# checkpoints. Everything else (model, data, window lengths, schedules, memory plan, kernels, seed)
# stays as the run was started, so the resumed run continues the same training.
# The parallel settings may change too: a checkpoint is read at any world size and cp degree, and the
# losses do not depend on them (a stage's batch_size is the global batch).
# rl.rollouts too: an outside engine's loop gives each round's rollouts file to the run it resumes.
RESUMABLE = re.compile(r"stages\.\d+\.steps|log_every|eval_every|ckpt_every|parallel\.\w+|rl\.rollouts")
RESUMABLE_SAID = "stages.N.steps, eval_every, ckpt_every, log_every, parallel.* and rl.rollouts"
_UNSET = object()


def read_run_config(out: str) -> tuple[dict, str]:
    """The run's saved config: OUT/config.json, else its checkpoint's copy. Returns (dict, path)."""
    paths = [os.path.join(out, "config.json")]
    if os.path.lexists(os.path.join(out, ckpt.LINK)):
        paths.append(os.path.join(os.path.realpath(os.path.join(out, ckpt.LINK)), "train_config.json"))
    for path in paths:
        if os.path.exists(path):
            try:
                with open(path) as f:
                    return json.load(f), path
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise RunFolderError(f"--resume: {path} is unreadable ({type(exc).__name__}: {exc}); restore it, or "
                                     "delete it to resume with the checkpoint's copy of the config.") from None
    raise RunFolderError(f"--resume: --out {out} holds no config.json and no checkpoint; check the folder, or drop "
                         "--resume to start a run in it.")


def _flat(v, key: str = "") -> dict:
    """Dotted keys -> values (stages.0.seq_len); lists of numbers and empty tables stay whole."""
    if isinstance(v, dict) and v:
        items = v.items()
    elif isinstance(v, list) and any(isinstance(x, dict) for x in v):
        items = enumerate(v)
    else:
        return {key: v}
    out = {}
    for k, x in items:
        out.update(_flat(x, f"{key}.{k}" if key else str(k)))
    return out


def _trained_per_stage(stage_steps: list[int], step: int) -> list[int]:
    out, start = [], 0
    for n in stage_steps:
        out.append(min(max(step - start, 0), n))
        start += n
    return out


def resume_changes(saved: dict, cfg: TrainConfig, step: int | None, where: str = "config.json") -> list[str]:
    """How `cfg` differs from the run's saved config, as "key: old -> new" lines. A difference in a
    setting outside RESUMABLE, or a stages.N.steps that would move steps the checkpoint (at `step`)
    has already trained into another stage, is a RunFolderError."""
    old = _flat({k: v for k, v in TrainConfig.from_dict(saved).to_dict().items() if k != "out_dir"})
    new = _flat({k: v for k, v in cfg.to_dict().items() if k != "out_dir"})
    changes = []
    for key in [*new, *(k for k in old if k not in new)]:
        a, b = old.get(key, _UNSET), new.get(key, _UNSET)
        if a == b or (a is _UNSET and b in ({}, [])) or (b is _UNSET and a in ({}, [])):
            continue
        said = [("unset" if x is _UNSET else json.dumps(x)) for x in (a, b)]
        if _UNSET in (a, b) or not RESUMABLE.fullmatch(key):
            raise RunFolderError(
                f"--resume: {key} is {said[0]} in the run's saved config ({where}) but {said[1]} now; leave it out "
                f"to resume the run as it was (only {RESUMABLE_SAID} may change on resume), or train with it in a "
                "new --out.")
        changes.append(f"{key}: {said[0]} -> {said[1]}")
    if step is not None:
        before = _trained_per_stage([s["steps"] for s in saved["stages"]], step)
        after = _trained_per_stage([s.steps for s in cfg.stages], step)
        for i, (x, y) in enumerate(zip(before, after)):
            if x != y:
                raise RunFolderError(
                    f"--resume: stages.{i}.steps={cfg.stages[i].steps} would change the {x} steps the checkpoint "
                    f"(step {step}) has trained in stage {i}; change only the steps of the stage it is in and later "
                    "ones, to at least what they have trained.")
    return changes


def resume_config(out: str, config_file: str | None = None, preset: str | None = None, sets=()) -> TrainConfig:
    """The config to resume the run in `out` with: its saved config, with what --config / --preset /
    --set give laid over it; refused (RunFolderError) where that changes more than RESUMABLE."""
    from ..config.loading import _assign, _merge, _read_config_file, _split_set
    from ..config.train import _check_keys

    saved, where = read_run_config(out)
    raw = _read_config_file(config_file) if config_file else {}
    _check_keys(raw, "")
    pairs = [_split_set(s) for s in sets]
    d = json.loads(json.dumps(saved))
    name = raw.pop("preset", None)
    name = preset if preset is not None else name
    for k, v in pairs:
        name = v if k == "preset" else name
    if name is not None:
        d["preset"] = name
    _merge(d, raw)
    for k, v in pairs:
        if k != "preset":
            _assign(d, k, v)
    d["out_dir"] = out
    cfg = TrainConfig.from_dict(d)
    link = os.path.join(out, ckpt.LINK)
    step = ckpt.step_of_name(os.path.basename(os.path.realpath(link))) if os.path.lexists(link) else None
    resume_changes(saved, cfg, step, where)
    return cfg


class Trainer:
    def __init__(self, cfg: TrainConfig, out_dir: str | None = None, quiet: bool = False, log=print):
        if cfg.init_from is not None:  # the checkpoint's model, with the run's model settings checked against it
            from ..distributed.loading import init_model_config

            cfg.model = init_model_config(cfg.init_from, cfg.model, cfg.model_given)
            cfg.model_given, cfg.vocab_note = None, None
            cfg.validate()
        self.cfg = cfg
        self.out = out_dir or cfg.out_dir
        self.quiet, self.log = quiet, _pipe_safe(log)
        self._saved_step = None  # the step of the newest checkpoint in self.out
        self._stop = StopSignals(self)
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        if self.device.type == "cuda":  # before the process group's first CUDA allocation
            said = allocator.configure(cfg.cuda_alloc)
            if os.environ.get("RANK", "0") == "0":
                self.log(f"CUDA allocator: {said}")
        self.mesh, self.rank, self.world = self._join_processes(cfg)
        if self.rank != 0:  # one log and one set of run files: rank 0's
            self.quiet = quiet = True
        torch.manual_seed(cfg.seed)
        tok = load_tokenizer(cfg.data.tokenizer)
        if tok.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's vocabulary "
                f"({tok.vocab_size}); set model.vocab_size >= {tok.vocab_size}."
            )
        self.tokenizer = tok
        self.sft = None  # task = "sft" (and "rl"): its conversations, template and held-out scoring (train/sft.py)
        self.rl = None  # task = "rl": its rollouts, reward and step (train/rl.py); the evaluation is SFT's
        if cfg.task == "rl":  # its reward function and rollouts file are checked before the task's files are read
            from . import rl

            rl.check_parallel(self.world)
            self.rl = rl.RL(cfg, tok, log=log)
        if cfg.task in ("sft", "rl"):
            from .sft import SFTData, check_parallel

            check_parallel(cfg, self.world)
            self.sft = SFTData(cfg, tok, quiet=quiet, log=log)
            self.stream, self.source_names = self.sft.stream, ["main"]
            self.train_tokens, self.eval_tokens, self.eval_set = self.sft.train_tokens, self.sft.eval_tokens, self.sft.eval_set
        else:
            self._pretraining_data(cfg, tok, quiet, log)
        if self.rl is not None:
            self.rl.bind(self.sft)
            self.stream = self.rl.stream
        if cfg.init_from is None:
            self.model = LongCtxModel(cfg.model).to(self.device)
            self.kernels_planned = apply_kernels(self.model, cfg.kernels)  # {op: what runs}; raises what cannot run
        else:  # storage comes after the sharding below, for this rank's shards only, filled from init_from
            with torch.device("meta"):
                self.model = LongCtxModel(cfg.model)
        self.n_params = self.model.num_parameters()  # counted whole, before any sharding
        if self.mesh is not None:
            from ..distributed.balance import attach_statistics, statistics_group
            from ..distributed.expert_parallel import apply_expert_parallel
            from ..distributed.fsdp import parallelize

            # the memory plan only sets module switches and the block policy (applied per stage), so
            # the sharding goes on now: the optimizer must see the sharded parameters (each rank's
            # experts first, which FSDP then shards over the ranks holding the same experts)
            apply_expert_parallel(self.model, self.mesh, cfg.parallel.ep)
            parallelize(self.model, self.mesh)
            attach_statistics(self.model, statistics_group(self.mesh))
            self._set_cp(True)
        if cfg.init_from is not None:
            from ..distributed.loading import load_into

            read = load_into(self.model, cfg.init_from, self.device)  # each rank its shards' slices
            self.kernels_planned = apply_kernels(self.model, cfg.kernels)
            if not self.quiet:
                what = {"hf": "transformers layout", "ours": "longctx checkpoint", "dcp": "sharded longctx checkpoint"}
                self.log(f"weights from {cfg.init_from} ({what[read.kind]}"
                         + (f"; {read.elements():,} values read by rank 0)" if read.reads else ")"))
        if self.rl is not None:  # the KL's reference: the starting weights, before any resume loads others
            self.rl.attach(self.model)
        self.opt = make_optimizer(self.model, cfg, self.device)
        self.step = 0
        self.before = None
        self.history: list[dict] = []
        self.memory_policy = None
        self.stage_entered = None  # the stage whose window, mixture and memory plan are in place
        self.stage_estimate_gib = None  # `longctx estimate` of the stage's plan (CUDA only), shown beside each peak
        self._tb = None  # a progress.TensorBoard while run() runs
        self._kernels_said = None  # the impl report the last `kernels:` line printed

    def _pretraining_data(self, cfg: TrainConfig, tok, quiet: bool, log) -> None:
        """The packed document stream (and data.sources mixture) and the held-out windows of pretraining."""
        train_docs, eval_docs = load_split(cfg.data.path, cfg.data.text_field, cfg.data.eval_docs)
        self.train_tokens = tokenize_documents(train_docs, tok, quiet=quiet, desc="tokenizing train")
        self.eval_tokens = tokenize_documents(eval_docs, tok, quiet=quiet, desc="tokenizing eval")
        eos = separator_id(tok, cfg.data.separator)
        self.stream = PackedStream(self.train_tokens, cfg.stages[0].seq_len, cfg.seed, eos_id=eos,
                                   batch_size=cfg.stages[0].batch_size)
        # Per-stage data mixtures: "main" (data.path) plus the named data.sources.
        self.source_names = ["main", *cfg.data.sources]
        if len(self.source_names) > 1:
            streams = [self.stream]
            for j, name in enumerate(self.source_names[1:], 1):
                docs = load_documents(cfg.data.sources[name], cfg.data.text_field, setting=f"data.sources.{name}")
                toks = tokenize_documents(docs, tok, quiet=quiet, desc=f"tokenizing {name}")
                streams.append(PackedStream(toks, cfg.stages[0].seq_len, cfg.seed + j, eos_id=eos,
                                            batch_size=cfg.stages[0].batch_size))
            self.stream = MixedStream([(st, 1.0) for st in streams], cfg.seed, cfg.stages[0].batch_size)
        n_train = sum(len(t) for t in self.train_tokens)  # the main source bounds the window
        for i, s in enumerate(cfg.stages):
            if s.seq_len * s.batch_size >= n_train:
                raise ConfigError(
                    f"stages.{i}.seq_len x batch_size ({s.seq_len * s.batch_size:,} tokens) is longer than the whole training "
                    f"corpus ({n_train:,} tokens); lower it or point data.path at more text."
                )
        self.eval_set = None  # data.eval_windows=0: no evaluation at all
        if cfg.data.eval_windows > 0:
            eval_len = max(s.seq_len for s in cfg.stages)
            longest = max((len(t) for t in self.eval_tokens), default=0) - 1
            if 0 < longest < eval_len:  # e.g. the stdlib corpus under a 1M-token curriculum
                if not quiet:
                    log(f"note: held-out documents are at most {longest + 1} tokens; evaluating at that length, not {eval_len}")
                eval_len = longest
            self.eval_set = eval_windows(self.eval_tokens, eval_len, cfg.data.eval_windows, starts_only=False).tokens

    # ------------------------------------------------------------------ many processes
    def _join_processes(self, cfg: TrainConfig):
        """(mesh, rank, world) under torchrun (WORLD_SIZE > 1), else (None, 0, 1)."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return None, 0, 1
        from ..distributed.mesh import build_mesh, cp_rank, dp_rank, init_distributed

        rank, world, device = init_distributed()
        if self.device.type != device.type:
            raise ConfigError(f"device = {cfg.device} runs on {self.device.type}, but torchrun's processes hold "
                              f"{device.type} devices; set device = auto.")
        self.device = device
        from ..memory.planner import resolve_parallel

        cfg.parallel = resolve_parallel(cfg, world, device)  # parallel.cp = auto: the smallest cp that fits
        mesh = build_mesh(world, cfg.parallel)
        self.dp, self.dp_rank = cfg.parallel.validate(world).dp, dp_rank(mesh)
        self.cp, self.cp_rank = cfg.parallel.cp, cp_rank(mesh)
        from ..memory.model_bytes import CHUNKED_CP_ERROR
        from ..memory.plan import MemoryPlan

        for i, s in enumerate(cfg.stages):
            chunk = MemoryPlan.from_dict(s.memory or {}, base=MemoryPlan.from_dict(cfg.memory)).seq_chunk_tokens()
            if self.cp > 1 and 0 < chunk < s.seq_len:  # said now, not when the stage comes
                raise ConfigError(f"stages.{i}: " + CHUNKED_CP_ERROR.format(chunk=chunk, cp=self.cp))
            if s.seq_len % (2 * self.cp) and self.cp > 1:  # zigzag: two equal chunks per cp rank
                raise ConfigError(f"stages.{i}.seq_len = {s.seq_len} does not split into the 2 x {self.cp} equal chunks "
                                  f"of parallel.cp = {self.cp}; make it a multiple of {2 * self.cp}.")
            if s.batch_size % self.dp:
                raise ConfigError(f"stages.{i}.batch_size = {s.batch_size} does not split over the {self.dp} "
                                  f"data-parallel ranks; make it a multiple of {self.dp} (it is the global batch).")
        return mesh, rank, world

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """This data-parallel rank's rows of the global batch, and of those this cp rank's tokens
        (every rank reads the same stream, so the data cursor in a checkpoint is the same on all)."""
        if self.mesh is None:
            return t
        n = t.shape[0] // self.dp
        t = t[self.dp_rank * n: (self.dp_rank + 1) * n]
        if self.cp > 1:  # this cp rank's tokens of each row; the labels were shifted before, so they stay exact
            from ..distributed.zigzag import shard

            t = shard(t, self.cp, self.cp_rank)
        return t

    def _set_cp(self, on: bool) -> None:
        """Hand every KDA and DSA layer this rank's CP context (on), or take it back (the evaluation
        runs whole sequences on every rank)."""
        if self.mesh is None or self.cp == 1:
            return
        from ..distributed.mesh import cp_context
        from ..layers.dsa import SparseMLA
        from ..layers.kda import KimiDeltaAttention

        ctx = cp_context(self.mesh, self.cfg.parallel) if on else None
        for m in self.model.modules():
            if isinstance(m, (KimiDeltaAttention, SparseMLA)):
                m.cp = ctx

    def _sum_over_ranks(self, v: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        v = v.detach().float().clone()
        dist.all_reduce(v)
        return v

    def _peaks(self) -> list[float]:
        """Every rank's peak memory in GiB, rank order."""
        import torch.distributed as dist

        mine = torch.tensor([peak_memory_gib(self.device)], dtype=torch.float64, device=self.device)
        every = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine)
        return [float(t.item()) for t in every]

    # ------------------------------------------------------------------ bookkeeping
    def stage_at(self, step: int) -> tuple[int, int]:
        acc = 0
        for i, s in enumerate(self.cfg.stages):
            if step < acc + s.steps:
                return i, step - acc
            acc += s.steps
        return len(self.cfg.stages), 0

    def _record(self, rec: dict):
        self.history.append(rec)
        if self.rank != 0:
            return
        with open(os.path.join(self.out, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self._tb is not None:
            self._tb.record(rec)

    def state(self) -> dict:
        return {"step": self.step, "data": self.stream.state_dict(), "before": self.before}

    def save(self, reason: str):
        if self._saved_step == self.step:  # this step's checkpoint exists; a rewrite would first delete it
            return os.path.join(self.out, f"ckpt-{self.step:06d}")
        if self.mesh is not None:
            path = self._save_sharded()
        else:
            path = ckpt.save(self.out, self.step, self.model, self.opt, self.state(), self.cfg.to_dict())
        self._saved_step = self.step
        if not self.quiet:
            self.log(f"checkpoint ({reason}): {path}")
        return path

    def _save_sharded(self) -> str:
        """Every rank writes its shards (longctx.distributed.checkpoint); rank 0 then adds the configs
        and flips the checkpoint link, as the single-process save does."""
        import torch.distributed as dist

        from ..distributed import checkpoint as dckpt

        name = f"ckpt-{self.step:06d}"
        path = dckpt.save(os.path.join(self.out, name), self.model, self.opt,
                          {"trainer": self.state(), "rng": ckpt.rng_state(), "step": self.step})
        if self.rank == 0:
            with open(os.path.join(path, "train_config.json"), "w") as f:
                json.dump(self.cfg.to_dict(), f, indent=2, default=str)
            with open(os.path.join(path, "longctx_config.json"), "w") as f:
                f.write(self.cfg.model.to_json())
            link_tmp = os.path.join(self.out, ckpt.LINK + ".new")
            if os.path.lexists(link_tmp):
                os.remove(link_tmp)
            os.symlink(name, link_tmp)
            os.replace(link_tmp, os.path.join(self.out, ckpt.LINK))
            olds = sorted((s, d) for d in os.listdir(self.out) if (s := ckpt.step_of_name(d)) is not None and s < self.step)
            for _, d in olds[: max(0, len(olds) - (ckpt.KEEP - 1))]:  # as many kept as in one process
                shutil.rmtree(os.path.join(self.out, d), ignore_errors=True)
        dist.barrier()  # no rank reads the link before it points at this step
        return path

    def resume(self):
        """Continue from OUT/checkpoint. self.cfg may differ from the run's saved config only in
        RESUMABLE settings (logged); anything else is refused before the run folder changes."""
        if not os.path.isdir(os.path.join(self.out, ckpt.LINK)):
            raise RunFolderError(f"--resume: --out {self.out} has no checkpoint (the run stopped before writing one, or "
                                 "its checkpoint link points nowhere); start the run afresh with --force.")
        saved, where = read_run_config(self.out)
        from ..distributed.checkpoint import load_checkpoint

        # by the checkpoint's format, not this run's world size: a sharded one resumes in one process,
        # a one-process one under torchrun
        st = load_checkpoint(self.out, self.model, self.opt, device=self.device)
        changes = resume_changes(saved, self.cfg, st.get("step", 0), where)
        self.step = self._saved_step = st.get("step", 0)
        self.stream.load_state_dict(st["data"])
        self.before = st.get("before")
        # keep metrics.jsonl consistent with the checkpoint: drop records after its step
        path = os.path.join(self.out, "metrics.jsonl")
        if os.path.exists(path) and self.rank == 0:
            with open(path) as f:
                recs = [r for r in map(_json_or_none, f) if r is not None]
            recs = [r for r in recs if r.get("step", 0) <= self.step]
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in recs)
            self.history = recs
        if not self.quiet:
            self.log(f"resumed from step {self.step}")
        for c in changes if self.rank == 0 else ():  # said even when quiet: the run now differs from how it was started
            self.log(f"resume changes {c}")

    def _eval_forward(self):
        """The sequence-chunked forward when the memory plan trains the evaluation length in chunks
        (a whole-sequence forward at 1M tokens would not fit either); None = one plain forward.
        Decided once: the memory settings and the evaluation length do not change during a run."""
        if not hasattr(self, "_eval_fwd"):
            self._eval_fwd = self._pick_eval_forward()
        return self._eval_fwd

    def _pick_eval_forward(self):
        from ..memory.plan import MemoryPlan
        from ..memory.planner import resolve_auto
        from ..memory.sequence_chunks import SequenceChunker

        L = self.eval_set.shape[1] - 1
        plan, _ = resolve_auto(MemoryPlan.from_dict(self.cfg.memory), self.cfg.model, L, self.device,
                               resolve_dtype(self.cfg.dtype, self.device).itemsize, self.cfg.kernels)
        c = plan.seq_chunk_tokens()
        return SequenceChunker(c).token_losses if 0 < c < L else None

    def evaluate(self, label: str) -> dict | None:
        """The held-out loss, overall and in 8 position buckets (fewer for windows under 8 tokens);
        None when data.eval_windows=0 turns evaluation off."""
        if self.eval_set is None:
            return None
        if self.sft is not None:
            return self._evaluate_sft(label)
        n_buckets = min(8, self.eval_set.shape[1] - 1)
        self._set_cp(False)
        try:
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
                res = per_position_loss(self.model, self.eval_set, n_buckets=n_buckets, device=self.device,
                                        progress=not self.quiet and sys.stderr.isatty(),
                                        token_losses=self._eval_forward())
        finally:
            self._set_cp(True)
        self._record({"step": self.step, "eval": label, "eval_loss": res["loss"], "buckets": res["buckets"]})
        return res

    def _evaluate_sft(self, label: str) -> dict:
        """The SFT evaluation (train/sft.py): the masked loss in buckets and the exact-match accuracy."""
        res = self.sft.evaluate(self.model, self.device, self.dtype, progress=not self.quiet and sys.stderr.isatty())
        self._record({"step": self.step, "eval": label, "eval_loss": res["loss"], "buckets": res["buckets"],
                      "accuracy": res["accuracy"], **({"by_kind": res["by_kind"]} if "by_kind" in res else {})})
        if not self.quiet:
            acc = ", ".join(f"{k}: {100 * v:.1f}%" for k, v in res["accuracy"].items())
            self.log(f"exact match ({label}): {acc}")
        return res

    def _batch_inputs(self, batch):
        """(x, y, cu_seqlens) of this rank for one step; cu_seqlens None except for SFT, whose packed
        conversations are kept apart."""
        if self.sft is None:
            return self._rows(batch.inputs).to(self.device), self._rows(batch.labels).to(self.device), None
        from .sft import model_inputs

        x, y, cu = model_inputs(batch, self._rows, self.mesh, self.memory_policy)
        return x.to(self.device), y.to(self.device), cu.to(self.device)

    # ------------------------------------------------------------------ the loop
    def train_step(self, stage, step_in_stage: int) -> dict:
        if self.rl is not None:  # rollouts, rewards and the clipped policy-gradient updates (train/rl.py)
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            rec = self.rl.train_step(self, stage, lr_at(stage, step_in_stage))
            rec["peak_gib"] = peak_memory_gib(self.device)
            return rec
        model = self.model
        batch = self.stream.next_batch()
        x, y, cu = self._batch_inputs(batch)
        lr = lr_at(stage, step_in_stage)
        for g in self.opt.param_groups:
            g["lr"] = lr
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        chunked = getattr(self.memory_policy, "forward_backward", None)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            if chunked is not None and self.mesh is not None:  # over the dp ranks: each its rows, a share of the mean
                from ..distributed.fsdp import set_gradient_sync

                out = chunked(model, x, y, n_labels=self._sum_over_ranks((y != -100).sum()).to(torch.int64),
                              n_rows=x.shape[0] * self.dp, grad_sync=lambda on: set_gradient_sync(model, on))
            elif chunked is not None:  # sequence-chunked step: forward and backward in one sweep pair
                out = chunked(model, x, y)
            else:
                out = model(x, labels=y, return_logits=False, cu_seqlens=cu)
        loss = out.loss
        share = out.lm_loss  # this rank's share of the global mean: a chunked step's is one already
        if self.mesh is not None and chunked is None:
            from ..distributed.fsdp import loss_share

            # this rank's share of the global mean: the summed gradients are the single-process ones. The
            # MoE aux loss is a share already (GlobalStatistics), the indexer KL a share of its sequence
            # (summed over the cp ranks) and the mean over as many tokens as every other dp rank's: 1/dp.
            loss = share = loss_share(out.lm_loss, y, self.mesh)
            for k, v in out.aux.items():
                loss = loss + (v if k == "moe_aux" else v / self.dp)
        if chunked is None:
            loss.backward()
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        if self.mesh is not None:
            from ..distributed.fsdp import clip_grad_norm_

            gn = clip_grad_norm_(model.parameters(), clip)
        else:
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        model.apply_balance_updates()
        if self.memory_policy is not None:
            self.memory_policy.end_step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        lm_loss, tokens = out.lm_loss, x.numel()
        if self.mesh is not None:  # the global mean and the whole step's tokens
            lm_loss, tokens = self._sum_over_ranks(share), tokens * self.world
        rec = {"step": self.step + 1, "stage": self.stage_at(self.step)[0], "seq_len": stage.seq_len,
               "loss": lm_loss.item(), "grad_norm": gn.item(), "lr": lr,
               "tokens_per_s": tokens / dt, "step_s": dt, "peak_gib": peak_memory_gib(self.device),
               "moe_max_over_mean": model.moe_balance(), "impl": model.impl_report()}
        if self.mesh is not None:
            rec["peak_gib_ranks"] = self._peaks()
        if self.stage_estimate_gib is not None:
            rec["estimate_gib"] = self.stage_estimate_gib
        for k, v in out.aux.items():  # shares of the global value, but the unchunked indexer KL: its sequence's
            whole = k == "moe_aux" or chunked is not None
            rec[k] = (self._sum_over_ranks(v) / (1 if whole else self.dp)).item() if self.mesh else v.item()
        model.clear_aux()
        return rec

    def show_step(self, rec: dict, on_cadence: bool) -> None:
        """The step line every log_every steps (and at the last), and the `kernels:` line on the
        process's first step and whenever the report changes, with that step's line above it
        (a change off the cadence shows when it happened)."""
        if self.quiet:
            return
        changed = rec.get("impl") != self._kernels_said
        if on_cadence or changed:
            self.log(step_line(rec))
        if changed:
            self._kernels_said = rec.get("impl")
            self.log(f"kernels: {rec.get('impl') or '-'}")
            if self._tb is not None:
                self._tb.kernels(rec.get("impl") or "-", rec["step"])

    def run(self, resume: bool = False, stop_after: int | None = None, force: bool = True) -> dict:
        """Train to the end (or `stop_after` steps in total). A fresh run (not `resume`) into a folder
        holding a run clears it first (`clear_run`) when `force`, else refuses; the CLI passes
        force only with --force, while a caller of this method asks for a fresh run by calling it.
        SIGINT / SIGTERM end the step in flight, save a checkpoint and raise Interrupted."""
        try:
            with self._stop:
                return self._run(resume, stop_after, force)
        finally:  # an interrupted run's events are flushed too
            if self._tb is not None:
                self._tb.close()
                self._tb = None

    def _restarted(self) -> bool:
        """Whether torchrun restarted this job's workers (--max-restarts) after the run in self.out
        began: some rank's restart count is above 0 (a node's count rises only when its own workers
        failed) and rank 0 finds its job in OUT/torchrun_job, which a first attempt that refused the
        folder (another run, without --force) never wrote. Decided on rank 0's and every rank's
        word together, so all ranks resume, or start afresh, alike."""
        count, ours = restart_count(), job_file_is_ours(self.out) if self.rank == 0 else False
        if self.mesh is None:
            return count > 0 and ours
        import torch.distributed as dist

        t = torch.tensor([count, int(ours)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t[0] > 0 and t[1] > 0)

    def _run(self, resume: bool, stop_after: int | None, force: bool) -> dict:
        if self._restarted():  # torchrun restarted the workers: they continue their job's run by themselves
            resume, force = (True, False) if os.path.isdir(os.path.join(self.out, ckpt.LINK)) else (False, True)
            if not self.quiet:
                how = "from its last checkpoint" if resume else "afresh (the failed attempt left no checkpoint)"
                self.log(f"torchrun restart {restart_count()}: continuing the run in {self.out} {how}")
        check_out_dir(self.out, resume, force and not resume)
        if self.mesh is not None:  # every rank has judged the folder before rank 0 changes it
            import torch.distributed as dist

            dist.barrier()
        if resume:
            self.resume()
        elif force and self.rank == 0:
            removed = clear_run(self.out)
            if removed and not self.quiet:
                self.log(f"--force: removed the previous run's {', '.join(removed)} from {self.out}")
        os.makedirs(self.out, exist_ok=True)
        if self.rank == 0:
            with open(os.path.join(self.out, "config.json"), "w") as f:
                json.dump(self.cfg.to_dict(), f, indent=2, default=str)
            job, job_file = torchrun_job(), os.path.join(self.out, JOB_FILE)
            if job is not None:  # what lets this job's restarted workers continue the run (_restarted)
                with open(job_file, "w") as f:
                    f.write(job + "\n")
            elif os.path.exists(job_file):
                os.remove(job_file)
            self._tb = TensorBoard(os.path.join(self.out, TB_DIR))
        n = self.n_params
        if not self.quiet:
            mesh = "" if self.mesh is None else (f" | mesh dp {self.dp} x cp {self.cfg.parallel.cp} "
                                                 f"({self.world} processes)")
            self.log(f"model: {self.cfg.model.summary()} | {n['total'] / 1e6:.2f}M params ({n['active'] / 1e6:.2f}M active)"
                     + mesh + (f" | {self.cfg.vocab_note}" if self.cfg.vocab_note else ""))
            data = self.rl.describe() if self.rl is not None else self.sft.describe() if self.sft is not None else (
                f"{len(self.train_tokens)} train docs ({sum(len(t) for t in self.train_tokens):,} tokens), "
                f"{len(self.eval_tokens)} held-out docs")
            self.log(f"data: {data}; device {self.device}, dtype {str(self.dtype).replace('torch.', '')}")
            if self._tb is not None and self._tb.note:
                self.log(f"note: {self._tb.note}")
        if self.before is None and self.eval_set is not None:
            self.before = self.evaluate("before")
            if not self.quiet:
                self.log(f"held-out loss before training: {self.before['loss']:.4f}")
        total = self.cfg.total_steps()
        last = total if stop_after is None else min(total, stop_after)
        eta = Eta(self.cfg.stages)
        while self.step < last and self._stop.signum is None:  # a signal waits for the step boundary
            si, k = self.stage_at(self.step)
            stage = self.cfg.stages[si]
            if si != self.stage_entered:
                self.enter_stage(si)
            rec = self.train_step(stage, k)
            self.step += 1
            eta.add(si, rec["step_s"])
            rec["total_steps"], rec["eta_s"] = total, eta.remaining_s(self.step)
            self._record(rec)
            self.show_step(rec, self.step % max(1, self.cfg.log_every) == 0 or self.step == last)
            end_of_stage = self.stage_at(self.step)[1] == 0
            if self.cfg.eval_every and self.step % self.cfg.eval_every == 0 and self.step < total:
                self.evaluate(f"step{self.step}")
            if (self.cfg.ckpt_every and self.step % self.cfg.ckpt_every == 0) or (end_of_stage and self.step < last):
                self.save("periodic" if not end_of_stage else "end of stage")
        if self._stop.signum is not None:
            name = signal.Signals(self._stop.signum).name
            self.save(name)
            self.log(f"stopped by {name} at step {self.step}")
            raise Interrupted(self._stop.signum, self.step, self.out, self._saved_step)
        if self.step < total:  # stopped early on request: checkpoint to resume from
            self.save("stopped")
            return {"step": self.step, "stopped": True}
        after = self.evaluate("after")
        self.save("final")
        if self.rank != 0:  # the plots and the summary are rank 0's
            return {"step": self.step, "before": self.before, "after": after, "table": None}
        table = None  # no table or per-position plot without an evaluation (data.eval_windows=0)
        from . import plots
        plots.loss_curve(self.history, os.path.join(self.out, "loss.png"))
        if after is not None and self.before is not None:
            table = format_table(self.before, after)
            if not self.quiet:
                self.log("held-out loss by position (before -> after):\n" + table)
            plots.per_position(self.before, after, os.path.join(self.out, "per_position_loss.png"))
        elif os.path.exists(os.path.join(self.out, "per_position_loss.png")):  # an earlier run's, not this one's
            os.remove(os.path.join(self.out, "per_position_loss.png"))
        summary = {"step": self.step, "before": self.before, "after": after, "table": table}
        if self.sft is not None and after is not None:  # exact match by haystack length, before -> after
            from .sft import accuracy_plot, accuracy_table

            summary["accuracy_table"] = accuracy_table(self.before, after)
            if not self.quiet:
                self.log("held-out exact match (before -> after):\n" + summary["accuracy_table"])
            accuracy_plot(self.history, self.before, after, os.path.join(self.out, "accuracy.png"))
        if self.rl is not None:
            from .rl import reward_plot

            reward_plot(self.history, os.path.join(self.out, "reward.png"))
        with open(os.path.join(self.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        return summary

    def enter_stage(self, si: int):
        """Set up everything stage `si` sets: the window shape, the data mixture and the memory plan.
        Keyed by the stage, not by its first step, so a run resumed in the middle of a stage builds
        the same state as the run that got there without stopping."""
        stage = self.cfg.stages[si]
        self.stream.set_window(stage.seq_len, stage.batch_size)
        if isinstance(self.stream, MixedStream):
            mix = stage.data_mix or {"main": 1.0}
            self.stream.set_weights([float(mix.get(n, 0.0)) for n in self.source_names])
        self.apply_memory(stage)
        self.stage_entered = si
        if not self.quiet:
            self.log(f"stage {si}: {stage.steps} steps at {stage.seq_len} tokens x {stage.batch_size}, lr {stage.lr}")

    def apply_memory(self, stage):
        """Apply the stage's memory plan (see longctx.memory)."""
        from ..memory.plan import apply_plan
        from ..memory.planner import plan_for_stage

        plan = plan_for_stage(self.cfg, stage, self.device, self.cfg.stages.index(stage), world=self.world)
        if getattr(self.memory_policy, "close", None) is not None:
            self.memory_policy.close()  # the previous stage's kept pinned buffers
        self.memory_policy = apply_plan(self.model, plan)
        self.stage_estimate_gib = None
        if self.device.type == "cuda":  # each step's line then shows the measured peak beside it
            from ..memory.planner import stage_estimate

            e = stage_estimate(self.cfg, stage, plan, self.device, self.world)
            self.stage_estimate_gib = e["gpu_bytes"] / 2**30
        from ..memory.planner import whole_sequence_warning

        warning = whole_sequence_warning(self.cfg.model, stage.seq_len * stage.batch_size, plan)
        if warning and self.device.type == "cuda":  # the CPU's kernels index in 64 bits
            self.log(f"warning: {warning}")
        if not self.quiet:
            self.log(f"memory plan: {plan.describe()}")
            if self.stage_estimate_gib is not None:
                self.log(f"memory estimate: {self.stage_estimate_gib:.1f} GiB of {e['gpu_capacity'] / 2**30:.1f}, "
                         f"peak during {e['peak_phase']} (`longctx estimate` prints the breakdown)")


def _json_or_none(line: str):
    """One metrics.jsonl record; None for a blank line or one cut short by a hard stop."""
    try:
        return json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None


def train(cfg: TrainConfig, **kw) -> dict:
    out_dir = kw.pop("out_dir", None)
    quiet = kw.pop("quiet", False)
    return Trainer(cfg, out_dir=out_dir, quiet=quiet).run(**kw)


__all__ = ["Trainer", "train", "UserError"]
