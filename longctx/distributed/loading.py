"""Start a model from a checkpoint without any process holding the whole model: every rank reads,
from the checkpoint's safetensors, only the slices that its own parameter shards cover.

    with torch.device("meta"):
        model = LongCtxModel(checkpoint_config(path))   # nothing allocated yet
    apply_expert_parallel(model, mesh, ep)               # its experts: DTensors over ep
    parallelize(model, mesh)                             # FSDP2: everything sharded
    log = load_into(model, path, device)                 # storage for its shards, then its slices

`path` is a transformers GLM-5.3-Flash folder (`save_pretrained`: config.json, safetensors in the
hub layout, per-expert tensors), a longctx checkpoint folder (longctx_config.json and
model.safetensors in our layout, or a DCP checkpoint written under torchrun) or a run folder (its
`checkpoint` link). The model may be plain (one process: every tensor is read whole) or sharded.

What a rank reads. Each parameter is a DTensor once EP and FSDP are on, and its local shard covers
one box of the global tensor: `compute_local_shape_and_global_offset` of its mesh and placements
(FSDP's Shard(0) rows over dp x cp; EP's Shard(0) experts over ep, then FSDP's Shard(1) or strided
Shard(0) over efsdp). The rank reads exactly that box with safetensors' `get_slice`, which copies
only those bytes out of the memory-mapped file, so no rank reads or holds what its shards do not.
The hub layout asks for three translations, each done on the box:
- names: our keys to hub keys (`hf_interop.hub_name`);
- the fused experts: our `experts.gate_up` [E, 2I, h] is, per expert e, the rows of the hub's
  `experts.e.gate_proj` [I, h] then those of `experts.e.up_proj`, and `experts.down` [E, h, I] is
  `experts.e.down_proj`; a rank opens only its experts' tensors and, within them, only its rows
  (with efsdp's Shard(1) over 2 ranks, one reads the gate rows and the other the up rows);
- the tied head: one parameter, read from the embedding (or from `lm_head.weight` when only that is
  saved); when both are saved, the rank's rows of the two must agree.
Buffers (the routers' selection bias) are replicated and read whole. Vision tensors and the
multi-token-prediction layers are skipped, as `load_pretrained` skips them; a tensor missing, of
another shape, or left over is refused before anything is read. Every read goes into the
returned `ReadLog` (the checkpoint's tensor name and the box), which the tests count.

A DCP checkpoint (ours, written under torchrun) is read by `checkpoint.load`: DCP already reads
each rank's shards only, at any world size.

Why our own code: DCP reads only its own format, and what torch offers for anything else,
`set_model_state_dict(full_state_dict=True)` (`checkpoint.load_full`), wants every tensor whole on
every rank, which for GLM-5.3-Flash is hundreds of GB per process. transformers' own loader builds
its model, not ours. safetensors' slices give each rank its box; the rest (the box of a DTensor,
the renames, the expert rows) is the few lines here, on torch.distributed.tensor's own layout.

The training setting `init_from` comes through here (`init_model_config` for the model settings,
`load_into` for the weights; the trainer builds its model on the meta device when it is set).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re

import torch

from .. import checkpoint as ckpt
from ..config import ModelConfig
from ..errors import CheckpointError, ConfigError
from ..hf_interop import HF_PREFIX, OUR_CONFIG, _is_vision, config_from_hf, hub_name

# Model settings that say how to train or run the weights, not what they are: an `init_from` run may
# set them to other values than the checkpoint's config has. Every other model setting is the checkpoint's.
TRAINING_FIELDS = ("balancer", "balancer_rate", "aux_loss_coef", "indexer_loss", "indexer_loss_coef",
                   "indexer_loss_dense_below", "kda_chunk_size", "init_std")

Box = tuple  # ((start, stop), ...) per dim of a global tensor


# ------------------------------------------------------------------------------ what a folder holds
def checkpoint_kind(path: str) -> tuple[str, str]:
    """("hf" | "ours" | "dcp", the folder holding the weights) of a transformers folder, a longctx
    checkpoint (one process's safetensors or a DCP one) or a run folder (its `checkpoint` link)."""
    p = os.path.expanduser(path)
    if not os.path.isdir(p):
        raise CheckpointError(f"checkpoint {path!r} is not a folder; point it at a GLM-5.3-Flash folder, "
                              "a longctx checkpoint or a run folder.")
    if os.path.lexists(os.path.join(p, ckpt.LINK)):
        if not os.path.isdir(os.path.join(p, ckpt.LINK)):
            raise CheckpointError(f"run folder {path!r} has a checkpoint link that points nowhere; "
                                  "point at one of its ckpt-* folders instead.")
        p = ckpt.resolve(p)
    if ckpt.is_sharded(p):
        return "dcp", p
    if os.path.isfile(os.path.join(p, OUR_CONFIG)):
        return "ours", p
    cfg = os.path.join(p, "config.json")
    if os.path.isfile(cfg):
        if "stages" in _read_json(cfg):
            raise CheckpointError(f"{path!r} is a run folder without a checkpoint yet; point at a run "
                                  "that has written one, or at a checkpoint folder.")
        return "hf", p
    raise CheckpointError(f"{path!r} holds no checkpoint (no config.json, {OUR_CONFIG} or checkpoint link); "
                          "point it at a GLM-5.3-Flash folder, a longctx checkpoint or a run folder.")


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path!r} cannot be read as JSON ({exc}); restore the file.") from None


