"""`longctx` command line: train, sft, rl, eval, generate, estimate, export.

A mistake in what the user asked for (a `UserError`) prints one line `error: ...` and exits 2;
SIGINT (Ctrl-C) or SIGTERM during training finishes the step in flight, saves a checkpoint, prints
how to resume and exits 130 or 143 (128 + the signal).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path


def _train(a) -> int:
    from .config.loading import load_train_config, to_toml
    from .train.trainer import JOB_FILE, Trainer, check_out_dir, resume_config

    if a.resume:  # the run's saved config, with only what the flags may change on resume changed
        out = a.out or load_train_config(a.config, a.preset, a.set or []).out_dir
        check_out_dir(out, a.resume, a.force)
        cfg = resume_config(out, a.config, a.preset, a.set or [])
    else:
        cfg = load_train_config(a.config, a.preset, a.set or [])
        if a.out:
            cfg.out_dir = a.out
    if a.print_config:
        print(to_toml(cfg))
        return 0
    # before the corpus is read: a refusal is instant. Not where a torchrun job has written its job file:
    # its restarted workers continue the run there, which the trainer decides with every rank (_restarted)
    if "TORCHELASTIC_RUN_ID" not in os.environ or not os.path.exists(os.path.join(cfg.out_dir, JOB_FILE)):
        check_out_dir(cfg.out_dir, a.resume, a.force)
    if hasattr(sys.stdout, "reconfigure"):  # each step line reaches `| tee` as it happens, not 8 KiB later
        sys.stdout.reconfigure(line_buffering=True)
    Trainer(cfg, quiet=a.quiet).run(resume=a.resume, stop_after=a.max_steps, force=a.force)
    if _leave_process_group():
        # the run's files are written and closed; the interpreter's teardown of gloo's threads can
        # still std::terminate a restarted worker, which torchrun would count as a failure
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _sft(a) -> int:
    """`longctx sft ...` is `longctx train --set task=sft ...` (the SFT settings: docs/design/post_training.md)."""
    a.set = [*(a.set or []), "task=sft"]
    return _train(a)


def _rl(a) -> int:
    """`longctx rl ...` is `longctx train --set task=rl ...` (the RL settings: docs/design/post_training.md)."""
    a.set = [*(a.set or []), "task=rl"]
    return _train(a)


def _leave_process_group() -> bool:
    """Under torchrun, take the process group down before the interpreter does: its teardown at exit,
    in whatever order finalization frees the store and the backend's threads, can abort the process
    (std::terminate) after a run that completed, which torchrun reports as a failed worker."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        return True
    return False


def _resolve_device(name: str):
    from .devices import resolve_device

    return resolve_device(name, "--device")


def _load_model(path: str, device: str):
    from . import checkpoint as ckpt
    from .config import ModelConfig
    from .errors import CheckpointError
    from .model import LongCtxModel

    dev = _resolve_device(device)
    if not os.path.exists(path):
        raise CheckpointError(f"--checkpoint {path!r} does not exist; pass a run directory or a checkpoint folder.")
    if os.path.exists(os.path.join(path, "config.json")) and not os.path.exists(os.path.join(path, "longctx_config.json")) \
            and not os.path.exists(os.path.join(path, ckpt.LINK)):
        from .hf_interop import load_pretrained
        return load_pretrained(path, device=dev), dev
    from .distributed.checkpoint import load_checkpoint

    model = LongCtxModel(ModelConfig.from_dict(ckpt.read_model_config(path))).to(dev)
    load_checkpoint(path, model, device=dev)  # by its format: a run of several processes (DCP) loads here in one
    return model, dev


def _load_tokenizer(spec: str):
    """--tokenizer; its errors name the flag (the data module's name the training setting data.tokenizer)."""
    from .data.tokenizers import load_tokenizer
    from .errors import DataError

    try:
        return load_tokenizer(spec)
    except DataError as e:
        raise DataError(str(e).replace("data.tokenizer", "--tokenizer")) from None


def _check_vocab(tok, model, spec: str) -> None:
    from .errors import ConfigError

    if tok.vocab_size > model.cfg.vocab_size:
        raise ConfigError(f"--tokenizer {spec!r} has {tok.vocab_size} ids but the checkpoint's model has "
                          f"{model.cfg.vocab_size} (model.vocab_size); pass the tokenizer the model was trained with.")


