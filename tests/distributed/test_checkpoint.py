"""Sharded checkpoints (torch.distributed.checkpoint): a checkpoint written by 2 FSDP processes after
one step resumes in 1 process (a plain model) and in 4 FSDP processes, and the next two steps' losses
(the second checks the optimizer state) equal those of the run that went on without stopping, to
1e-5 relative; the trainer state comes back; `to_full_state_dict` gives rank 0 the whole tensors,
equal to what the one process loaded; a stale `.partial` folder is replaced and a second save of the
same folder replaces the first; a partial or mismatched checkpoint is refused with one sentence; a
checkpoint saved before the first step holds no optimizer state and gives none.
"""

from __future__ import annotations

import os

import pytest
import torch

import launch
from fsdp_util import B, batch, build, optimizer

pytestmark = pytest.mark.usefixtures("one_thread")  # the one-process references: tiny ops
TOL = 1e-5


def train(model, opt, steps, rank: int, world: int, mesh=None) -> list[float]:
    """Steps on the batches of the given seeds, each rank on its share; the global losses."""
    import torch.distributed as dist

    from longctx.distributed.fsdp import clip_grad_norm_, loss_share

    losses = []
    for seed in steps:
        x, y = batch(seed)
        per = B // world
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        loss = loss_share(model(x, labels=y, return_logits=False).lm_loss, y, mesh)
        loss.backward()
        clip_grad_norm_(list(model.parameters()), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        if mesh is not None:
            dist.all_reduce(total)
        losses.append(total.item())
    return losses


def sharded(world: int):
    from longctx.distributed import ParallelConfig, build_mesh
    from longctx.distributed.fsdp import parallelize

    mesh = build_mesh(world, ParallelConfig(cp=1))
    model = parallelize(build(), mesh)
    return model, optimizer(model), mesh


def write_and_go_on(rank: int, world: int, path: str) -> dict:
    """Step 1, save (over a stale partial folder, twice), then steps 2 and 3 without stopping."""
    from longctx.distributed.checkpoint import save, to_full_state_dict

    model, opt, mesh = sharded(world)
    train(model, opt, [10], rank, world, mesh)
    if rank == 0:
        os.makedirs(path + ".partial", exist_ok=True)
        with open(os.path.join(path + ".partial", "junk"), "w") as f:
            f.write("a save that never finished")
    save(path, model, opt, {"step": 0})
    save(path, model, opt, {"step": 1, "data": {"cursor": 7}})  # the same folder again: replaced whole
    full = to_full_state_dict(model)
    files = sorted(os.listdir(os.path.dirname(path)))
    return {"losses": train(model, opt, [11, 12], rank, world, mesh), "full": full, "files": files}


def resume(rank: int, world: int, path: str) -> dict:
    from longctx.distributed.checkpoint import load

    model, opt, mesh = sharded(world)
    extra = load(path, model, opt)
    return {"losses": train(model, opt, [11, 12], rank, world, mesh), "extra": extra}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dcp") / "ckpt-000001")
    return path, launch.run(write_and_go_on, 2, path)


def _rel(a: list, b: list) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_saved_atomically(written):
    path, res = written
    assert res[0]["files"] == ["ckpt-000001"], res[0]["files"]  # no .partial, no .old left
    names = sorted(os.listdir(path))
    assert ".metadata" in names and "extra.pt" in names and "junk" not in names
    assert sum(n.endswith(".distcp") for n in names) == 2, names  # each rank wrote its own shards


def test_resumes_in_one_process_with_the_uninterrupted_losses(written):
    from longctx.distributed.checkpoint import load, to_full_state_dict

    path, res = written
    model = build()
    opt = optimizer(model)
    extra = load(path, model, opt)
    assert extra == {"step": 1, "data": {"cursor": 7}}
    # rank 0's gathered state dict is what the one process loaded, tensor for tensor
    full, mine = res[0]["full"], to_full_state_dict(model)
    assert res[1]["full"] == {} and sorted(full) == sorted(mine)
    assert all(torch.equal(full[k], mine[k]) for k in mine), [k for k in mine if not torch.equal(full[k], mine[k])]
    build().load_state_dict(full)  # what an export needs: every key, whole, strict
    # Adam's state for exactly the parameters that had a gradient in step 1 (the indexer's had none)
    stepped = {n for n, _ in build().named_parameters() if ".indexer." not in n}
    names = {p: n for n, p in model.named_parameters()}
    assert {names[p] for p in opt.state} == stepped
    assert all(float(st["step"]) == 1 and st["exp_avg_sq"].abs().sum() > 0 for st in opt.state.values())
    losses = train(model, opt, [11, 12], 0, 1)
    assert _rel(losses, res[0]["losses"]) <= TOL, (losses, res[0]["losses"])


def test_resumes_in_four_processes_with_the_uninterrupted_losses(written):
    path, res = written
    for rank, r in enumerate(launch.run(resume, 4, path)):
        assert r["extra"]["step"] == 1
        assert _rel(r["losses"], res[0]["losses"]) <= TOL, (rank, r["losses"], res[0]["losses"])


def test_refuses_partial_and_mismatched_checkpoints_and_saves_before_the_first_step(written, tmp_path):
    from longctx.errors import CheckpointError
    from longctx.distributed.checkpoint import load, save
    from longctx.model import LongCtxModel
    from fsdp_util import tiny_config

    path, _ = written
    stale = tmp_path / "ckpt-000002.partial"
    stale.mkdir()
    with pytest.raises(CheckpointError, match="never finished"):
        load(str(stale), build())
    with pytest.raises(CheckpointError, match="does not match the model"):
        load(path, LongCtxModel(tiny_config().replace(intermediate_size=24)))
    model = build()
    load(path, model)  # weights only: no optimizer asked for
    # saved before the first step: no optimizer state is written, and none is made on either side
    opt = optimizer(model)
    fresh = str(tmp_path / "ckpt-000000")
    save(fresh, model, opt, {"step": 0})
    assert not opt.state
    other = build()
    other_opt = optimizer(other)
    assert load(fresh, other, other_opt) == {"step": 0} and not other_opt.state
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