def checkpoint_config(path: str) -> ModelConfig:
    """The ModelConfig of the model a checkpoint holds: config.json as transformers reads it
    (`config_from_hf`), or longctx_config.json."""
    kind, where = checkpoint_kind(path)
    if kind != "hf":
        return ModelConfig.from_dict(_read_json(os.path.join(where, OUR_CONFIG)))
    hf = _read_json(os.path.join(where, "config.json"))
    if hf.get("model_type") not in ("glm5_next", "glm5_next_text", None):
        raise ConfigError(f"config.json model_type is {hf.get('model_type')!r}; longctx loads GLM-5.3-Flash "
                          "('glm5_next') checkpoints.")
    return config_from_hf(hf)


def init_model_config(path: str, model: ModelConfig, given) -> ModelConfig:
    """The model an `init_from` run trains: the checkpoint's config, with the model settings the run
    gave (`given`: their names; None = every field of `model`) laid over it. Those must agree with
    the checkpoint unless they are TRAINING_FIELDS; a disagreement is one sentence (ConfigError)."""
    try:
        ck = checkpoint_config(path)
    except (CheckpointError, ConfigError) as exc:
        raise ConfigError(f"init_from {path!r}: {exc}") from None
    names = [f.name for f in dataclasses.fields(ModelConfig)] if given is None else sorted(given)
    bad = [n for n in names if n not in TRAINING_FIELDS and getattr(model, n) != getattr(ck, n)]
    if bad:
        theirs = ", ".join(f"{n} = {getattr(ck, n)!r}" for n in bad[:3])
        ours = ", ".join(f"model.{n} = {getattr(model, n)!r}" for n in bad[:3])
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise ConfigError(f"init_from {path!r} holds a model with {theirs}, but this run sets {ours}{more}; leave "
                          f"{'that setting' if len(bad) == 1 else 'those settings'} out to train the checkpoint's "
                          f"model (only {', '.join(TRAINING_FIELDS)} may differ from it).")
    return ck.replace(**{n: getattr(model, n) for n in names})


# ------------------------------------------------------------------------------ the reads
@dataclasses.dataclass
class Read:
    key: str  # the tensor's name in the checkpoint
    box: Box  # [start, stop) per dim of that tensor
    shape: tuple  # the tensor's whole shape

    @property
    def numel(self) -> int:
        n = 1
        for a, b in self.box:
            n *= b - a
        return n

    @property
    def whole(self) -> bool:
        return all(a == 0 and b == s for (a, b), s in zip(self.box, self.shape))


@dataclasses.dataclass
class ReadLog:
    """What one rank read of a checkpoint: its format and every slice, in order."""

    kind: str
    reads: list = dataclasses.field(default_factory=list)

    def keys(self) -> set:
        return {r.key for r in self.reads}

    def elements(self, keys=None) -> int:
        return sum(r.numel for r in self.reads if keys is None or r.key in keys)