def _generate(a) -> int:
    import torch

    from .errors import ConfigError
    from .generate import generate

    tok = _load_tokenizer(a.tokenizer)
    model, dev = _load_model(a.checkpoint, a.device)
    _check_vocab(tok, model, a.tokenizer)
    # the bytes as they came: argv holds undecodable bytes as lone surrogates, which UTF-8 cannot encode
    prompt = a.prompt.encode("utf-8", "surrogateescape")
    ids = torch.as_tensor(tok.encode(prompt), dtype=torch.long, device=dev)[None]
    if ids.numel() == 0:
        raise ConfigError("--prompt is empty; give some text to continue.")
    out = generate(model, ids, a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, seed=a.seed,
                   vocab_limit=tok.vocab_size)
    sys.stdout.write(tok.decode(out[0].tolist()) + "\n")
    return 0


def _eval(a) -> int:
    from .data.packing import eval_windows
    from .data.sources import load_documents, split_documents, stdlib_corpus
    from .data.tokenizers import tokenize_documents
    from .errors import ConfigError, DataError
    from .train.evaluate import format_table, per_position_loss

    if a.buckets > a.seq_len:
        raise ConfigError(f"--buckets ({a.buckets}) is more than --seq-len ({a.seq_len}), which leaves buckets with no "
                          f"position; pass --buckets {min(8, a.seq_len)} or a longer --seq-len.")
    tok = _load_tokenizer(a.tokenizer)
    model, dev = _load_model(a.checkpoint, a.device)
    _check_vocab(tok, model, a.tokenizer)
    if a.data is None:
        held = stdlib_corpus()[1]
    else:
        held = split_documents(load_documents(a.data, setting="--data"), a.eval_docs)[1]
    docs = tokenize_documents(held, tok, quiet=True)
    longest = max((len(d) for d in docs), default=0)
    if longest < a.seq_len + 1:
        raise DataError(f"--seq-len {a.seq_len} needs held-out documents of {a.seq_len + 1} tokens, and the longest of "
                        f"the {len(docs)} has {longest}; lower --seq-len or pass longer documents with --data.")
    windows = eval_windows(docs, a.seq_len, a.windows, starts_only=False).tokens
    res = per_position_loss(model, windows, n_buckets=a.buckets, device=dev, progress=sys.stderr.isatty())
    if a.json:
        print(json.dumps(res, indent=2))
    else:  # the table `longctx train` ends with, for this one checkpoint
        n = len(windows)
        print(f"held-out loss by position ({n} window{'s' * (n != 1)} of {a.seq_len} tokens):\n" + format_table(res))
    return 0


