"""Export a checkpoint to the GLM-5.3-Flash hub layout without any process holding the model: the
mirror image of `loading.py`, a layer at a time instead of a shard per rank.

    export_checkpoint("runs/glm/checkpoint", "hf/glm-tuned")     # what `longctx export` runs
    export_checkpoint(path, out, max_shard_size="5GB", vision_from="GLM-5.3-Flash/")

`path` is anything `loading.checkpoint_kind` knows: a longctx checkpoint of one process (whole tensors
in safetensors), a DCP checkpoint written under torchrun (every rank's shards), a run folder (its
`checkpoint` link), or a transformers GLM-5.3-Flash folder. The output is what transformers'
`save_pretrained` writes: config.json and safetensors files of at most `max_shard_size` each, with
`model.safetensors.index.json` when there is more than one (`hf_interop.write_hf`).

What is held at once. `Checkpoint` opens the folder reading only names, shapes and dtypes (safetensors
headers, DCP's `.metadata`) and refuses, in one sentence, tensors that do not fit the config before
any is read. Its `pieces` then read the embedding, each layer, and the final norm and head, one
after another: a layer's tensors come out of the safetensors with `safe_open` (only those bytes are
copied out of the memory-mapped files), or out of a DCP checkpoint with one `dcp.load` of a state
dict holding only that layer's keys (DCP assembles each whole tensor from whichever ranks' files
hold its shards, in this one process, without a process group). `hf_interop.state_dict_to_hf` renames
the piece and splits the fused experts into per-expert views (no copy), and the shard writer writes
each file as soon as it is full. So a process holds one layer plus the file being filled (whose
tensors may keep the layer before alive): at GLM-5.3-Flash's size, one layer's 288 experts, not
the 45 layers.

Why our own code: DCP and safetensors do the reading, safetensors the writing. What transformers
offers for the rest, `save_pretrained`, needs its own model built with every tensor in memory; the
hub layout's per-expert names and the order of the pieces are the few lines here and in hf_interop.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.checkpoint.api import CheckpointException

from ..config import ModelConfig
from ..errors import CheckpointError
from ..hf_interop import (DEFAULT_MAX_SHARD_SIZE, check_export_target, check_vision_source, export_pieces, hub_name,
                          shard_bytes, write_hf)
from ..model import LongCtxModel
from .checkpoint import _cause, _quiet_single_process
from .loading import ReadLog, _check, _Files, _model_tensors, _sources, checkpoint_config, checkpoint_kind

MODEL = "model."  # the model's keys in a DCP checkpoint sit under "model" (checkpoint.save's state dict)


class _DcpTensors:
    """A DCP checkpoint's model tensors by our names, as loading's `_Files` offers a safetensors folder's
    (`handle`, `shape`, for `_check`), read whole: several names at once are one `dcp.load` of just
    those keys, which reads only the files' byte ranges that hold them."""

    def __init__(self, folder: str, tied: bool):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        try:
            meta = FileSystemReader(folder).read_metadata().state_dict_metadata
        except Exception as exc:  # noqa: BLE001 - a truncated or foreign .metadata
            raise CheckpointError(f"checkpoint {folder!r} has metadata that cannot be read ({exc}); it is corrupt — "
                                  "export an earlier ckpt-* folder.") from None
        self.folder = folder
        self.handle = {k[len(MODEL):]: (m.properties.dtype, tuple(m.size)) for k, m in meta.items()
                       if k.startswith(MODEL) and isinstance(m, TensorStorageMetadata)}
        if tied:
            self.handle.pop("lm_head.weight", None)  # the embedding, which DCP saves under both names

    def shape(self, key: str) -> tuple:
        return self.handle[key][1]

    def read(self, names) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        sd = {n: torch.empty(self.handle[n][1], dtype=self.handle[n][0]) for n in names}
        try:
            with _quiet_single_process():
                dcp.load({"model": sd}, checkpoint_id=self.folder, no_dist=True)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's exception is a BaseException
            raise CheckpointError(f"checkpoint {self.folder!r} cannot be read ({_cause(exc)}); it is corrupt — "
                                  "export an earlier ckpt-* folder.") from None
        return sd


def _untie_distinct_head(files: _Files, cfg: ModelConfig) -> ModelConfig:
    """`load_pretrained`'s rule for a transformers folder that ties the head but saves one that differs
    from the embedding: transformers keeps both, untied, and so does the export."""
    emb, head = hub_name("embed.weight"), "lm_head.weight"
    if not (cfg.tie_word_embeddings and emb in files.handle and head in files.handle):
        return cfg
    if files.shape(emb) != files.shape(head):
        return cfg  # _check names the misshapen head
    whole = tuple((0, s) for s in files.shape(emb))
    same = torch.equal(files.read(emb, whole), files.read(head, whole))
    return cfg if same else cfg.replace(tie_word_embeddings=False)


class Checkpoint:
    """A checkpoint's model tensors, by our names, read a piece at a time (`pieces`); a context manager
    (it keeps the safetensors files open). `cfg` is the model's config, `shapes` our tensors' shapes
    (a tied head once, as the embedding), `kind` "ours", "dcp" or "hf"."""

    def __init__(self, path: str):
        self.kind, self.folder = checkpoint_kind(path)
        self.cfg = checkpoint_config(path)
        self._stack = contextlib.ExitStack()
        try:
            if self.kind == "dcp":
                self._files = _DcpTensors(self.folder, self.cfg.tie_word_embeddings)
            else:
                self._files = _Files(self.folder, self._stack, ReadLog(self.kind))
                if self.kind == "hf":
                    self.cfg = _untie_distinct_head(self._files, self.cfg)
            with torch.device("meta"):
                tensors = _model_tensors(LongCtxModel(self.cfg))
            self.shapes = {n: tuple(t.shape) for n, t in tensors}
            self._sources = _sources(tensors, self.cfg, "ours" if self.kind == "dcp" else self.kind,
                                     set(self._files.handle))
            _check(self._sources, tensors, self._files, self.cfg, path)
        except BaseException:
            self._stack.close()
            raise

    def read(self, names) -> dict[str, torch.Tensor]:
        """Our tensors `names`, whole, in the dtype they are stored in."""
        if self.kind == "dcp":
            return self._files.read(names)
        return {n: self._sources[n].read(self._files, tuple((0, s) for s in self.shapes[n])) for n in names}

    def pieces(self):
        """The model's tensors, a piece (`hf_interop.export_pieces`: the embedding, a layer, the rest) at a
        time; each is read when the one before has been taken."""
        for names in export_pieces(self.shapes, self.cfg.num_layers):
            yield self.read(names)

    def close(self):
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def export_checkpoint(path: str, out: str, vision_from: str | None = None, force: bool = False,
                      max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> None:
    """Write the checkpoint `path` to the folder `out` in the GLM-5.3-Flash hub layout, a piece at a time
    (`Checkpoint.pieces` through `hf_interop.write_hf`), in safetensors files of at most
    `max_shard_size`. The vision tower comes from `vision_from`, else from `path` itself when that is a
    transformers folder. `out` is refused (CheckpointError) when it is a file or a folder that is not
    empty, unless `force`; it appears whole or not at all (`hf_interop.export_hf`). Tensors keep the
    dtype they are stored in."""
    check_export_target(out, force)  # before the checkpoint is opened: a refusal is at once
    check_vision_source(vision_from)
    shard_bytes(max_shard_size)
    with Checkpoint(path) as ck:
        vision = vision_from or (ck.folder if ck.kind == "hf" else None)
        write_hf(out, ck.cfg, ck.pieces(), vision_from=vision, force=force, max_shard_size=max_shard_size)