class _Files:
    """The checkpoint's safetensors, each opened once: a tensor's name -> its file."""

    def __init__(self, folder: str, stack: contextlib.ExitStack, log: ReadLog):
        from safetensors import safe_open

        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            names = sorted(set(_read_json(index)["weight_map"].values()))
        else:
            names = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        if not names:
            raise CheckpointError(f"no .safetensors files in {folder!r}; point at a checkpoint folder.")
        self.log, self.handle = log, {}
        for name in names:
            path = os.path.join(folder, name)
            try:
                f = stack.enter_context(safe_open(path, "pt"))
                for k in f.keys():
                    self.handle[k] = (f, path)
            except Exception as exc:  # corrupt or truncated file
                raise CheckpointError(f"checkpoint file {path!r} cannot be read ({exc}); it is corrupt — re-save it.") from None

    def shape(self, key: str) -> tuple:
        return tuple(self.handle[key][0].get_slice(key).get_shape())

    def read(self, key: str, box: Box) -> torch.Tensor:
        f, path = self.handle[key]
        try:
            t = f.get_slice(key)[tuple(slice(a, b) for a, b in box)]
        except Exception as exc:
            raise CheckpointError(f"checkpoint file {path!r} tensor {key!r} cannot be read ({exc}); it is corrupt "
                                  "— re-save it.") from None
        self.log.reads.append(Read(key, tuple(box), self.shape(key)))
        return t


# ------------------------------------------------------------------------------ sources of our tensors
@dataclasses.dataclass
class _Plain:
    """Our tensor is the checkpoint's tensor `key` (with `also`, a tied head's copy, to agree with it)."""

    key: str
    also: str | None = None

    def keys(self):
        return [self.key] + ([self.also] if self.also else [])

    def shapes(self, shape):
        return {k: shape for k in self.keys()}

    def read(self, files: _Files, box: Box) -> torch.Tensor:
        t = files.read(self.key, box)
        if self.also is not None and not torch.equal(t, files.read(self.also, box)):
            raise CheckpointError(f"checkpoint ties the head to the embedding (tie_word_embeddings) but its {self.also} "
                                  f"differs from {self.key}; re-save it with tie_word_embeddings false, or with one of them.")
        return t