def _estimate(a) -> int:
    """Exit 0 when the plan fits, 1 when even the last plan tried does not (--fit: when no cluster tried fits)."""
    from .config.kernels import KernelConfig
    from .config.train import preset_model
    from .errors import ConfigError
    from .memory.plan import MemoryPlan
    from .memory.planner import auto_plan, format_report, parse_switches, whole_sequence_warning

    cfg = preset_model(a.preset)
    if a.seq_len < 1:
        raise ConfigError(f"--seq-len must be >= 1 (got {a.seq_len}).")
    if a.cp is not None and a.cp < 1:
        raise ConfigError(f"--cp must be >= 1 (got {a.cp}).")
    plan = MemoryPlan.from_dict(parse_switches(a.set or []))
    kernels = {}
    for k in a.kernel or []:
        op, sep, impl = k.partition("=")
        if not sep or not op.strip():
            raise ConfigError(f"--kernel {k!r} is not OP=BACKEND; write it like --kernel mhc=torch.")
        kernels[op.strip()] = impl.strip()
    kernels = KernelConfig.from_dict(kernels)
    if a.fit or a.gpus is not None:
        return _estimate_cluster(a, cfg, plan, kernels)
    for flag, given in (("--ep", a.ep is not None), ("--kda-cp", a.kda_cp is not None), ("--param-dtype", a.param_dtype is not None),
                        ("--offload-optimizer", a.offload_optimizer), ("--host-gib", a.host_gib is not None)):
        if given:
            raise ConfigError(f"{flag} describes a step over several GPUs; add --gpus N (or --fit).")
    cp = a.cp or 1
    plan, e = auto_plan(cfg, a.seq_len, plan, cp, a.gpu, kernels=kernels)
    if a.json:
        print(json.dumps(e, indent=2))
    else:
        print(format_report(e, phases=a.phases))
        warning = whole_sequence_warning(cfg, -(-a.seq_len // cp), plan)
        if warning:
            print(f"warning: {warning}")
    return 0 if e["fits"] else 1


def _estimate_cluster(a, cfg, plan, kernels) -> int:
    """`longctx estimate --gpus G [--cp K] [--ep E]` (the per-GPU breakdown) and `--fit` (the smallest cluster)."""
    from .errors import ConfigError
    from .memory.model_bytes import GIB, GPUS, Cluster
    from .memory.planner import auto_plan, cp_candidates, dominant_term, fit_cluster, format_report, pick_cp

    kda_cp = a.kda_cp or "hidden_gather"
    param_bytes = {"fp32": 4, "bf16": 2}[a.param_dtype or "fp32"]
    host = None if a.host_gib is None else a.host_gib * GIB
    if a.gpu not in GPUS:
        raise ConfigError(f"--gpu {a.gpu!r} is unknown; choose one of {', '.join(GPUS)}.")
    moe = "m" in cfg.mlp_kinds()
    if a.ep is not None:
        if a.ep < 1:
            raise ConfigError(f"--ep must be >= 1 (got {a.ep}).")
        if moe and cfg.n_routed_experts % a.ep:
            ok = [d for d in range(1, cfg.n_routed_experts + 1) if cfg.n_routed_experts % d == 0]
            raise ConfigError(f"--ep {a.ep} does not divide the {cfg.n_routed_experts} routed experts of preset {a.preset}; "
                              f"choose one of {', '.join(map(str, ok))}.")
    if a.fit:
        if a.gpus is not None or a.cp is not None:
            raise ConfigError("--fit searches the number of GPUs and the cp itself; drop --gpus and --cp (or drop --fit).")
        if a.offload_optimizer:
            raise ConfigError("--fit tries the AdamW moments on the GPU first and then on the host; drop --offload-optimizer.")
        r = fit_cluster(cfg, a.seq_len, plan, a.gpu, kernels=kernels, param_bytes=param_bytes, host=host, ep=a.ep,
                        kda_cp=a.kda_cp)
        if a.json:
            print(json.dumps(_fit_json(r), indent=2))
            return 0 if r["gpus"] else 1
        cap = GPUS[a.gpu]
        print(f"fit: preset {a.preset}, {a.seq_len:,} tokens a sequence, {a.gpu} ({cap['memory'] / GIB:.1f} GiB; fits: "
              f"reserved <= 93%), host {(host or cap['host']) / GIB:.0f} GiB per GPU, FSDP gathers in {a.param_dtype or 'fp32'}")
        print(f"{'GPUs':>5}  {'fits':<4}  {'dp x cp x ep':<14}{'kda_cp':<14}{'AdamW moments':<15}{'GPU GiB':>8}{'host GiB':>9}  dominant term")
        for row in r["tried"]:
            e, cl = row["estimate"], row["cluster"]
            if e is None:
                print(f"{row['gpus']:>5}  no    {row['why']}")
                continue
            name, b = dominant_term(e)
            print(f"{row['gpus']:>5}  {'yes' if row['fits'] else 'no':<4}  {f'{cl.dp} x {cl.cp} x {cl.ep}':<14}"
                  f"{(cl.kda_cp if cl.cp > 1 else '-'):<14}{('host' if cl.opt_offload else 'GPU'):<15}"
                  f"{e['gpu_reserved_bytes'] / GIB:>8.1f}{e['host_bytes'] / GIB:>9.1f}  {name} ({b / GIB:.1f} GiB)")
        if r["gpus"] is None:
            print(f"verdict: no cluster of up to {r['tried'][-1]['gpus']} GPUs fits")
            return 1
        print(f"smallest cluster: {r['gpus']} GPUs ({r['found']['cluster'].describe()})\n")
        print(format_report(r["found"]["estimate"], phases=a.phases))
        return 0
    if a.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1 (got {a.gpus}).")
    G = a.gpus
    ep = a.ep or 1
    if G % ep:
        raise ConfigError(f"--ep {ep} does not divide --gpus {G}; choose an ep that divides both {G} and "
                          f"the {cfg.n_routed_experts} routed experts.")
    settings = dict(param_bytes=param_bytes, opt_offload=a.offload_optimizer, host=host)
    if a.cp is None:
        if not cp_candidates(cfg, a.seq_len, G, kda_cp):
            raise ConfigError(f"no cp splits --seq-len {a.seq_len} into 2 x cp equal chunks on --gpus {G}; pass --cp 1 or a "
                              "sequence length that is a multiple of 2 x cp.")
        cl, plan, e = pick_cp(cfg, a.seq_len, plan, G, ep, kda_cp, None, a.gpu, kernels=kernels, **settings)
        picked = f"cp {cl.cp}: the smallest of {', '.join(map(str, cp_candidates(cfg, a.seq_len, G, kda_cp)))} " + \
                 ("whose plan fits" if e["fits"] else "tried, and none fits")
    else:
        cp = a.cp
        if G % cp:
            ok = [d for d in range(1, G + 1) if G % d == 0]
            raise ConfigError(f"--cp {cp} does not divide --gpus {G}; choose one of {', '.join(map(str, ok))}.")
        if cp > 1 and a.seq_len % (2 * cp):
            raise ConfigError(f"--seq-len {a.seq_len} does not split into the 2 x {cp} equal chunks of --cp {cp} (zigzag); "
                              f"make it a multiple of {2 * cp}.")
        if cp > 1 and kda_cp != "chunk_state" and "K" in cfg.layer_kinds() and cfg.kda_heads % cp:
            raise ConfigError(f"--cp {cp} does not divide the {cfg.kda_heads} KDA heads of preset {a.preset}, and --kda-cp "
                              f"{kda_cp} gives each rank an equal share of them; choose a cp that divides {cfg.kda_heads} "
                              "or pass --kda-cp chunk_state.")
        cl = Cluster(gpus=G, cp=cp, ep=ep, kda_cp=kda_cp, **settings)
        plan, e = auto_plan(cfg, a.seq_len, plan, cp, a.gpu, kernels=kernels, cluster=cl)
        picked = None
    if a.json:
        print(json.dumps(dict(e, dominant_term=dominant_term(e)[0]), indent=2))
        return 0 if e["fits"] else 1
    print(format_report(e, phases=a.phases))
    if picked:
        print(picked)
    if G > 1:
        name, b = dominant_term(e)
        print(f"dominant term: {name} ({b / GIB:.2f} GiB)")
    return 0 if e["fits"] else 1


def _fit_json(r: dict) -> dict:
    import dataclasses

    def row(x):
        return None if x is None else dict(x, cluster=x["cluster"] and dataclasses.asdict(x["cluster"]),
                                           plan=x["plan"] and x["plan"].to_dict())

    return {"gpus": r["gpus"], "found": row(r["found"]), "tried": [row(t) for t in r["tried"]]}


def _export(a) -> int:
    from .distributed.export import export_checkpoint
    from .errors import CheckpointError
    from .hf_interop import check_export_target, check_vision_source

    check_export_target(a.out, a.force)  # before the checkpoint is opened: a refused target fails at once
    check_vision_source(a.vision_from)
    if not os.path.exists(a.checkpoint):
        raise CheckpointError(f"--checkpoint {a.checkpoint!r} does not exist; pass a run directory or a checkpoint folder.")
    # a layer at a time: no process holds the model, whatever its size (docs/design/expert_parallel.md)
    export_checkpoint(a.checkpoint, a.out, vision_from=a.vision_from, force=a.force, max_shard_size=a.max_shard_size)
    print(f"wrote {a.out}")
    return 0


def _size_arg(flag: str, example: str):
    """An argparse type: a size in bytes, or a number with a unit (5GB, 500MiB), as transformers takes it."""
    def parse(text: str) -> int:
        from .errors import ConfigError
        from .hf_interop import shard_bytes

        try:
            return shard_bytes(text)
        except ConfigError:
            raise argparse.ArgumentTypeError(f"{flag} must be a size of at least one byte (got {text!r}); "
                                             f"for example {flag} {example}.") from None

    return parse


class _Parser(argparse.ArgumentParser):
    """argparse's own mistakes (a missing or unknown argument, a value of the wrong kind) as the one
    `error: ...` sentence and exit 2 of every user error, through main, not a usage dump and SystemExit."""

    def error(self, message):
        from .errors import ConfigError

        m = re.fullmatch(r"argument (\S+): (.*)", message, re.S)
        if m and m.group(2).startswith(m.group(1)):  # a sentence of the checks below: it names the flag and the fix
            raise ConfigError(m.group(2))
        raise ConfigError(f"{message}; see `{self.prog} --help`.")

    def parse_args(self, args=None, namespace=None):
        from .errors import ConfigError

        a, extra = self.parse_known_args(args, namespace)
        if extra:  # found by the top parser, but the subcommand's help is the one that lists its arguments
            prog = f"{self.prog} {a.cmd}" if getattr(a, "cmd", None) else self.prog
            raise ConfigError(f"unrecognized arguments: {' '.join(extra)}; see `{prog} --help`.")
        return a


def _int_arg(flag: str, lo: int, example: int, below: int | None = None):
    """An argparse type: a whole number >= lo (and < below), else a sentence naming the flag."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a whole number (got {text!r}); for example {flag} {example}.") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{flag} must be >= {lo} (got {v}); for example {flag} {example}.")
        if below is not None and v >= below:
            raise argparse.ArgumentTypeError(f"{flag} must be below {below_text} (got {v}); for example {flag} {example}.")
        return v

    below_text = "2**63" if below == 2**63 else str(below)
    return parse


def _float_arg(flag: str, example: str):
    """An argparse type: a finite number >= 0."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = float("nan")
        if not (math.isfinite(v) and v >= 0):
            raise argparse.ArgumentTypeError(f"{flag} must be a finite number >= 0 (got {text!r}); for example {flag} {example}.")
        return v

    return parse


def _device_arg(text: str) -> str:
    if text in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", text):
        return text
    raise argparse.ArgumentTypeError(f"--device must be auto, cpu, cuda or cuda:N (got {text!r}); for example --device cpu.")


def _path_arg(flag: str, example: str, home: bool = False, keep: tuple = ()):
    """An argparse type: a path that is not empty and has no NUL; with `home`, a leading ~user must be a
    user of this machine (the reader expands it). Values in `keep` (e.g. "byte") pass as they are."""
    def parse(text: str) -> str:
        if text in keep:
            return text
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{flag} is empty; pass a path, for example {flag} {example}.")
        if "\0" in text:
            raise argparse.ArgumentTypeError(f"{flag} {text!r} has a NUL character, which no path can hold; pass a real path.")
        if home and text.startswith("~"):
            try:
                Path(text).expanduser()
            except RuntimeError:
                raise argparse.ArgumentTypeError(f"{flag} {text!r} starts with the home folder of a user this machine "
                                                 "does not have; write the path out in full.") from None
        return text

    return parse


_tokenizer_arg = _path_arg("--tokenizer", "tokenizer.json", home=True, keep=("byte",))


def _train_arguments(t) -> None:
    """The arguments of `train`, which `sft` takes as they are."""
    from .config.train import preset_names

    t.add_argument("--config", type=_path_arg("--config", "run.toml", home=True), help="TOML or YAML config file")
    t.add_argument("--preset", help=f"model or training preset ({', '.join(preset_names())})")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a setting, e.g. model.hidden_size=256 or stages.0.steps=10")
    t.add_argument("--out", type=_path_arg("--out", "runs/demo"), help="output directory (default: out_dir of the config)")
    t.add_argument("--print-config", action="store_true", help="print the resolved, validated config and exit")
    t.add_argument("--resume", action="store_true", help="continue the run in OUT from its checkpoint, with its saved config "
                   "(--set may change only stages.N.steps, eval_every, ckpt_every, log_every and parallel.*)")
    t.add_argument("--force", action="store_true", help="start afresh in an OUT that holds a run: delete its checkpoints, "
                   "metrics, config.json, summary, plots and TensorBoard events (nothing else)")
    t.add_argument("--max-steps", type=_int_arg("--max-steps", 1, 100), help="stop (with a checkpoint) after this many steps in total")
    t.add_argument("--quiet", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="longctx", description="Train hybrid long-context sparse models (KDA + DSA + MoE + mHC).")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="train (no arguments: the CPU demo on the embedded stdlib corpus)")
    _train_arguments(t)
    t.set_defaults(fn=_train)

    f = sub.add_parser("sft", help="supervised fine-tuning on conversations: `train` with task = sft (no arguments: "
                       "the embedded long-context retrieval task)")
    _train_arguments(f)
    f.set_defaults(fn=_sft)

    r = sub.add_parser("rl", help="reinforcement learning with group-relative advantages: `train` with task = rl (no "
                       "arguments: rollouts of the embedded retrieval task, rewarded by exact match)")
    _train_arguments(r)
    r.set_defaults(fn=_rl)

    g = sub.add_parser("generate", help="sample from a checkpoint through the decode path")
    g.add_argument("--checkpoint", required=True)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=_int_arg("--max-new-tokens", 0, 200), default=200)
    g.add_argument("--temperature", type=_float_arg("--temperature", "0.8"), default=0.8, help="0 = greedy")
    g.add_argument("--top-k", type=_int_arg("--top-k", 0, 40), default=40, help="sample from the k likeliest ids; 0 = all")
    g.add_argument("--seed", type=_int_arg("--seed", 0, 0, below=2**63), default=0)
    g.add_argument("--tokenizer", type=_tokenizer_arg, default="byte", help='"byte" or a local tokenizer.json')
    g.add_argument("--device", type=_device_arg, default="auto", help="auto, cpu, cuda or cuda:N")
    g.set_defaults(fn=_generate)

    e = sub.add_parser("eval", help="held-out per-position loss of a checkpoint")
    e.add_argument("--checkpoint", required=True)
    e.add_argument("--data", type=_path_arg("--data", "corpus/", home=True),
                   help="text file/folder (default: the embedded corpus's held-out documents)")
    e.add_argument("--eval-docs", type=_int_arg("--eval-docs", 1, 2), default=2, help="documents of --data held out")
    e.add_argument("--seq-len", type=_int_arg("--seq-len", 1, 4096), default=4096)
    e.add_argument("--windows", type=_int_arg("--windows", 1, 8), default=8)
    e.add_argument("--buckets", type=_int_arg("--buckets", 1, 8), default=8, help="position buckets (at most --seq-len)")
    e.add_argument("--tokenizer", type=_tokenizer_arg, default="byte", help='"byte" or a local tokenizer.json')
    e.add_argument("--device", type=_device_arg, default="auto", help="auto, cpu, cuda or cuda:N")
    e.add_argument("--json", action="store_true", help="print the result as JSON (loss, tokens, buckets) instead of the table")
    e.set_defaults(fn=_eval)

    m = sub.add_parser("estimate", help="predict peak memory and pick the memory plan for a preset and length")
    m.add_argument("--preset", default="h200-ref")
    m.add_argument("--seq-len", type=int, required=True)
    m.add_argument("--cp", type=int, help="context-parallel degree (default 1; with --gpus: the smallest that fits)")
    m.add_argument("--gpus", type=int, help="the per-GPU breakdown of a step over this many GPUs: FSDP over all of them, "
                   "dp = GPUS / cp")
    m.add_argument("--ep", type=int, help="with --gpus: ranks that split each MoE layer's routed experts (default 1)")
    m.add_argument("--kda-cp", choices=("hidden_gather", "qkv_a2a", "chunk_state"),
                   help="with --gpus: how KDA runs under cp > 1, as parallel.kda_cp (default hidden_gather)")
    m.add_argument("--param-dtype", choices=("fp32", "bf16"), help="with --gpus: what FSDP's all-gather delivers "
                   "(default fp32, as the trainer shards; bf16 gathers leave autocast no weight copies)")
    m.add_argument("--offload-optimizer", action="store_true", help="with --gpus: the AdamW moments in host memory")
    m.add_argument("--host-gib", type=float, help="with --gpus or --fit: host memory per GPU (default: the --gpu entry's)")
    m.add_argument("--fit", action="store_true", help="the smallest cluster of 8, 16, 32, ... GPUs on which the step fits, "
                   "with the parallel layout and the dominant term")
    m.add_argument("--gpu", default="h200", help="the GPU whose memory the plan fits: h200, h100, b200 or cpu "
                   "(default h200)")
    m.add_argument("--set", action="append", metavar="SWITCH=VALUE", help="force a memory switch, e.g. offload=0")
    m.add_argument("--kernel", action="append", metavar="OP=BACKEND",
                   help="a kernel setting of the run, as the training config's kernels.OP, e.g. mhc=torch "
                        "(default: every op auto, its fast path on a GPU)")
    m.add_argument("--phases", action="store_true", help="also print each phase of the step (end of the forward, "
                   "each block's backward, each chunk case) with its estimated GPU total")
    m.add_argument("--json", action="store_true")
    m.set_defaults(fn=_estimate)

    x = sub.add_parser("export", help="write a checkpoint in the GLM-5.3-Flash (transformers) layout")
    x.add_argument("--checkpoint", required=True)
    x.add_argument("--out", required=True)
    x.add_argument("--vision-from", help="a GLM-5.3-Flash directory to copy the vision tower from")
    x.add_argument("--force", action="store_true",
                   help="replace --out even when it is a file or a folder that is not empty (it is refused otherwise)")
    x.add_argument("--max-shard-size", type=_size_arg("--max-shard-size", "5GB"), default="5GB",
                   help="the largest safetensors file, in bytes or with a unit (default 5GB); a larger model is "
                        "several files and model.safetensors.index.json, as transformers writes them")
    x.set_defaults(fn=_export)
    return p


