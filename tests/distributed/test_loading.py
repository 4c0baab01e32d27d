"""A transformers GLM-5.3-Flash checkpoint (16 routed experts, 3 MoE layers) streamed into a model built on
the meta device and sharded by EP and FSDP2, in 4 gloo processes: EP=4 (each rank 4 experts) and
EP=2 x efsdp 2 (each expert's gate rows on one rank, its up rows on the other).

Counted, per rank (`ReadLog`): the expert tensors it reads are exactly its own experts' (at EP=4 all
three of each, whole; at EP=2 its half of each expert's rows), every element of every expert
tensor is read by exactly one rank, and every other tensor by row slices that tile it over the
ranks (the routers' bias, a replicated buffer, whole on each). No rank holds more than its shards:
the ranks' local parameter elements add up to the model's. The logits equal the single-process
`load_pretrained` model's (fp32, relative <= 1e-5).

A strided Shard(0) of the experts (FSDP over efsdp where dim 1 does not divide) reads its box too.

One process: `load_into` a meta-built model gives `load_pretrained`'s tensors exactly, from the hub
layout (tied head or not), from our own safetensors and from a DCP checkpoint; a checkpoint that
does not fit the model is one sentence before anything is read.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

import launch
from cp_util import rel
from hf_reference import make_checkpoint  # skips without transformers

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-5
EXPERTS = 16
EXPERT_KEY = re.compile(r"model\.language_model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


@pytest.fixture(scope="module")
def hf16(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm16")
    make_checkpoint(path, seed=3, n_routed_experts=EXPERTS)
    return str(path)


def ids():
    return torch.randint(1, 97, (2, 13), generator=torch.Generator().manual_seed(7))


def reference(path: str) -> dict:
    from safetensors import safe_open

    from longctx.hf_interop import load_pretrained

    model = load_pretrained(path).eval()
    with torch.no_grad():
        logits = model(ids()).logits
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    return {"logits": logits, "shapes": shapes, "params": sum(p.numel() for p in model.parameters())}


def sharded_load(rank: int, world: int, path: str, ep: int) -> dict:
    """The meta-built model, EP then FSDP, streamed from `path`: this rank's reads, its local
    parameter elements, and the logits of `ids()` (every rank the same batch)."""
    from longctx.distributed import ParallelConfig, build_mesh
    from longctx.distributed.balance import attach_statistics, statistics_group
    from longctx.distributed.expert_parallel import apply_expert_parallel
    from longctx.distributed.fsdp import parallelize
    from longctx.distributed.loading import checkpoint_config, load_into
    from longctx.model import LongCtxModel

    mesh = build_mesh(world, ParallelConfig(ep=ep).validate(world))
    with torch.device("meta"):
        model = LongCtxModel(checkpoint_config(path))
    assert apply_expert_parallel(model, mesh, ep) == 3
    parallelize(model, mesh)
    attach_statistics(model, statistics_group(mesh))
    log = load_into(model, path)
    held = sum(p.to_local().numel() for p in model.parameters())
    with torch.no_grad():
        logits = model.eval()(ids()).logits
    return {"reads": [(r.key, r.box) for r in log.reads], "held": held, "logits": logits}


def own_experts(rank: int, ep: int) -> set:
    j = rank % ep  # an ep group is `ep` consecutive ranks
    return set(range(j * EXPERTS // ep, (j + 1) * EXPERTS // ep))


def check_reads(res: list, ep: int, want: dict) -> None:
    shapes = want["shapes"]
    per_key: dict[str, list] = {}
    for rank, r in enumerate(res):
        experts = {}
        for key, box in r["reads"]:
            per_key.setdefault(key, []).append(box)
            if (m := EXPERT_KEY.match(key)) is not None:
                experts.setdefault(int(m.group(2)), set()).add(m.group(3))
        assert set(experts) == own_experts(rank, ep), (rank, sorted(experts))
        if ep == len(res):  # no efsdp: all three tensors of each of its experts, whole
            assert all(v == {"gate", "up", "down"} for v in experts.values()), (rank, experts)
            assert all(box == tuple((0, s) for s in shapes[k]) for k, box in r["reads"] if EXPERT_KEY.match(k))
    for key, boxes in per_key.items():
        shape = shapes[key]
        if key.endswith("gate.e_score_correction_bias"):  # a buffer: every rank reads it whole
            assert boxes == [((0, shape[0]),)] * len(res), (key, boxes)
            continue
        n = 1
        for s in shape:
            n *= s
        covered = sum(_numel(b) for b in boxes)
        assert covered == n, f"{key}: {covered} of its {n} elements read over the ranks (each exactly once)"
        if not EXPERT_KEY.match(key):  # FSDP's rows: a slice of dim 0, every other dim whole
            assert all(b[1:] == tuple((0, s) for s in shape[1:]) for b in boxes), (key, boxes)
            rows = sorted(b[0] for b in boxes)
            assert rows[0][0] == 0 and rows[-1][1] == shape[0] and all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    used = {k for k in shapes if not k.startswith("model.visual")}
    assert set(per_key) == used, sorted(used - set(per_key))


def _numel(box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


@pytest.mark.parametrize("ep", [4, 2])
def test_each_rank_reads_its_own_shards_and_gives_the_single_process_logits(hf16, ep):
    want = reference(hf16)
    res = launch.run(sharded_load, 4, hf16, ep)
    check_reads(res, ep, want)
    assert sum(r["held"] for r in res) == want["params"]
    assert all(r["held"] < want["params"] / 3 for r in res), [r["held"] for r in res]
    for rank, r in enumerate(res):
        err = rel(r["logits"], want["logits"])
        assert err <= TOL, f"rank {rank} (ep {ep}): logits {err:.2e} from one process's"


def strided_load(rank: int, world: int, path: str) -> dict:
    """Our own checkpoint into EP=2 x efsdp 2, every parameter then gathered whole."""
    from longctx.distributed import ParallelConfig, build_mesh
    from longctx.distributed.expert_parallel import apply_expert_parallel
    from longctx.distributed.fsdp import parallelize
    from longctx.distributed.loading import checkpoint_config, load_into
    from longctx.model import LongCtxModel

    mesh = build_mesh(world, ParallelConfig(ep=2).validate(world))
    with torch.device("meta"):
        model = LongCtxModel(checkpoint_config(path))
    apply_expert_parallel(model, mesh, 2)
    parallelize(model, mesh)
    assert load_into(model, path).kind == "ours"
    return {"placements": {n: str(p.placements) for n, p in model.named_parameters() if ".experts." in n},
            "full": {n: p.detach().full_tensor() for n, p in model.named_parameters()}}


def test_a_strided_expert_shard_reads_its_box(tmp_path):
    """hidden 33: `down` [E, 33, I] cannot split its dim 1 over efsdp 2, so FSDP shards its experts
    (dim 0) within the ep shard, a strided Shard(0); the local shard is still one box."""
    from longctx.config import preset
    from longctx.hf_interop import save_checkpoint_dir
    from longctx.model import LongCtxModel

    torch.manual_seed(0)
    ref = LongCtxModel(preset("tiny").replace(hidden_size=33, n_routed_experts=8))
    save_checkpoint_dir(ref, str(tmp_path / "ours"))
    res = launch.run(strided_load, 4, str(tmp_path / "ours"))
    assert res[0]["placements"]["layers.1.mlp.experts.down"].startswith("(_StridedShard(dim=0")
    want = dict(ref.named_parameters())
    for rank, r in enumerate(res):
        bad = [k for k, v in want.items() if not torch.equal(r["full"][k], v.detach())]
        assert not bad, (rank, bad)


# ----------------------------------------------------------------------------- one process
def _meta_model(cfg):
    from longctx.model import LongCtxModel

    with torch.device("meta"):
        return LongCtxModel(cfg)


def _assert_same(model, ref) -> None:
    a, b = model.state_dict(), ref.state_dict()
    assert sorted(a) == sorted(b)
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, bad


@pytest.mark.parametrize("tie", [False, True])
def test_one_process_load_equals_load_pretrained(tmp_path, tie):
    from longctx.distributed.loading import checkpoint_config, load_into
    from longctx.hf_interop import load_pretrained

    make_checkpoint(tmp_path, n_routed_experts=8, top={"tie_word_embeddings": tie})
    ref = load_pretrained(str(tmp_path))
    model = _meta_model(checkpoint_config(str(tmp_path)))
    log = load_into(model, str(tmp_path))
    _assert_same(model, ref)
    assert (model.lm_head.weight is model.embed.weight) == tie
    assert log.kind == "hf" and log.elements() == sum(t.numel() for t in model.state_dict().values()) - (
        model.lm_head.weight.numel() if tie else 0)


def test_our_own_and_dcp_checkpoints_load_the_same(tmp_path, hf16):
    from longctx.distributed import checkpoint as dckpt
    from longctx.distributed.loading import checkpoint_config, load_into
    from longctx.hf_interop import load_pretrained, save_checkpoint_dir

    ref = load_pretrained(hf16)
    save_checkpoint_dir(ref, str(tmp_path / "ours"))
    model = _meta_model(checkpoint_config(str(tmp_path / "ours")))
    assert load_into(model, str(tmp_path / "ours")).kind == "ours"
    _assert_same(model, ref)

    dckpt.save(str(tmp_path / "dcp"), ref, None)
    (tmp_path / "dcp" / "longctx_config.json").write_text(ref.cfg.to_json())  # as the trainer writes it
    model = _meta_model(checkpoint_config(str(tmp_path / "dcp")))
    assert load_into(model, str(tmp_path / "dcp")).kind == "dcp"
    _assert_same(model, ref)


def test_a_checkpoint_that_does_not_fit_is_one_sentence(tmp_path, hf16):
    from safetensors.torch import load_file, save_file

    from longctx.distributed.loading import checkpoint_config, load_into
    from longctx.errors import CheckpointError

    cfg = checkpoint_config(hf16)
    sd = load_file(os.path.join(hf16, "model.safetensors"))
    gone = "model.language_model.layers.2.mlp.experts.5.up_proj.weight"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(open(os.path.join(hf16, "config.json")).read())
    save_file({k: v for k, v in sd.items() if k != gone}, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"^checkpoint '{bad}' does not match its config: missing 1 tensor\(s\): "
                                              rf"{re.escape(gone)}\.$"):
        load_into(_meta_model(cfg), str(bad))
    save_file({**sd, gone: sd[gone][:-1]}, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"tensor '{re.escape(gone)}' has shape \(15, 32\) but the config gives "
                                              r"\(16, 32\); the config and the weights disagree\.$"):
        load_into(_meta_model(cfg), str(bad))
    assert json.loads((bad / "config.json").read_text())["text_config"]["n_routed_experts"] == EXPERTS
