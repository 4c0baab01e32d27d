"""`torchrun --nproc-per-node 2 -m longctx train` over gloo, data parallel (parallel.cp=1) and context
parallel (parallel.cp=2), gives the single-process losses step by step: a stage's batch_size is the
global batch, split into each dp rank's rows, and each row into its cp ranks' zigzag chunks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SETS = ["preset=tiny", "stages.0.seq_len=64", "stages.0.steps=3", "stages.0.batch_size=2", "stages.0.warmup=1",
        "stages.1.seq_len=96", "stages.1.steps=2", "stages.1.warmup=0", "stages.1.batch_size=2",
        "data.eval_windows=1"]


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # the single-process run must not think it is one of torchrun's
    return env


TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")


def _train(out, *launcher, sets=SETS):
    launcher, flags = [a for a in launcher if a != "--resume"], [a for a in launcher if a == "--resume"]
    args = [a for s in sets for a in ("--set", s)]
    return subprocess.run([sys.executable, *launcher, "-m", "longctx", "train", *args, "--out", str(out), *flags],
                          env=_env(), capture_output=True, text=True, timeout=300, cwd=REPO)


def _steps(out):
    return [r for r in map(json.loads, open(out / "metrics.jsonl")) if "loss" in r]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    r = _train(out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def _evals(out):
    return [r["eval_loss"] for r in map(json.loads, open(out / "metrics.jsonl")) if "eval_loss" in r]


@pytest.mark.parametrize("parallel,mesh", [((), "dp 2 x cp 1"), (("parallel.cp=2",), "dp 1 x cp 2"),
                                           (("parallel.cp=2", "parallel.kda_cp=chunk_state"), "dp 1 x cp 2")])
def test_two_processes_under_torchrun_equal_one(tmp_path, one_process, parallel, mesh):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    sets = [*SETS, *parallel]
    two = _train(tmp_path / "dp2", *TORCHRUN, sets=sets)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]

    a, b = _steps(one_process), _steps(tmp_path / "dp2")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4, 5]
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]), (x["step"], x["loss"], y["loss"])
        assert len(y["peak_gib_ranks"]) == 2 and "peak_gib_ranks" not in x
    ea, eb = _evals(one_process), _evals(tmp_path / "dp2")  # the evaluation runs whole sequences on every rank
    assert len(ea) == len(eb) == 2 and all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(ea, eb)), (ea, eb)
    lines = two.stdout.splitlines()
    assert f"mesh {mesh} (2 processes)" in lines[0], lines[0]
    assert sum(line.startswith("step 1/5 ") for line in lines) == 1  # rank 0 alone prints
    ck = os.path.realpath(tmp_path / "dp2" / "checkpoint")
    assert os.path.basename(ck) == "ckpt-000005" and {"__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(ck))

    # the sharded checkpoint resumes: a run one step shorter, continued by --resume, takes the same last step
    short = [s if s != "stages.1.steps=2" else "stages.1.steps=1" for s in sets]
    r = _train(tmp_path / "resumed", *TORCHRUN, sets=short)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = _train(tmp_path / "resumed", *TORCHRUN, "--resume", sets=sets)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    c = _steps(tmp_path / "resumed")
    assert [x["step"] for x in c] == [1, 2, 3, 4, 5]
    assert abs(c[-1]["loss"] - b[-1]["loss"]) <= 1e-6 * abs(b[-1]["loss"]), (c[-1]["loss"], b[-1]["loss"])


def test_a_batch_that_does_not_split_is_one_sentence(tmp_path):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    r = _train(tmp_path / "o", *TORCHRUN, sets=[*SETS, "stages.1.batch_size=3"])
    assert r.returncode != 0
    assert "stages.1.batch_size = 3 does not split over the 2 data-parallel ranks" in r.stdout + r.stderr
