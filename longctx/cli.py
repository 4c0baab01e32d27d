"""`longctx` command line: train, eval, generate, estimate, export.

A mistake in what the user asked for (a `UserError`) prints one line `error: ...` and exits 2;
Ctrl-C during training saves a checkpoint first and exits 130.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _train(a) -> int:
    from .train_config import load_train_config
    from .trainer import Trainer, check_out_dir, resume_config

    if a.resume:  # the run's saved config, with only what the flags may change on resume changed
        out = a.out or load_train_config(a.config, a.preset, a.set or []).out_dir
        check_out_dir(out, a.resume, a.force)
        cfg = resume_config(out, a.config, a.preset, a.set or [])
    else:
        cfg = load_train_config(a.config, a.preset, a.set or [])
        if a.out:
            cfg.out_dir = a.out
    if a.print_config:
        print(cfg.to_toml())
        return 0
    check_out_dir(cfg.out_dir, a.resume, a.force)  # before the corpus is read: a refusal is instant
    Trainer(cfg, quiet=a.quiet).run(resume=a.resume, stop_after=a.max_steps, force=a.force)
    return 0


def _load_model(path: str, device: str):
    import torch

    from . import checkpoint as ckpt
    from .config import ModelConfig
    from .errors import CheckpointError
    from .model import LongCtxModel

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    if not os.path.exists(path):
        raise CheckpointError(f"--checkpoint {path!r} does not exist; pass a run directory or a checkpoint folder.")
    if os.path.exists(os.path.join(path, "config.json")) and not os.path.exists(os.path.join(path, "longctx_config.json")) \
            and not os.path.exists(os.path.join(path, ckpt.LINK)):
        from .hf_interop import load_pretrained
        return load_pretrained(path, device=dev), dev
    model = LongCtxModel(ModelConfig.from_dict(ckpt.read_model_config(path))).to(dev)
    ckpt.load(path, model, device=dev)
    return model, dev


def _generate(a) -> int:
    import torch

    from .data.tokenizers import load_tokenizer
    from .generate import generate

    model, dev = _load_model(a.checkpoint, a.device)
    tok = load_tokenizer(a.tokenizer)
    ids = torch.as_tensor(tok.encode(a.prompt), dtype=torch.long, device=dev)[None]
    if ids.numel() == 0:
        from .errors import UserError
        raise UserError("--prompt is empty; give some text to continue.")
    out = generate(model, ids, a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, seed=a.seed)
    sys.stdout.write(tok.decode(out[0].tolist()) + "\n")
    return 0


def _eval(a) -> int:
    from .data.packing import eval_windows
    from .data.sources import load_split
    from .data.tokenizers import load_tokenizer, tokenize_documents
    from .evaluate import per_position_loss

    model, dev = _load_model(a.checkpoint, a.device)
    tok = load_tokenizer(a.tokenizer)
    _, held = load_split(a.data, eval_docs=a.eval_docs)
    windows = eval_windows(tokenize_documents(held, tok, quiet=True), a.seq_len, a.windows, starts_only=False).tokens
    res = per_position_loss(model, windows, n_buckets=a.buckets, device=dev, progress=sys.stderr.isatty())
    print(json.dumps(res, indent=2))
    return 0


def _estimate(a) -> int:
    from .memory.estimate import main as estimate_main

    return estimate_main(a)


def _export(a) -> int:
    from .hf_interop import check_export_target, export_hf

    check_export_target(a.out, a.force)  # before the (slow) load: a refused target fails at once
    model, _ = _load_model(a.checkpoint, "cpu")
    export_hf(model, a.out, vision_from=a.vision_from, force=a.force)
    print(f"wrote {a.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .train_config import preset_names

    p = argparse.ArgumentParser(prog="longctx", description="Train hybrid long-context sparse models (KDA + DSA + MoE + mHC).")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="train (no arguments: the CPU demo on the embedded stdlib corpus)")
    t.add_argument("--config", help="TOML or YAML config file")
    t.add_argument("--preset", help=f"model or training preset ({', '.join(preset_names())})")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a setting, e.g. model.hidden_size=256 or stages.0.steps=10")
    t.add_argument("--out", help="output directory (default: out_dir of the config)")
    t.add_argument("--print-config", action="store_true", help="print the resolved, validated config and exit")
    t.add_argument("--resume", action="store_true", help="continue the run in OUT from its checkpoint, with its saved config "
                   "(--set may change only stages.N.steps, eval_every, ckpt_every and log_every)")
    t.add_argument("--force", action="store_true", help="start afresh in an OUT that holds a run: delete its checkpoints, "
                   "metrics, config.json, summary, plots and TensorBoard events (nothing else)")
    t.add_argument("--max-steps", type=int, help="stop (with a checkpoint) after this many steps in total")
    t.add_argument("--quiet", action="store_true")
    t.set_defaults(fn=_train)

    g = sub.add_parser("generate", help="sample from a checkpoint through the decode path")
    g.add_argument("--checkpoint", required=True)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tokenizer", default="byte")
    g.add_argument("--device", default="auto")
    g.set_defaults(fn=_generate)

    e = sub.add_parser("eval", help="held-out per-position loss of a checkpoint")
    e.add_argument("--checkpoint", required=True)
    e.add_argument("--data", help="text file/folder (default: the embedded corpus's held-out documents)")
    e.add_argument("--eval-docs", type=int, default=2)
    e.add_argument("--seq-len", type=int, default=4096)
    e.add_argument("--windows", type=int, default=8)
    e.add_argument("--buckets", type=int, default=8)
    e.add_argument("--tokenizer", default="byte")
    e.add_argument("--device", default="auto")
    e.set_defaults(fn=_eval)

    m = sub.add_parser("estimate", help="predict peak memory and pick the memory plan for a preset and length")
    m.add_argument("--preset", default="h200-ref")
    m.add_argument("--seq-len", type=int, required=True)
    m.add_argument("--cp", type=int, default=1)
    m.add_argument("--gpu", default="h200")
    m.add_argument("--set", action="append", metavar="SWITCH=VALUE", help="force a memory switch, e.g. offload=0")
    m.add_argument("--residual-impl", default="auto", choices=("auto", "torch", "liger"),
                   help="the mHC path the run will take (the training setting residual_impl; auto = liger on a GPU)")
    m.add_argument("--kda-norm", default="auto", choices=("auto", "torch", "fla"),
                   help="KDA's gated output norm (the training setting kda_norm; auto = fla's on a GPU)")
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
    x.set_defaults(fn=_export)
    return p


def main(argv=None) -> int:
    from .errors import UserError

    a = build_parser().parse_args(argv)
    try:
        return a.fn(a)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `longctx estimate ... | head`: the reader left; not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
