"""Reinforcement learning: `task = "rl"` of `longctx train` (and `longctx rl`, its alias).

A policy-gradient loop with group-relative advantages (GRPO's), inside the trainer's run: the
stages and their learning-rate schedules, the optimizer, gradient clipping, the memory plan,
checkpoints and an exact `--resume`, metrics.jsonl, TensorBoard and the step line are the
trainer's. One step:

1. rollouts: stage.batch_size prompts, rl.group completions of each, sampled through longctx's
   decode path (`generate.sample`: the prompt prefilled once, the group decoded as one batch through
   the KDA states and DSA caches) with the run's current weights; or the step's rollouts from
   rl.rollouts, written by another engine (`train/rollouts.py` has the format).
2. rewards: rl.reward(completion text, reference answer), unless the rollout brings its own.
3. advantages: A = (r - mean of its group) / (std of its group + 1e-4), the std with Bessel's
   correction (TRL's form); a group whose rewards are all equal teaches nothing (A = 0).
4. rl.updates optimizer steps on the batch. Each runs the training forward over prompt + completion
   (the batch's sequences packed into one row, kept apart by cu_seqlens as SFT's conversations are)
   and takes the log-probs of the completion tokens only: prompt tokens carry no loss. The loss is
   PPO's clipped surrogate plus an optional KL to the starting policy,

       L = mean over completion tokens of  -min(rho A, clip(rho, 1 - eps, 1 + eps) A) + beta k3
       rho = exp(logp - logp_old),  k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1

   a token mean over the whole batch (every token weighs the same, long completions and short
   alike). logp_old is the trainer's own log-prob before the batch's first update
   (rl.old_logprobs = "trainer", so that update's ratio is exactly 1 and the later ones measure how
   far the updates moved) or the sampler's (= "rollout": the ratio then also corrects for an engine
   whose numbers differ from the trainer's). With rl.replay_routing (on) the forward sends each token
   to the experts the sampler chose for it (`replay_tape`). The forward runs in eval mode, as the
   sampler's: the MoE routers' balancing bias and the DSA indexer stay as the starting checkpoint has
   them (an RL batch, a few prompts each rl.group times over, is no sample to balance experts or fit
   an indexer on).

Each step records the mean reward, the completions' mean length, the clip fraction (tokens where
the clipped term is the smaller one), `logp_gap` (the mean |sampler log-prob - trainer log-prob|
over the completion tokens, before the first update: ~1e-7 in fp32 with longctx's sampler while
every pool is selected, more where an indexer tie resolves differently in the decode step's shorter
row (docs/design/post_training.md), the size of an outside engine's mismatch otherwise) and, with a
reference, the KL. The evaluation is SFT's (held-out exact match by haystack length, one forward a
turn), before, every eval_every steps and after; the run ends with reward.png beside the trainer's
plots.

Our own loop, not TRL's or verl's: theirs drive a transformers model and an inference server of
their own, while this one has to run longctx's sparse model, its memory plans and its checkpoints,
on one CPU as on a GPU.
"""

from __future__ import annotations

import copy
import json
import os
import time

import numpy as np
import torch

from ..errors import ConfigError
from ..layers.moe import MoE, RoutingTape, routing_tape
from .rollouts import Rollout, RolloutFile, TaskPrompts, completion_text, load_reward, rollout_line, score

ADV_EPS = 1e-4  # added to a group's reward std: a group with one reward differing by 1e-6 gets no huge advantage


