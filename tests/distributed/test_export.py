"""`longctx export` a layer at a time (longctx/distributed/export.py): a GLM-5.3-Flash-shaped model of 12
layers with 16 routed experts each, tiny dims, from a one-process checkpoint (safetensors), from a DCP
checkpoint written by 2 gloo processes under EP=2 x FSDP (each rank its own experts and row shards),
and from the transformers folder it came from.

- transformers (`AutoModelForImageTextToText`) loads the sharded export and computes the original
  model's logits exactly, and longctx's within fp32 rounding;
- `load_pretrained` and the streamed loader (`loading.load_into`) read it back to equal tensors, and
  the hub tensors written equal the transformers folder's, name for name;
- the files are the ones transformers' own splitter (huggingface_hub) makes of the same tensors; a
  model within one shard is one `model.safetensors` without an index;
- the bytes of tensors alive at once (every tensor the exporter reads is watched until its last
  view dies) stay within two layers' bytes, a fraction of the model's;
- a missing checkpoint, a refused --out, a bad --max-shard-size or a checkpoint that does not fit
  its config is one sentence and exit 2, before anything is written.
"""

from __future__ import annotations

import json
import os
import weakref

import pytest
import torch

import launch
from hf_reference import make_checkpoint  # skips without transformers
from test_hf_interop import _tensors as _hub_tensors

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS, EXPERTS = 12, 16
SHARD = "40KB"  # a layer is ~130 KB in fp32: several files per layer


def ids():
    return torch.randint(1, 97, (2, 11), generator=torch.Generator().manual_seed(4))


def write_dcp(rank: int, world: int, hub: str, path: str) -> None:
    """The transformers folder streamed into EP=2 x FSDP over 2 ranks, saved as the trainer saves."""
    from longctx.distributed import ParallelConfig, build_mesh
    from longctx.distributed import checkpoint as dckpt
    from longctx.distributed.expert_parallel import apply_expert_parallel
    from longctx.distributed.fsdp import parallelize
    from longctx.distributed.loading import checkpoint_config, load_into
    from longctx.model import LongCtxModel

    mesh = build_mesh(world, ParallelConfig(ep=2).validate(world))
    with torch.device("meta"):
        model = LongCtxModel(checkpoint_config(hub))
    assert apply_expert_parallel(model, mesh, 2) == LAYERS - 1
    parallelize(model, mesh)
    load_into(model, hub)
    dckpt.save(path, model, None)
    if rank == 0:
        with open(os.path.join(path, "longctx_config.json"), "w") as f:
            f.write(model.cfg.to_json())


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The transformers model, longctx's load of it, and the three checkpoints that hold it."""
    from longctx.hf_interop import load_pretrained, save_checkpoint_dir

    root = tmp_path_factory.mktemp("export")
    hub = str(root / "hub")
    hf = make_checkpoint(hub, seed=12, n_routed_experts=EXPERTS, num_hidden_layers=LAYERS,
                         mlp_layer_types=["dense"] + ["sparse"] * (LAYERS - 1))
    ours = load_pretrained(hub).eval()
    save_checkpoint_dir(ours, str(root / "ours"))
    launch.run(write_dcp, 2, hub, str(root / "dcp"))
    return {"hf_model": hf, "model": ours, "root": root,
            "paths": {"ours": str(root / "ours"), "dcp": str(root / "dcp"), "hf": hub}}


def _export_cli(*argv) -> int:
    from longctx.cli import main

    return main(["export", *map(str, argv)])


