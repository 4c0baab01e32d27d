"""RL (task = rl): GRPO's advantages, the clipped objective's gradient, the loss on completion tokens
only, the sampler's log-probs against the trainer's, and `longctx rl` as a job: rollouts read from a
file train exactly as the same rollouts sampled in-process, a stopped run resumes to the same
numbers, and a bad reward function is one sentence with exit code 2."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from longctx.cli import main
from longctx.config.model import preset
from longctx.generate import sample
from longctx.model import LongCtxModel
from longctx.train.rl import clipped_objective, completion_logprobs, group_advantages

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------ the objective
def test_group_advantages_are_per_group():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 1.0, 0.0, 0.3])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 3])
    s0 = math.sqrt(1 / 3)  # group 0: mean 0.5, sample std sqrt((4 x 0.25) / 3)
    s2 = math.sqrt(0.5)    # group 2: mean 0.5, sample std sqrt(0.5)
    want = [0.5 / (s0 + 1e-4), -0.5 / (s0 + 1e-4), -0.5 / (s0 + 1e-4), 0.5 / (s0 + 1e-4),
            0.0, 0.0, 0.0,                       # every reward alike: nothing to learn
            0.5 / (s2 + 1e-4), -0.5 / (s2 + 1e-4),
            0.0]                                 # a group of one has no std
    torch.testing.assert_close(group_advantages(r, g), torch.tensor(want, dtype=torch.float64))
    # the groups need not be contiguous, and their labels need not start at 0
    perm = torch.tensor([9, 3, 7, 0, 5, 1, 8, 2, 6, 4])
    torch.testing.assert_close(group_advantages(r[perm], g[perm] + 5), torch.tensor(want, dtype=torch.float64)[perm])


def test_clipped_objective_gradient_is_the_hand_computed_one():
    clip, beta = 0.2, 0.1
    logp = torch.tensor([-1.0, -1.0, -1.0, -1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-1.0, -1.5, -0.5, -1.5, -1.9, -0.9], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.5, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.2, -0.8, -1.0, -1.1, -2.5, -0.4], dtype=torch.float64)
    loss, clipped, kl = clipped_objective(logp, old, adv, clip, ref, beta)
    loss.sum().backward()
    rho = [math.exp(a - b) for a, b in zip(logp.tolist(), old.tolist())]
    # 0: rho = 1, inside: d(-rho A)/dlogp = -rho A.  1: rho 1.65 > 1.2 with A > 0: the clipped term is the
    # smaller, constant in logp: 0.  2: rho 0.61 < 0.8 with A < 0: clipped again: 0.  3: rho 1.65 with A < 0:
    # the unclipped term is the smaller: -rho A.  4: inside.  5: rho 1.49 with A < 0: unclipped.
    binds = [False, True, True, False, False, False]
    want = [0.0 if b else -p * a for p, a, b in zip(rho, adv.tolist(), binds)]
    # k3 = exp(ref - logp) - (ref - logp) - 1, so dk3/dlogp = 1 - exp(ref - logp)
    want = [w + beta * (1 - math.exp(r - lp)) for w, r, lp in zip(want, ref.tolist(), logp.tolist())]
    torch.testing.assert_close(logp.grad, torch.tensor(want, dtype=torch.float64))
    assert clipped.tolist() == binds
    d = ref - logp.detach()
    torch.testing.assert_close(kl, torch.exp(d) - d - 1)
    # the first update of a batch: logp_old is logp itself, the ratio exactly 1, the gradient -A
    logp.grad = None
    loss, clipped, _ = clipped_objective(logp, logp.detach(), adv, clip)
    loss.sum().backward()
    assert torch.equal(logp.grad, -adv) and not clipped.any()


def _tiny():
    torch.manual_seed(0)
    # no exact ties in any top-k (test_trainer's decode test says why): init_std 0.2, 16 indexer heads
    return LongCtxModel(preset("tiny").replace(init_std=0.2, index_heads=16, vocab_size=256))


def test_the_loss_is_on_completion_tokens_only():
    """completion_logprobs (packed rows, the head at completion positions) gives the log-probs and the
    gradient that a full forward of each sequence gives, where the loss's gradient reaches no logit
    that predicts a prompt token."""
    model = _tiny().train()
    rng = np.random.default_rng(0)
    seqs = [(rng.integers(0, 256, 60), rng.integers(0, 256, 9).tolist()),
            (rng.integers(0, 256, 41), rng.integers(0, 256, 5).tolist())]
    adv = [0.7, -1.3]
    lps = completion_logprobs(model, seqs, "cpu")
    sum(clipped_objective(lp, lp.detach(), torch.full_like(lp, a), 0.2)[0].sum() for lp, a in zip(lps, adv)).backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.clear_aux()
    for (p, c), a, lp in zip(seqs, adv, lps):
        x = torch.as_tensor(np.concatenate([p, c]))[None]
        logits = model(x).logits
        logits.retain_grad()
        full = torch.log_softmax(logits.float(), -1)[0, :-1].gather(-1, x[0, 1:, None]).squeeze(-1)
        mine = full[len(p) - 1:]  # the positions that predict completion tokens
        torch.testing.assert_close(mine.detach(), lp.detach(), rtol=0, atol=1e-5)
        clipped_objective(mine, mine.detach(), torch.full_like(mine, a), 0.2)[0].sum().backward()
        g = logits.grad[0].abs().sum(-1)
        assert torch.all(g[:len(p) - 1] == 0) and torch.all(g[len(p) - 1:-1] > 0)
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert (packed[n] - p.grad).abs().max() <= 1e-4 * p.grad.abs().max() + 1e-7, n


def test_the_sampler_and_the_trainer_agree_on_logprobs_in_fp32():
    """The rollout's log-probs (the decode path: caches, rows copied and dropped) and the trainer's (the
    training forward, train mode, sequences packed) of the same weights: mean |difference| < 1e-5."""
    model = _tiny()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, 3 * model.cfg.index_topk + 7), rng.integers(0, 256, 50)]
    groups = sample(model, prompts, n=3, max_new_tokens=16, temperature=1.0, stop_ids=list(range(0, 256, 9)), seed=2)
    comps = [(p, c) for p, g in zip(prompts, groups) for c in g]
    model.train()
    with torch.no_grad():
        lps = completion_logprobs(model, [(p, c.tokens) for p, c in comps], "cpu")
    diff = torch.cat([lp - torch.tensor(c.logprobs) for lp, (_, c) in zip(lps, comps)]).abs()
    assert diff.numel() > 12 and diff.mean() < 1e-5, diff.mean()


# ------------------------------------------------------------------------------ the job
def _args(run: str, reward: str, *extra: str) -> list[str]:
    sets = ["stages=[{seq_len = 640, steps = 3, lr = 3e-3, batch_size = 2}]", "sft.questions=1", "sft.min_len=256",
            "sft.eval_lengths=[512]", "sft.eval_examples=2", "rl.group=3", "rl.max_new_tokens=10", "rl.kl_coef=0.05",
            "rl.updates=2", "rl.save_rollouts=true", f"rl.reward={reward}",
            # no exact ties in the routers' and the indexer's top-k, which the decode path's shorter rows could
            # break otherwise than the packed training row (test_trainer's decode test says more)
            "model.init_std=0.2", "model.index_heads=16", *extra]
    return ["--preset", "tiny", *(x for s in sets for x in ("--set", s)), "--out", run, "--quiet"]


@pytest.fixture
def small_task(monkeypatch):
    from longctx.data import retrieval_task
    from test_retrieval_task import PACKAGES

    real = retrieval_task.stdlib_files
    monkeypatch.setattr(retrieval_task, "stdlib_files", lambda: real(packages=PACKAGES))


@pytest.fixture
def reward_file(tmp_path):
    # the task's exact match is 0 for every completion of a random model; this reward varies, so the
    # advantages (and the policy gradient) are not all 0
    f = tmp_path / "my_reward.py"
    f.write_text("def odd_length(completion, answer):\n    return float(len(completion) % 2)\n")
    return f"{f}:odd_length"


def _steps(run: str) -> list[dict]:
    return [r for r in map(json.loads, open(os.path.join(run, "metrics.jsonl"))) if "reward" in r]


def _weights(run: str) -> dict:
    from safetensors.torch import load_file

    ck = os.path.realpath(os.path.join(run, "checkpoint"))
    return load_file(next(os.path.join(ck, f) for f in os.listdir(ck) if f.endswith(".safetensors")))


KEYS = ("loss", "grad_norm", "reward", "length", "clip_frac", "kl", "flat_groups", "logp_gap")


def test_rl_job_rollouts_file_and_resume(tmp_path, small_task, reward_file):
    a = str(tmp_path / "a")
    # a rollouts file carries no expert choices, so the sampled run it is compared with replays none either
    # (test_replayed_routing_* below has the replay)
    a_args = _args(a, reward_file, "rl.replay_routing=false")
    assert main(["rl", *a_args]) == 0
    steps = _steps(a)
    assert len(steps) == 3
    assert all(r["logp_gap"] < 1e-5 for r in steps)  # the same weights sample and train, fp32
    assert any(r["clip_frac"] > 0 for r in steps)  # the second update of a batch moved some ratios past 1.2
    assert any(r["flat_groups"] < 1 for r in steps)
    s = json.load(open(os.path.join(a, "summary.json")))
    assert list(s["after"]["accuracy"]) == ["512"] and "exact match" in s["accuracy_table"]
    for f in ("reward.png", "accuracy.png", "rollouts.jsonl"):
        assert os.path.exists(os.path.join(a, f)), f
    lines = [json.loads(x) for x in open(os.path.join(a, "rollouts.jsonl"))]
    assert [x["step"] for x in lines] == [0] * 6 + [1] * 6 + [2] * 6

    # the same rollouts from the file: no sampling, the same updates, the same weights at the end
    b = str(tmp_path / "b")
    assert main(["rl", *_args(b, reward_file, f"rl.rollouts={a}/rollouts.jsonl", "rl.save_rollouts=false")]) == 0
    assert [[r[k] for k in KEYS] for r in _steps(b)] == [[r[k] for k in KEYS] for r in steps]
    wa, wb = _weights(a), _weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    # stopped after one step and resumed: the uninterrupted run's numbers (the same prompts, draws and reference)
    c = str(tmp_path / "c")
    c_args = _args(c, reward_file, "rl.replay_routing=false")
    assert main(["rl", *c_args, "--max-steps", "1"]) == 0
    assert main(["rl", *c_args, "--resume"]) == 0
    assert [[r[k] for k in KEYS] for r in _steps(c)] == [[r[k] for k in KEYS] for r in steps]
    assert open(os.path.join(c, "rollouts.jsonl")).read() == open(os.path.join(a, "rollouts.jsonl")).read()


def test_replayed_routing_gives_the_sampler_s_log_probs_after_the_router_moved():
    """rl.replay_routing: the sampler records each token's experts (prompt and completion), and the training
    forward that replays them computes the sampler's log-probs even where its own routing would now choose
    other experts (here: router biases moved after sampling, as bf16 rounding moves near-tied scores)."""
    from longctx.generate import Routing
    from longctx.layers.moe import MoE, routing_tape
    from longctx.train.rl import replay_tape
    from longctx.train.rollouts import Rollout

    torch.manual_seed(0)
    model = LongCtxModel(preset("tiny").replace(init_std=0.2)).eval()
    prompt = torch.randint(0, 97, (37,)).numpy()
    comps = sample(model, [prompt], n=3, max_new_tokens=6, temperature=1.0, seed=0, record_routing=True)[0]
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes and all(isinstance(c.routing, Routing) for c in comps)
    for c in comps:
        for li, m in enumerate(moes):
            full = c.routing.full(li)
            assert full.shape == (len(prompt) + len(c.tokens), m.top_k)
            assert int(full.min()) >= 0 and int(full.max()) < m.n_experts
    assert all(c.routing.prompt is comps[0].routing.prompt for c in comps)  # the prompt's, shared by its group
    ros = [Rollout(prompt, c.tokens, c.logprobs, "", None, 0, routing=c.routing) for c in comps]
    seqs = [(r.prompt, r.tokens) for r in ros]
    sampled = torch.tensor([p for c in comps for p in c.logprobs])
    with torch.no_grad():
        same = torch.cat(completion_logprobs(model, seqs, "cpu"))
        for m in moes:
            m.router.bias += 5 * torch.randn(m.router.bias.shape)
        free = torch.cat(completion_logprobs(model, seqs, "cpu"))
        with routing_tape(replay_tape(model, ros, [0, 1, 2])):
            replayed = torch.cat(completion_logprobs(model, seqs, "cpu"))
    assert (same - sampled).abs().max() < 1e-5
    assert (free - sampled).abs().max() > 1e-2  # the moved routers send tokens elsewhere
    assert (replayed - sampled).abs().max() < 1e-5
    assert replay_tape(model, [Rollout(prompt, [1], [0.0], "", None, 0)], [0]) is None  # no routing: no tape


def test_export_every_writes_the_policy_an_engine_reloads(tmp_path, small_task, reward_file):
    from longctx.hf_interop import load_pretrained

    run = str(tmp_path / "run")
    assert main(["rl", *_args(run, reward_file, "rl.export_every=2", "rl.save_rollouts=false", "rl.updates=1",
                              "sft.eval_examples=0")]) == 0
    said = json.load(open(os.path.join(run, "policy.json")))
    assert said["step"] == 2
    engine = load_pretrained(said["path"])
    ours = _weights(run)  # the final checkpoint is step 3: the export is one step older
    assert any(not torch.equal(engine.state_dict()[k], ours[k]) for k in ours if k in engine.state_dict())


@pytest.mark.parametrize("reward, needle", [
    ("longctx.data.retrieval_task:exact_matc", "has no function 'exact_matc'; did you mean exact_match?"),
    ("longctx.no_such_module:f", "there is no module 'longctx.no_such_module' to import"),
    ("/nowhere/reward.py:f", "the file '/nowhere/reward.py' does not exist"),
    ("exact_match", "is not MODULE:FUNCTION or FILE.py:FUNCTION"),
])
def test_a_bad_reward_is_one_sentence_and_exit_2(tmp_path, capsys, reward, needle):
    assert main(["rl", "--set", f"rl.reward={reward}", "--set", "sft.eval_examples=0", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err, err


def test_bad_rollouts_are_one_sentence(tmp_path, capsys, small_task):
    f = tmp_path / "r.jsonl"
    good = {"prompt": [{"role": "user", "content": "hi"}], "completion_ids": [104, 254], "logprobs": [-0.1, -0.2]}
    for rows, needle in [([{**good, "logprobs": [-0.1]}], "line 1 has logprobs that are not 2 finite numbers"),
                         ([good, {**good, "step": 0}], "gives a \"step\" on some lines and not on others"),
                         ([{**good, "completion_id": [1]}], "unknown field 'completion_id'; did you mean completion_ids?"),
                         ([{k: v for k, v in good.items() if k != "logprobs"}], "line 1 has no logprobs")]:
        f.write_text("\n".join(map(json.dumps, rows)) + "\n")
        argv = ["rl", "--preset", "tiny", "--set", f"rl.rollouts={f}", "--set", "rl.old_logprobs=rollout",
                "--set", "sft.eval_examples=0", "--out", str(tmp_path / "run"), "--force"]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and needle in err and "\n" not in err, err
