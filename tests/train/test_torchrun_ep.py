"""`torchrun --nproc-per-node 2 -m longctx train` with expert parallelism over gloo: parallel.ep = 2
(each rank holds 2 of the tiny preset's 4 routed experts per MoE layer), data parallel and with
context parallelism, gives the single-process losses step by step, evaluation included; its sharded
checkpoint resumes to the same last step."""

from __future__ import annotations

import os

import pytest
from test_torchrun import (REPO, SETS, TORCHRUN, _evals, _steps, _train, assert_resumes_to_the_last_step,  # noqa: F401
                           one_process)  # the shared one-process run


# tol: as in test_torchrun.py, hidden_gather CP (the cp=2 case's KDA mode) resolves an fp32 near-tie of the DSA
# indexer's top-k the other way (exact in float64), and Adam carries it; its first loss keeps 1e-5
@pytest.mark.parametrize("parallel,mesh,tol", [(("parallel.ep=2",), "dp 2 x cp 1", 1e-5),
                                               (("parallel.ep=2", "parallel.cp=2"), "dp 1 x cp 2", 3e-4)])
def test_expert_parallel_under_torchrun_equals_one_process(tmp_path, one_process, parallel, mesh, tol):  # noqa: F811
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    sets = [*SETS, *parallel]
    two = _train(tmp_path / "ep2", *TORCHRUN, sets=sets)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    a, b = _steps(one_process), _steps(tmp_path / "ep2")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4, 5]
    assert abs(a[0]["loss"] - b[0]["loss"]) <= 1e-5 * abs(a[0]["loss"]), (a[0]["loss"], b[0]["loss"])  # no update yet
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= tol * abs(x["loss"]), (x["step"], x["loss"], y["loss"])
    ea, eb = _evals(one_process), _evals(tmp_path / "ep2")
    assert len(ea) == len(eb) == 2 and all(abs(x - y) <= tol * abs(x) for x, y in zip(ea, eb)), (ea, eb)
    assert f"mesh {mesh} (2 processes)" in two.stdout.splitlines()[0]
    ck = os.path.realpath(tmp_path / "ep2" / "checkpoint")
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(ck))

    if "parallel.cp=2" not in parallel:  # the experts' DTensors checkpoint and resume alike under either mesh
        assert_resumes_to_the_last_step(tmp_path / "resumed", sets, b[-1]["loss"])


def test_an_ep_that_does_not_divide_the_experts_is_one_sentence(tmp_path):
    r = _train(tmp_path / "o", *TORCHRUN, sets=[*SETS, "parallel.ep=8", "parallel.cp=1"])
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "model.n_routed_experts = 4 is not a multiple of parallel.ep = 8; choose an ep that divides 4." in out, out[-2000:]
    # no traceback of ours (torchrun prints its own report of the failed workers)
    assert os.path.join(REPO, "longctx") not in out, out[-2000:]
