"""Training checkpoints: model, optimizer, data position, RNG, router balancing state — atomically.

Layout of an output directory:
    DIR/ckpt-000120/            one complete checkpoint (weights in our safetensors layout + state)
    DIR/checkpoint -> ckpt-000120   a symlink, flipped with os.replace only after the new
                                    checkpoint is fully written and fsynced
So a crash or Ctrl-C mid-write never leaves `DIR/checkpoint` pointing at a partial checkpoint,
and the previous one stays until the new one is in place. Pruning keeps the newest KEEP checkpoints
at or below the new step, by step number (the names grow a digit past step 999999); a checkpoint
of a later step (a run rolled back by pointing the link at an older one) is left alone. The MoE
router's selection bias is a buffer, so it travels with the weights; pending balancer updates are
applied before saving.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .errors import CheckpointError

LINK = "checkpoint"
KEEP = 2
DCP_METADATA = ".metadata"  # the file torch.distributed.checkpoint writes last: a sharded checkpoint
_CKPT_NAME = re.compile(r"ckpt-(\d+)")


def fsync_dir(path: str):
    try:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    except OSError:
        pass


def rng_state() -> dict:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict):
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def write_model_files(model, directory: str):
    """Weights (our key layout, safetensors) and the model config: what `load_pretrained` reads."""
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "longctx_config.json"), "w") as f:
        f.write(model.cfg.to_json())


def save(out_dir: str, step: int, model, optimizer, trainer_state: dict, config_dict: dict) -> str:
    """Write DIR/ckpt-<step>/ then flip DIR/checkpoint to it. Returns the checkpoint path."""
    os.makedirs(out_dir, exist_ok=True)
    name = f"ckpt-{step:06d}"
    final = os.path.join(out_dir, name)
    tmp = final + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write_model_files(model, tmp)
    with open(os.path.join(tmp, "train_config.json"), "w") as f:
        json.dump(config_dict, f, indent=2, default=str)
    torch.save({"optimizer": optimizer.state_dict() if optimizer is not None else None,
                "trainer": trainer_state, "rng": rng_state(), "step": step}, os.path.join(tmp, "trainer_state.pt"))
    for fn in os.listdir(tmp):
        with open(os.path.join(tmp, fn), "rb") as f:
            os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    fsync_dir(out_dir)
    link_tmp = os.path.join(out_dir, LINK + ".new")
    if os.path.lexists(link_tmp):
        os.remove(link_tmp)
    os.symlink(name, link_tmp)
    os.replace(link_tmp, os.path.join(out_dir, LINK))
    fsync_dir(out_dir)
    olds = sorted((s, d) for d in os.listdir(out_dir) if (s := step_of_name(d)) is not None and s < step)
    for _, d in olds[: max(0, len(olds) - (KEEP - 1))]:
        shutil.rmtree(os.path.join(out_dir, d), ignore_errors=True)
    return final


def step_of_name(name: str) -> int | None:
    """The step of a complete checkpoint folder's name (ckpt-000120 -> 120); None for anything else."""
    m = _CKPT_NAME.fullmatch(name)
    return int(m.group(1)) if m else None


def resolve(path: str) -> str:
    """A run directory (its `checkpoint` link) or a checkpoint directory -> the checkpoint directory."""
    if os.path.isdir(os.path.join(path, LINK)):
        return os.path.realpath(os.path.join(path, LINK))
    if os.path.exists(os.path.join(path, "trainer_state.pt")) or os.path.exists(os.path.join(path, "longctx_config.json")):
        return path
    raise CheckpointError(
        f"--checkpoint {path!r} holds no checkpoint; pass a run directory written by `longctx train` or a ckpt-* folder in it."
    )


def is_sharded(path: str) -> bool:
    """A checkpoint folder written by torch.distributed.checkpoint (several processes): DCP's `.metadata`
    file. Its reader is longctx.distributed.checkpoint (which sits above this module); a folder
    without one is this module's safetensors layout."""
    return os.path.isfile(os.path.join(path, DCP_METADATA))


def read_weights(ck: str, device=None) -> dict:
    """The checkpoint folder's weights (our key layout), whole, on `device`."""
    try:
        return load_file(os.path.join(ck, "model.safetensors"), device=str(device or "cpu"))
    except Exception as exc:
        raise CheckpointError(f"checkpoint {ck!r} is corrupt ({type(exc).__name__}: {exc}); resume from an earlier ckpt-* folder or start afresh.") from None


def check_weights(ck: str, sd: dict, model) -> None:
    """Refuse (one sentence) weights that do not fit `model`: a key missing or extra, or a shape that
    differs. The model may be sharded: a DTensor's shape is the whole tensor's."""
    own = model.state_dict()
    shapes = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in sd.items() if k in own and v.shape != own[k].shape]
    if shapes:
        raise CheckpointError(
            f"checkpoint {ck!r} does not match the model (checkpoint vs model shapes: {'; '.join(shapes[:3])}); "
            "resume with the same model settings it was written with.")
    missing = [k for k in own if k not in sd and not (k == "lm_head.weight" and model.cfg.tie_word_embeddings)]
    unexpected = [k for k in sd if k not in own]
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {ck!r} does not match the model (missing {missing[:4]}, unexpected {unexpected[:4]}); "
            "resume with the same model settings it was written with."
        )


def read_state(ck: str) -> dict | None:
    """trainer_state.pt (optimizer, trainer state, RNG, step); None for a weights-only folder."""
    state_file = os.path.join(ck, "trainer_state.pt")
    if not os.path.exists(state_file):
        return None
    try:
        return torch.load(state_file, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {ck!r} has a corrupt trainer_state.pt ({type(exc).__name__}); resume from an earlier ckpt-* folder.") from None


def trainer_state(st: dict) -> dict:
    """What `load` returns of a trainer_state.pt: the step and the trainer's own state."""
    return {"step": st.get("step", 0), **(st.get("trainer") or {})}


def load(path: str, model, optimizer=None, device=None) -> dict:
    """Load weights (and optimizer + RNG) into the given objects; returns the trainer state dict."""
    ck = resolve(path)
    sd = read_weights(ck, device)
    check_weights(ck, sd, model)
    model.load_state_dict(sd, strict=False)  # strict but for a tied lm_head.weight, which check_weights allowed
    st = read_state(ck)
    if st is None:
        return {}
    if optimizer is not None and st.get("optimizer") is not None:
        optimizer.load_state_dict(st["optimizer"])
    if st.get("rng") is not None:
        set_rng_state(st["rng"])
    return trainer_state(st)


def read_model_config(path: str) -> dict:
    ck = resolve(path)
    try:
        with open(os.path.join(ck, "longctx_config.json")) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {ck!r} has no readable longctx_config.json ({exc}); it is corrupt or not a longctx checkpoint.") from None
