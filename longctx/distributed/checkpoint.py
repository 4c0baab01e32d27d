"""Sharded training checkpoints through torch.distributed.checkpoint (DCP): model, optimizer and the
trainer's own state, written by every rank at once, atomically, and readable at any world size.

    save(path, model, optimizer, {"step": 120, "data": stream.state_dict()})
    extra = load(path, model, optimizer)        # any world size, FSDP-sharded or a plain model
    state = load_checkpoint(run_dir, model, optimizer)  # either format, by the folder: DCP or one process's
    full = to_full_state_dict(model)            # rank 0: every tensor whole, on the CPU (export)

Layout of `path` (a folder): DCP's `.metadata` and one `__<rank>_0.distcp` file per writing rank
(each rank writes only its shards of the parameters and of the optimizer state), plus `extra.pt`,
the trainer state rank 0 holds (step, data cursor, RNG: anything torch.save takes).

Atomic: every rank writes into `path.partial`; when all have written (DCP's save ends with the
metadata on rank 0, which has heard from every rank) rank 0 writes `extra.pt`, moves a previous
`path` aside, renames `path.partial` to `path`, and only then deletes the old copy; a barrier then
holds every rank until `path` exists. A crash leaves `path` as it was (or, between the two renames,
`path.old` beside a complete `path.partial`). Multi-node runs need `path` on a file system all
ranks share.

Resharding: the state dicts come from `get_state_dict` (`torch.distributed.checkpoint.state_dict`),
keyed by parameter name whatever the sharding, and DCP reads each rank's part of every tensor
from whichever files hold it: a checkpoint of 2 FSDP ranks loads into 4, or into one plain model.
A checkpoint of one process (longctx.checkpoint: whole tensors in safetensors) goes into an FSDP model
through `load_full`: every rank reads the whole files and keeps its shards. `load_checkpoint` picks the
reader by the folder's format, so the trainer, export, eval and generate read either at any world size.

Optimizer state exists only for the parameters that have had a gradient (AdamW creates it on the
first step that sees one: the indexer's, for one, get none from the LM loss); `load` gives the
optimizer state for exactly the parameters the checkpoint has it for, so a parameter's first
gradient after a resume starts its moments and step count from zero, as it would have without one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from .. import checkpoint as ckpt
from ..checkpoint import fsync_dir

EXTRA = "extra.pt"
METADATA = ckpt.DCP_METADATA


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _barrier() -> None:
    if _dist():
        dist.barrier()


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes one process whenever no process group is up: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")
        yield


def _error(msg: str):
    from ..errors import CheckpointError

    return CheckpointError(msg)


def _state_dicts(model, optimizer):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def save(path: str, model, optimizer, extra: dict | None = None) -> str:
    """Write model, optimizer (or None) and `extra` (rank 0's copy) to the folder `path`, atomically;
    every rank of the default process group calls it (or the one process, without one). Returns `path`."""
    import torch.distributed.checkpoint as dcp

    path = os.path.abspath(path)
    partial, old = path + ".partial", path + ".old"
    if _rank() == 0:  # a partial folder is a save that never finished: nothing in it is kept
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    _barrier()
    # an optimizer that has not stepped has no state to keep, and asking DCP for it would create some
    # (get_state_dict initialises it with a zero-gradient step, which counts in Adam's bias correction)
    with _quiet_single_process():
        dcp.save(_state_dicts(model, optimizer if optimizer is not None and optimizer.state else None),
                 checkpoint_id=partial)
    if _rank() == 0:
        with open(os.path.join(partial, EXTRA), "wb") as f:
            torch.save(dict(extra or {}), f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(partial)
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(partial, path)
        fsync_dir(os.path.dirname(path))
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return path


def _saved_keys(path: str) -> set:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(path).read_metadata().state_dict_metadata)


def _cause(exc: BaseException) -> str:
    """The first rank's own error inside DCP's CheckpointException (which names the key), one line."""
    failures = getattr(exc, "failures", None)
    if failures:
        exc = next(iter(failures.values()))[0]
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]


def load(path: str, model, optimizer=None) -> dict:
    """Read the checkpoint folder `path` into `model` (and `optimizer`), whatever world size and
    sharding wrote it; every rank calls it. Returns the `extra` dict that `save` was given. A
    checkpoint saved before the optimizer's first step leaves the optimizer as it is."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    path = os.path.abspath(path)
    if not os.path.isfile(os.path.join(path, METADATA)):
        hint = " (its save never finished)" if path.endswith(".partial") else ""
        raise _error(f"{path!r} holds no complete sharded checkpoint{hint}; pass a folder written by "
                     "longctx.distributed.checkpoint.save.")
    keys = _saved_keys(path)
    if not any(k.startswith("optim.") for k in keys):
        optimizer = None  # saved before the first step: the fresh optimizer is what that run had
    sd = _state_dicts(model, optimizer)
    if optimizer is not None:
        # get_state_dict gives every parameter optimizer state; keep only what the checkpoint has
        sd["optim"]["state"] = {fqn: st for fqn, st in sd["optim"]["state"].items()
                                if any(f"optim.state.{fqn}.{name}" in keys for name in st)}
    try:
        with _quiet_single_process():
            dcp.load(sd, checkpoint_id=path)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's exception is a BaseException
        raise _error(f"checkpoint {path!r} does not match the model ({_cause(exc)}); load it into a model with "
                     "the settings it was written with.") from None
    if optimizer is None:
        set_model_state_dict(model, sd["model"])
    else:
        # not strict: parameters without saved optimizer state are meant to have none (every model
        # key was read, or dcp.load above would have refused)
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                       options=StateDictOptions(strict=False))
    extra_file = os.path.join(path, EXTRA)
    if not os.path.exists(extra_file):
        return {}
    return torch.load(extra_file, map_location="cpu", weights_only=False)  # written by `save`: trainer state, RNG