@dataclasses.dataclass
class _GateUp:
    """Our fused `experts.gate_up` [E, 2I, h]: per expert, the rows of its gate_proj [I, h], then up_proj's."""

    gate: list
    up: list

    def keys(self):
        return self.gate + self.up

    def shapes(self, shape):
        e, two_i, h = shape
        return {k: (two_i // 2, h) for k in self.keys()}

    def read(self, files: _Files, box: Box) -> torch.Tensor:
        (e0, e1), (r0, r1), cols = box
        inter = files.shape(self.gate[e0])[0]
        per = []
        for e in range(e0, e1):
            parts = []
            if r0 < inter:
                parts.append(files.read(self.gate[e], ((r0, min(r1, inter)), cols)))
            if r1 > inter:
                parts.append(files.read(self.up[e], ((max(r0, inter) - inter, r1 - inter), cols)))
            per.append(torch.cat(parts, 0))
        return torch.stack(per)


@dataclasses.dataclass
class _Down:
    """Our `experts.down` [E, h, I]: expert e's down_proj [h, I]."""

    down: list

    def keys(self):
        return list(self.down)

    def shapes(self, shape):
        return {k: tuple(shape[1:]) for k in self.down}

    def read(self, files: _Files, box: Box) -> torch.Tensor:
        (e0, e1), *rest = box
        return torch.stack([files.read(self.down[e], tuple(rest)) for e in range(e0, e1)])


def _model_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """Every parameter (a tied head once, as the embedding) and persistent buffer, by state-dict name."""
    out = list(model.named_parameters())
    for name, b in model.named_buffers():
        owner, _, attr = name.rpartition(".")
        if attr not in model.get_submodule(owner)._non_persistent_buffers_set:
            out.append((name, b))
    return out


def _sources(tensors, cfg: ModelConfig, kind: str, present: set) -> dict:
    """Our tensor's name -> where in the checkpoint it comes from."""
    out = {}
    for name, t in tensors:
        if kind == "ours":
            out[name] = _Plain(name)
            continue
        m = re.match(r"layers\.(\d+)\.mlp\.experts\.(gate_up|down)$", name)
        if m:
            pre = f"{HF_PREFIX}layers.{m.group(1)}.mlp.experts."
            n = t.shape[0]
            if m.group(2) == "gate_up":
                out[name] = _GateUp([f"{pre}{e}.gate_proj.weight" for e in range(n)],
                                    [f"{pre}{e}.up_proj.weight" for e in range(n)])
            else:
                out[name] = _Down([f"{pre}{e}.down_proj.weight" for e in range(n)])
        elif name == "embed.weight" and cfg.tie_word_embeddings:
            emb, head = hub_name(name), "lm_head.weight"
            out[name] = _Plain(emb, head if head in present else None) if emb in present else _Plain(head)
        else:
            out[name] = _Plain(hub_name(name))
    return out


def _ignored(key: str, cfg: ModelConfig) -> bool:
    """Hub tensors that are not part of the text trunk: vision, multi-token prediction, and the empty
    shared MLP transformers saves for a model without shared experts."""
    m = re.match(re.escape(HF_PREFIX) + r"layers\.(\d+)\.(.*)$", key)
    if m and int(m.group(1)) >= cfg.num_layers:
        return True
    return _is_vision(key) or bool(cfg.n_shared_experts == 0 and m and m.group(2).startswith("mlp.shared_experts."))


def _check(sources: dict, tensors, files: _Files, cfg: ModelConfig, path: str) -> None:
    """Every tensor there with its shape, nothing left over: one sentence otherwise, before any read."""
    wanted = {}
    for name, t in tensors:
        wanted.update(sources[name].shapes(tuple(t.shape)))
    missing = sorted(k for k in wanted if k not in files.handle)
    extra = sorted(k for k in files.handle if k not in wanted and not _ignored(k, cfg))
    if missing or extra:
        parts = []
        for what, ks in (("missing", missing), ("unexpected", extra)):
            if ks:
                parts.append(f"{what} {len(ks)} tensor(s): {', '.join(ks[:8])}{' ...' if len(ks) > 8 else ''}")
        raise CheckpointError(f"checkpoint {path!r} does not match its config: {'; '.join(parts)}.")
    for k, shape in wanted.items():
        if files.shape(k) != shape:
            raise CheckpointError(f"checkpoint {path!r} tensor {k!r} has shape {files.shape(k)} but the config gives "
                                  f"{shape}; the config and the weights disagree.")


def local_box(t: torch.Tensor) -> tuple[torch.Tensor, Box]:
    """A tensor's local storage and the box of the global tensor it holds: a DTensor's local shard
    (from its mesh and placements, as DCP computes it), or a plain tensor whole."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(t, DTensor):
        return t, tuple((0, s) for s in t.shape)
    local = t.to_local()
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"a DTensor's local shard has shape {tuple(local.shape)}, but its placements "
                           f"{t.placements} give {tuple(shape)}; this sharding is not one box of the tensor.")
    return local, tuple((o, o + s) for o, s in zip(offset, shape))


def materialize(model, device=None) -> None:
    """Storage (contents undefined) for a model built on the meta device, sharded or not, on `device`."""
    if not any(t.is_meta for _, t in _model_tensors(model)):
        return
    model.to_empty(device=device or "cpu")
    if model.cfg.tie_word_embeddings and model.lm_head.weight is not model.embed.weight:
        model.lm_head.weight = model.embed.weight  # to_empty gives a plain model's two modules two tensors


@torch.no_grad()
def load_into(model, path: str, device=None) -> ReadLog:
    """Fill every parameter and buffer of `model` (a LongCtxModel: plain, or after
    `apply_expert_parallel` / `parallelize`; on the meta device or materialized) from the checkpoint
    `path`, each rank reading only what its shards hold. Every rank calls it. Returns the reads."""
    kind, where = checkpoint_kind(path)
    materialize(model, device)
    log = ReadLog(kind)
    if kind == "dcp":
        from .checkpoint import load

        load(where, model)
        return log
    tensors = _model_tensors(model)
    with contextlib.ExitStack() as stack:
        files = _Files(where, stack, log)
        sources = _sources(tensors, model.cfg, kind, set(files.handle))
        _check(sources, tensors, files, model.cfg, path)
        for name, t in tensors:
            local, box = local_box(t)
            if local.numel() == 0:
                continue  # an FSDP shard past the end of a short dim
            local.copy_(sources[name].read(files, box))
    return log