ERROR_WAIT_S = 10.0  # how long a rank other than 0 waits to hear whether rank 0 met the same error


def _error_store():
    """A client of the key-value store torchrun's agent serves its workers (MASTER_ADDR:MASTER_PORT), or
    None where there is none to reach."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    try:
        return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                        timeout=timedelta(seconds=3), wait_for_workers=False)
    except Exception:  # noqa: BLE001 - no store to reach: every rank says its error
        return None


def _say_user_error(e) -> None:
    """`error: <sentence>` on stderr, once per torchrun job: every rank meets a mistake in the settings
    alike, so rank 0 alone says it and the others, on finding rank 0's sentence equal to theirs in
    torchrun's store, exit without a word. A rank whose error rank 0 did not meet (within
    ERROR_WAIT_S), or met otherwise (a path one node lacks), says its own, naming its rank."""
    text, world, rank = str(e), int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    store = _error_store() if world > 1 and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ else None
    if store is not None:
        from datetime import timedelta

        key = (f"longctx/user_error/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
               f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        try:
            if rank == 0:
                store.set(key, text)
            else:
                store.wait([key], timedelta(seconds=ERROR_WAIT_S))
                if store.get(key).decode() == text:
                    return
        except Exception:  # noqa: BLE001 - rank 0 said nothing in time: this rank's error is its own
            pass
    print(f"error: {text}" if rank == 0 or world == 1 else f"error: rank {rank}: {text}", file=sys.stderr)


def main(argv=None) -> int:
    from .errors import UserError

    try:
        a = build_parser().parse_args(argv)
        return a.fn(a)
    except UserError as e:
        _say_user_error(e)
        return 2
    except KeyboardInterrupt as e:  # trainer.Interrupted carries the signal and how to resume
        hint = e.resume_hint() if hasattr(e, "resume_hint") else "interrupted"
        try:
            print(hint, file=sys.stderr, flush=True)
        except OSError:  # stderr's reader is gone as well (`2>&1 | tee`)
            pass
        return 128 + getattr(e, "signum", 2)  # 2 = SIGINT: a KeyboardInterrupt before the run began
    except BrokenPipeError:  # `longctx estimate ... | head`: the reader left; not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