# ----------------------------------------------------------------------------- transformers loads it
@pytest.mark.parametrize("kind", ["ours", "dcp"])
def test_transformers_loads_the_sharded_export_with_the_same_logits(sources, kind, tmp_path, capsys):
    from transformers import AutoModelForImageTextToText

    out = tmp_path / "out"
    assert _export_cli("--checkpoint", sources["paths"][kind], "--out", out, "--max-shard-size", SHARD) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > LAYERS and files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
    assert sorted(os.listdir(out)) == sorted(["config.json", "model.safetensors.index.json", *files])
    assert all(os.path.getsize(out / f) <= 40_000 + 8192 for f in files)  # the tensors, plus the file's header
    back = AutoModelForImageTextToText.from_pretrained(str(out)).eval()
    with torch.no_grad():
        got, ours = back(input_ids=ids()).logits, sources["model"](ids()).logits
        assert torch.equal(got, sources["hf_model"](input_ids=ids()).logits)  # the very weights it started from
    rel = ((got - ours).pow(2).mean() / ours.pow(2).mean()).sqrt().item()
    assert rel <= 2e-5 and (got - ours).abs().max().item() <= 1e-4 * max(1.0, ours.abs().max().item())


# ----------------------------------------------------------------------------- and back
@pytest.mark.parametrize("kind", ["ours", "dcp", "hf"])
def test_the_export_reads_back_to_equal_tensors(sources, kind, tmp_path):
    from longctx.distributed.export import export_checkpoint
    from longctx.distributed.loading import checkpoint_config, load_into
    from longctx.hf_interop import load_pretrained
    from longctx.model import LongCtxModel

    out = str(tmp_path / "out")
    export_checkpoint(sources["paths"][kind], out, max_shard_size=SHARD)
    want = sources["model"].state_dict()
    for model in (load_pretrained(out), None):
        if model is None:  # the streamed loader, through the index
            with torch.device("meta"):
                model = LongCtxModel(checkpoint_config(out))
            load_into(model, out)
        got = model.state_dict()
        assert sorted(got) == sorted(want)
        assert not [k for k in want if not torch.equal(got[k], want[k])]
    src, written = _hub_tensors(sources["paths"]["hf"]), _hub_tensors(out)
    if kind != "hf":  # the vision tower comes only from a transformers folder (or --vision-from)
        src = {k: v for k, v in src.items() if not k.startswith("model.visual.")}
    assert sorted(written) == sorted(src)
    assert not [k for k in src if not (src[k].dtype == written[k].dtype and torch.equal(src[k], written[k]))]


def test_the_files_are_those_transformers_splits_the_tensors_into(sources, tmp_path):
    """The same tensors in the same order through huggingface_hub's splitter (what save_pretrained
    calls) give the same files; at the default 5GB the model is one file without an index."""
    from huggingface_hub import split_torch_state_dict_into_shards

    from longctx.distributed.export import Checkpoint, export_checkpoint
    from longctx.hf_interop import export_pieces, state_dict_to_hf

    out = tmp_path / "out"
    export_checkpoint(sources["paths"]["ours"], str(out), max_shard_size=SHARD)
    with Checkpoint(sources["paths"]["ours"]) as ck:
        ordered = {}
        for names in export_pieces(ck.shapes, ck.cfg.num_layers):
            ordered.update({k: v.clone() for k, v in state_dict_to_hf(ck.read(names), ck.cfg).items()})
    split = split_torch_state_dict_into_shards(ordered, max_shard_size=SHARD)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == split.tensor_to_filename
    assert index["metadata"] == split.metadata  # total_size
    export_checkpoint(sources["paths"]["ours"], str(tmp_path / "one"))
    assert sorted(os.listdir(tmp_path / "one")) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("case", ["tied", "tie_flag_distinct_head"])
def test_the_head_is_exported_as_load_pretrained_reads_it(tmp_path, case):
    """A tied head is the embedding, written once; a folder that ties the head but saves one that differs
    from the embedding is two tensors, untied, as transformers and `load_pretrained` read it."""
    from hf_reference import edit_config

    from longctx.distributed.export import export_checkpoint
    from longctx.hf_interop import load_pretrained

    hub = tmp_path / "hub"
    make_checkpoint(hub, seed=5, top={"tie_word_embeddings": case == "tied"})
    if case == "tie_flag_distinct_head":
        edit_config(hub, lambda c: c.update(tie_word_embeddings=True))
    export_checkpoint(str(hub), str(tmp_path / "out"))
    ref, back = load_pretrained(str(hub)), load_pretrained(str(tmp_path / "out"))
    tied = case == "tied"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] == tied
    assert ("lm_head.weight" in _hub_tensors(tmp_path / "out")) != tied
    assert (back.lm_head.weight is back.embed.weight) == tied
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in ref.state_dict().items())