def load_checkpoint(path: str, model, optimizer=None, device=None) -> dict:
    """Any longctx checkpoint (a run folder or a ckpt-* folder) into `model` and `optimizer`, whatever
    the world size on either side: a sharded one (DCP's `.metadata`) through `load`, into a plain or an
    FSDP model; a one-process one (longctx.checkpoint's safetensors layout) through
    longctx.checkpoint.load into a plain model, or through `load_full` into an FSDP-sharded one. The
    format is read from the folder, not from how this process runs, so a run written by 2 processes
    resumes in 1 and one written by 1 process resumes under torchrun. Sets the checkpoint's RNG and
    returns the trainer state {"step": N, ...}; every rank calls it."""
    from .fsdp import is_sharded

    ck = ckpt.resolve(path)
    if ckpt.is_sharded(ck):
        extra = load(ck, model, optimizer)  # the trainer's extra: trainer_state.pt's keys (step, trainer, rng)
        if extra.get("rng") is not None:
            ckpt.set_rng_state(extra["rng"])
        return ckpt.trainer_state(extra)
    if is_sharded(model):
        return load_full(ck, model, optimizer)
    return ckpt.load(ck, model, optimizer, device=device)


def load_full(path: str, model, optimizer=None) -> dict:
    """A one-process checkpoint (whole tensors in safetensors, the optimizer's own state dict in
    trainer_state.pt) into an FSDP-sharded `model` and its `optimizer`: every rank reads the whole
    files and keeps its shards (`set_model_state_dict` / `set_optimizer_state_dict` with
    full_state_dict). The saved optimizer state is keyed by parameter position; the position maps to
    a name through this optimizer's groups, which `make_optimizer` builds in the same order in one
    process and sharded. Sets the RNG; returns the trainer state {"step": N, ...}."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    ck = ckpt.resolve(path)
    sd = ckpt.read_weights(ck)
    ckpt.check_weights(ck, sd, model)
    if model.cfg.tie_word_embeddings and "lm_head.weight" not in sd:  # one tensor, saved once
        sd["lm_head.weight"] = sd["embed.weight"]
    set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True))
    st = ckpt.read_state(ck)
    if st is None:
        return {}
    saved = st.get("optimizer")
    if optimizer is not None and saved is not None and saved.get("state"):
        names = {p: n for n, p in model.named_parameters()}
        groups = optimizer.param_groups
        if [len(g["params"]) for g in saved["param_groups"]] != [len(g["params"]) for g in groups]:
            raise _error(f"checkpoint {ck!r} holds optimizer state for parameter groups of "
                         f"{[len(g['params']) for g in saved['param_groups']]} parameters, this run's optimizer has "
                         f"{[len(g['params']) for g in groups]}; resume with the settings it was written with.")
        fqn = {i: names[p] for sg, g in zip(saved["param_groups"], groups) for i, p in zip(sg["params"], g["params"])}
        full = {"state": {fqn[i]: s for i, s in saved["state"].items()},
                "param_groups": [{**{k: v for k, v in sg.items() if k != "params"}, "params": [fqn[i] for i in sg["params"]]}
                                 for sg in saved["param_groups"]]}
        # not strict: parameters that never had a gradient have no state, as in `load`
        set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True, strict=False))
        # set_optimizer_state_dict first gives every parameter state (a zero-gradient step); those the
        # checkpoint has none for start without, so their first gradient starts Adam's count at zero
        for g in groups:
            for p in g["params"]:
                if names[p] not in full["state"]:
                    optimizer.state.pop(p, None)
    if st.get("rng") is not None:
        ckpt.set_rng_state(st["rng"])
    return ckpt.trainer_state(st)


def to_full_state_dict(model) -> dict:
    """The model's state dict with every tensor whole and on the CPU: on rank 0 of a sharded run (the
    other ranks get {}), or in one process. Every rank calls it (the gathers are collective). What
    an export writes (e.g. `hf_interop.state_dict_to_hf`), or `load_state_dict` of a plain model takes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from .fsdp import is_sharded

    if not is_sharded(model):
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