# ------------------------------------------------------------------------------ the objective
def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, eps: float = ADV_EPS) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps), the std with Bessel's correction; 0 for a
    group of one."""
    adv = torch.zeros_like(rewards, dtype=torch.float64)
    for g in groups.unique():
        m = groups == g
        r = rewards[m].double()
        if r.numel() > 1:
            adv[m] = (r - r.mean()) / (r.std() + eps)
    return adv


def clipped_objective(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, clip: float,
                      ref: torch.Tensor | None = None, kl_coef: float = 0.0):
    """Per-token terms over completion tokens (1-D tensors of one length): (loss [n], clipped [n] bool,
    k3 KL [n] or None). loss = -min(rho A, clip(rho) A) + kl_coef k3; summed and divided by the batch's
    token count by the caller."""
    rho = torch.exp(logp - old)
    plain, clipped = rho * adv, rho.clamp(1 - clip, 1 + clip) * adv
    loss = -torch.minimum(plain, clipped)
    kl = None
    if ref is not None:
        d = ref - logp
        kl = torch.exp(d) - d - 1
        loss = loss + kl_coef * kl
    return loss, (clipped < plain).detach(), None if kl is None else kl.detach()


def completion_logprobs(model, seqs: list[tuple[np.ndarray, list[int]]], device) -> list[torch.Tensor]:
    """The model's log-probs of each completion's tokens after its prompt: one forward over the
    sequences packed into one row (cu_seqlens keeps them apart: KDA restarts, DSA indexes each by
    itself), the head applied at the completion positions only."""
    ids = [np.concatenate([np.asarray(p, dtype=np.int64), np.asarray(c, dtype=np.int64)]) for p, c in seqs]
    starts = np.cumsum([0] + [len(i) for i in ids])
    x = torch.as_tensor(np.concatenate(ids), device=device)[None]
    cu = torch.as_tensor(starts, dtype=torch.int64, device=device) if len(ids) > 1 else None
    h = model.hidden(x, cu_seqlens=cu)
    pos = torch.as_tensor(np.concatenate([np.arange(s + len(p) - 1, s + len(p) - 1 + len(c))
                                          for s, (p, c) in zip(starts, seqs)]), device=device)
    logits = model.lm_head(h[0, pos]).float()
    lp = torch.log_softmax(logits, -1).gather(-1, x[0, pos + 1, None]).squeeze(-1)
    return list(lp.split([len(c) for _, c in seqs]))


def replay_rows(ros: list[Rollout], idx: list[int]) -> list[torch.Tensor] | None:
    """Per MoE layer, the [1, T, k] expert choices the sampler made over the row `completion_logprobs` packs of
    rollouts `idx`; None where a rollout brought none (a rollouts file, rl.replay_routing off)."""
    if not idx or any(ros[i].routing is None for i in idx):
        return None
    return [torch.cat([ros[i].routing.full(li) for i in idx])[None] for li in range(len(ros[idx[0]].routing.prompt))]


def replay_tape(model, ros: list[Rollout], idx: list[int], rows: list[torch.Tensor] | None = None) -> RoutingTape | None:
    """A tape that replays the sampler's expert choices (rl.replay_routing) over the packed row of rollouts
    `idx` for `model`'s MoE layers (`rows`: their `replay_rows`, when already built); None where there is
    nothing to replay or the model has no MoE layer."""
    rows = replay_rows(ros, idx) if rows is None else rows
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if not moes or rows is None:
        return None
    tape = RoutingTape(replay=True)
    for m, r in zip(moes, rows, strict=True):
        tape.put(m, r)
    return tape


def rollout_seed(seed: int, step: int) -> int:
    """The sampler's seed at a step: a function of the run's seed and the step alone, so a resumed run (or
    an engine that samples the same prompts) draws the same completions."""
    return int(np.random.SeedSequence([int(seed), 4, int(step)]).generate_state(1)[0])


# ------------------------------------------------------------------------------ the stream of prompts
class RLStream:
    """The trainer's `stream` for RL: its state is how many prompts (or the file's groups) the run has
    taken, so a checkpoint resumes the prompts exactly; the stage sets the window."""

    def __init__(self, source_key: tuple):
        self.key, self.cursor = source_key, 0
        self.seq_len, self.batch_size = None, None

    def set_window(self, seq_len: int, batch_size: int | None = None) -> None:
        self.seq_len = int(seq_len)
        if batch_size is not None:
            self.batch_size = int(batch_size)

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "source": list(self.key)}

    def load_state_dict(self, state: dict) -> None:
        from ..errors import DataError

        def plain(x):  # tuples read back as lists (a JSON checkpoint) or kept (a pickled one): compare both alike
            return json.loads(json.dumps(list(x)))

        if plain(state.get("source", [])) != plain(self.key):
            raise DataError("the checkpoint's data stream is not this RL run's (another task, or sampled prompts "
                            "against rl.rollouts); resume with the settings the run was started with.")
        self.cursor = int(state["cursor"])


# ------------------------------------------------------------------------------ the run's RL part
class RL:
    """What task = rl adds to the trainer: the rollouts, the reward, the reference, the step."""

    def __init__(self, cfg, tokenizer, log=print):
        """The reward function and a rollouts file are read (and their mistakes said) here, before the
        task's files are; `bind` then hands over SFT's data: the template, the task, the held-out set."""
        from ..data.chat import load_template

        self.cfg, self.r, self.tok, self.log = cfg, cfg.rl, tokenizer, log
        self.reward_fn = load_reward(self.r.reward)
        self.template = load_template(cfg.sft.template, tokenizer)
        self.file = self.prompts = self.data = None
        if self.r.rollouts is not None:
            self.file = RolloutFile(self.r.rollouts, self.template, tokenizer, self.r.old_logprobs == "rollout")
        self.ref = None
        self._trimmed = False  # OUT/rollouts.jsonl cut back to the resumed step

    def bind(self, data) -> None:
        """Take SFT's data (train/sft.py): the task's training split for the prompts, the held-out set."""
        self.data, self.template = data, data.template
        if self.file is None:
            self.prompts = TaskPrompts(data.source.task, data.template, self.cfg.sft.min_len, self.r.max_new_tokens,
                                       self.cfg.seed)
            for i, st in enumerate(self.cfg.stages):
                self.prompts.check(st.seq_len, f"stages.{i}.seq_len")
        self.stream = RLStream(self.file.state_key() if self.file is not None else self.prompts.state_key())

    def describe(self) -> str:
        r = self.r
        src = (f"rollouts from {r.rollouts}" if self.file is not None else
               f"the retrieval task's prompts ({self.cfg.sft.questions} questions per haystack, kinds "
               f"{', '.join(self.cfg.sft.kinds)}), {r.group} completions each at temperature {r.temperature}"
               + (f", top-p {r.top_p}" if r.top_p < 1 else "") + (f", top-k {r.top_k}" if r.top_k else ""))
        kl = f", KL {r.kl_coef} to the start" if r.kl_coef else ""
        return (f"rl on {src}; reward {r.reward}; clip {r.clip}{kl}, {r.updates} update(s) a batch; "
                f"held-out: {len(self.data.eval_convs)} examples at {', '.join(map(str, self.data.lengths)) or '-'} tokens")

    def attach(self, model) -> None:
        """Freeze a copy of the starting weights as the KL's reference (only when rl.kl_coef > 0). Called
        before any checkpoint is resumed, so a resumed run has the same reference."""
        if self.r.kl_coef > 0:
            self.ref = copy.deepcopy(model).eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)

    # ------------------------------------------------------------------ rollouts
    def rollouts(self, trainer, stage) -> list[Rollout]:
        """This step's rollouts, every one with its reward and its group index."""
        step = trainer.step
        if self.file is not None:
            groups, took = self.file.step(step, self.stream.cursor, stage.batch_size)
            self.stream.cursor += took
            out = []
            for gi, g in enumerate(groups):
                for r in g:
                    out.append(copy.copy(r))
                    out[-1].group = gi
        else:
            out = self._sample(trainer, stage)
        for r in out:
            if r.reward is None:
                r.reward = score(self.reward_fn, self.r.reward, r.text, r.answer)
        return out

    def _sample(self, trainer, stage) -> list[Rollout]:
        from ..generate import sample

        r = self.r
        ks = range(self.stream.cursor, self.stream.cursor + stage.batch_size)
        self.stream.cursor += stage.batch_size
        prompts = [self.prompts.get(k, stage.seq_len) for k in ks]
        seed = rollout_seed(self.cfg.seed, trainer.step)
        dev, dt = trainer.device, trainer.dtype
        auto = dt != torch.float32
        with torch.autocast(dev.type, dtype=dt, enabled=auto):
            groups = sample(trainer.model, [p[0] for p in prompts], n=r.group, max_new_tokens=r.max_new_tokens,
                            temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, seed=seed,
                            stop_ids=self.template.stop_ids, stop_strings=r.stop, decode=self.tok.decode,
                            vocab_limit=self.tok.vocab_size, cache_dtype=dt if auto else None,
                            record_routing=r.replay_routing)
        trainer.model.clear_aux()
        out = []
        for gi, ((ids, _, answer, length), comps) in enumerate(zip(prompts, groups)):
            for c in comps:
                out.append(Rollout(ids, c.tokens, c.logprobs, completion_text(self.template, c.tokens, r.stop),
                                   answer, gi, prompt_len=length, finish=c.finish, routing=c.routing))
        return out

    # ------------------------------------------------------------------ the step
    def train_step(self, trainer, stage, lr: float) -> dict:
        """One step at learning rate `lr` (the stage's schedule); the trainer adds the peak memory."""
        if getattr(trainer.memory_policy, "forward_backward", None) is not None:
            raise ConfigError("task = rl packs a step's sequences into one row, which the sequence-chunked step "
                              "(memory.seq_chunk) does not take; set memory.seq_chunk = 0.")
        model, r = trainer.model, self.r
        t0 = time.perf_counter()
        ros = self.rollouts(trainer, stage)
        rollout_s = time.perf_counter() - t0
        rewards = torch.tensor([x.reward for x in ros], dtype=torch.float64)
        groups = torch.tensor([x.group for x in ros])
        for g in trainer.opt.param_groups:
            g["lr"] = lr
        stats = self._updates(trainer, ros, group_advantages(rewards, groups))
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)
        dt = time.perf_counter() - t0
        n_groups = int(groups.max()) + 1
        flat = sum(int(rewards[groups == g].unique().numel() == 1) for g in range(n_groups))
        trained = sum(len(x.prompt) + len(x.tokens) for x in ros) * r.updates
        rec = {"step": trainer.step + 1, "stage": trainer.stage_at(trainer.step)[0], "seq_len": stage.seq_len,
               **stats, "lr": lr, "reward": float(rewards.mean()),
               "reward_std": float(rewards.std()) if len(ros) > 1 else 0.0,
               "length": float(np.mean([len(x.tokens) for x in ros])), "flat_groups": flat / n_groups,
               "truncated": sum(x.finish == "length" for x in ros) / len(ros),
               "prompt_tokens": float(np.mean([len(x.prompt) for x in ros])),
               "rollout_s": rollout_s, "tokens_per_s": trained / dt, "step_s": dt,
               "moe_max_over_mean": model.moe_balance(), "impl": model.impl_report()}
        if trainer.rank == 0:
            self._write(trainer, ros, rec["step"])
        return rec

    def _updates(self, trainer, ros: list[Rollout], adv: torch.Tensor) -> dict:
        """rl.updates optimizer steps on the rollouts; returns what the step records of them: the loss,
        the last grad norm, the clip fraction, the rollout-vs-trainer gap and the KL (with a reference).

        The forward runs in eval mode, as the sampler's does: the policy gradient trains the policy and
        nothing else. In train mode the MoE layers would install a router bias balanced on this batch
        (a few prompts, each `group` times over: no sample of the data to balance experts on, and the
        quantile balancer replaces the bias outright) and the DSA layers would fit their indexer to it;
        both stay as the starting checkpoint has them."""
        model, dev, r = trainer.model, trainer.device, self.r
        n_tok = sum(len(x.tokens) for x in ros)
        mb = r.micro_batch or len(ros)
        batches = [list(range(i, min(i + mb, len(ros)))) for i in range(0, len(ros), mb)]
        old: dict[int, torch.Tensor] = {}  # rollout -> logp_old (rl.old_logprobs = "trainer": the first update's)
        gap_sum, gap_n, clipped, kl_sum, loss_sum, gn = 0.0, 0, 0, 0.0, 0.0, 0.0
        autocast = dict(device_type=dev.type, dtype=trainer.dtype, enabled=trainer.dtype != torch.float32)
        max_norm = trainer.cfg.grad_clip if trainer.cfg.grad_clip > 0 else float("inf")
        model.eval()
        replay = [replay_rows(ros, idx) for idx in batches]  # built once, for every update and the reference
        for u in range(r.updates):
            for idx, rows in zip(batches, replay):
                seqs = [(ros[i].prompt, ros[i].tokens) for i in idx]
                ref = None
                if self.ref is not None:
                    with (torch.no_grad(), torch.autocast(**autocast),
                          routing_tape(replay_tape(self.ref, ros, idx, rows))):
                        ref = completion_logprobs(self.ref, seqs, dev)
                    self.ref.clear_aux()
                tape = replay_tape(model, ros, idx, rows)
                with torch.autocast(**autocast), routing_tape(tape):
                    lps = completion_logprobs(model, seqs, dev)
                total = 0.0
                for j, (i, lp) in enumerate(zip(idx, lps)):
                    sampled = ros[i].logprobs
                    if sampled is not None:
                        sampled = torch.tensor(sampled, dtype=torch.float32, device=dev)
                    if u == 0:
                        if sampled is not None:
                            gap_sum += float((lp.detach() - sampled).abs().sum())
                            gap_n += lp.numel()
                        old[i] = sampled if r.old_logprobs == "rollout" else lp.detach()
                    loss, clip_mask, kl = clipped_objective(lp, old[i], torch.full_like(lp, float(adv[i])), r.clip,
                                                            None if ref is None else ref[j], r.kl_coef)
                    total = total + loss.sum()
                    clipped += int(clip_mask.sum())
                    kl_sum += float(kl.sum()) if kl is not None else 0.0
                with routing_tape(tape):  # a block recompute in the backward replays the same choices
                    (total / n_tok).backward()
                loss_sum += float(total.detach()) / n_tok
            gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
            trainer.opt.step()
            trainer.opt.zero_grad(set_to_none=True)
            if trainer.memory_policy is not None:
                trainer.memory_policy.end_step()
        out = {"loss": loss_sum / r.updates, "grad_norm": gn, "clip_frac": clipped / (n_tok * r.updates)}
        if gap_n:  # none without the sampler's log-probs (a rollouts file may leave them out)
            out["logp_gap"] = gap_sum / gap_n
        if self.ref is not None:
            out["kl"] = kl_sum / (n_tok * r.updates)
        return out

    # ------------------------------------------------------------------ files of the run
    def _write(self, trainer, ros: list[Rollout], done: int) -> None:
        """OUT/rollouts.jsonl (rl.save_rollouts) and the exported policy (rl.export_every)."""
        out = trainer.out
        if self.r.save_rollouts:
            path = os.path.join(out, "rollouts.jsonl")
            if not self._trimmed:  # a resumed run: the lines of steps after its checkpoint go
                self._trimmed = True
                if os.path.exists(path):
                    with open(path) as f:
                        keep = [x for x in f if x.strip() and json.loads(x)["step"] < done - 1]
                    with open(path, "w") as f:
                        f.writelines(keep)
            with open(path, "a") as f:
                for x in ros:
                    f.write(json.dumps(rollout_line(done - 1, x)) + "\n")
        if self.r.export_every and done % self.r.export_every == 0:
            export_policy(trainer.model, out, done)