# ----------------------------------------------------------------------------- what is held at once
class Held:
    """The bytes of the tensors the exporter has read that are still alive. A tensor is watched through the
    tensor that owns its memory (a read may return a view of a buffer of the reader's, and a view of a view
    holds the first one's base, not it), from its read until the last view of that memory is gone."""

    def __init__(self):
        self.now = self.peak = 0
        self.pieces: list[int] = []

    def counting(self, read):
        def counted(ck, names):
            got = read(ck, names)
            owners = {id(o): o for o in (t if t._base is None else t._base for t in got.values())}
            n = 0
            for o in owners.values():
                size = o.untyped_storage().nbytes()
                weakref.finalize(o, self._free, size)
                n += size
            self.now += n
            self.peak = max(self.peak, self.now)
            self.pieces.append(n)
            return got

        return counted

    def _free(self, n: int):
        self.now -= n


@pytest.mark.parametrize("kind", ["ours", "dcp"])
def test_at_most_two_layers_are_held_at_once(sources, kind, tmp_path, monkeypatch):
    from longctx.distributed import export

    held = Held()
    monkeypatch.setattr(export.Checkpoint, "read", held.counting(export.Checkpoint.read))
    export.export_checkpoint(sources["paths"][kind], str(tmp_path / "out"), max_shard_size=SHARD)
    total = sum(t.numel() * t.element_size() for t in sources["model"].state_dict().values())
    assert len(held.pieces) == LAYERS + 2 and sum(held.pieces) == total  # every tensor read once, by the piece
    assert held.now == 0  # nothing kept once written
    print(f"\n{kind}: held at most {held.peak} B at once of the model's {total} B "
          f"({held.peak / total:.1%}); largest piece {max(held.pieces)} B")
    assert held.peak <= 2 * max(held.pieces) and held.peak < total / 5, (held.peak, max(held.pieces), total)


# ----------------------------------------------------------------------------- bad input
def _one_error(capsys, rc: int, *needles) -> str:
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    return err


def test_bad_input_is_one_sentence_and_exit_2(sources, tmp_path, capsys):
    ck = sources["paths"]["dcp"]
    _one_error(capsys, _export_cli("--checkpoint", tmp_path / "missing", "--out", tmp_path / "a"),
               "--checkpoint", "does not exist")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    _one_error(capsys, _export_cli("--checkpoint", ck, "--out", tmp_path / "full"), "not empty", "--force")
    for size in ("5XB", "0", "-1", "GB", ""):
        _one_error(capsys, _export_cli("--checkpoint", ck, "--out", tmp_path / "b", "--max-shard-size", size),
                   "--max-shard-size must be a size", "for example --max-shard-size 5GB")
    assert sorted(os.listdir(tmp_path)) == ["full"]
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"


def test_a_checkpoint_that_does_not_fit_its_config_writes_nothing(sources, tmp_path, capsys):
    """A DCP checkpoint whose longctx_config.json says 16 layers: refused before a file is written."""
    import shutil

    bad = tmp_path / "dcp"
    shutil.copytree(sources["paths"]["dcp"], bad)
    cfg = json.loads((bad / "longctx_config.json").read_text())
    cfg.update(num_layers=LAYERS + 1, layer_pattern=cfg["layer_pattern"] + "K", mlp_pattern=cfg["mlp_pattern"] + "m",
               indexer_pattern=cfg["indexer_pattern"] + "f")
    (bad / "longctx_config.json").write_text(json.dumps(cfg))
    _one_error(capsys, _export_cli("--checkpoint", bad, "--out", tmp_path / "out"),
               "does not match its config: missing", f"tensor(s): layers.{LAYERS}.")
    assert sorted(os.listdir(tmp_path)) == ["dcp"]