def export_policy(model, out: str, step: int) -> str:
    """The policy after `step` steps in the transformers (GLM-5.3-Flash hub) layout, in OUT/policy (replaced
    whole: export_hf writes aside and renames), then OUT/policy.json {"step", "path"}, written last and
    atomically: an engine that polls policy.json reloads only complete weights, and the rollouts it then
    samples belong to step `step` (0-based: the policy has had that many updates)."""
    from ..hf_interop import export_hf

    path = os.path.join(out, "policy")
    was = model.training
    export_hf(model, path, force=True)
    model.train(was)
    tmp = os.path.join(out, "policy.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"step": step, "path": os.path.abspath(path)}, f)
    os.replace(tmp, os.path.join(out, "policy.json"))
    return path


def reward_plot(history: list[dict], path: str) -> None:
    """reward.png: the mean reward of each step's rollouts, and its running mean over 5 steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [x for x in history if "reward" in x]
    steps, rew = [x["step"] for x in recs], [x["reward"] for x in recs]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rew, "o", ms=3, alpha=0.5, label="mean reward of the step's rollouts")
    if len(rew) >= 5:
        run = np.convolve(rew, np.ones(5) / 5, mode="valid")
        ax.plot(steps[4:], run, "-", lw=1.5, label="running mean (5 steps)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_parallel(world: int) -> None:
    if world > 1:
        raise ConfigError(f"task = rl runs in one process for now (its rollouts are sampled by the one model), and "
                          f"this launch has {world}; run it without torchrun.")


__all__ = ["RL", "RLStream", "check_parallel", "clipped_objective", "completion_logprobs", "export_policy",
           "group_advantages", "reward_plot", "rollout_seed"]
