"""What a run shows while it trains: the step line, the time left, the kernels line, TensorBoard.

The step line leads with what a user watches (progress, loss, speed, time left, memory) and keeps the
curriculum and health fields short after it (the README's short CPU run of the demo):

    step 4/5 | loss 4.5685 | 66 tok/s | eta 0:01:02 | peak 1.55 GiB | stage 1 seq 4k | gnorm 3.46 | moe 3.22

Which implementation each layer kind ran (`LongCtxModel.impl_report()`) is too long for every line
and rarely changes, so it is a line of its own (`kernels: ...`) on the first step and whenever it
changes; every metrics.jsonl record keeps it.
"""

from __future__ import annotations

import math

NOT_INSTALLED = "tensorboard is not installed: pip install tensorboard for TensorBoard logs; metrics.jsonl has everything"


def format_duration(seconds: float) -> str:
    """h:mm:ss, hours unbounded (a 1M-token curriculum runs for days: 53:07:12)."""
    s = max(0, int(round(seconds)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def format_tokens(n: int) -> str:
    """A sequence length as the curriculum is spoken of: 4k, 256k, 1M; other lengths in full."""
    if n >= 2**20 and n % 2**20 == 0:
        return f"{n >> 20}M"
    if n >= 2**10 and n % 2**10 == 0:
        return f"{n >> 10}k"
    return str(n)


def step_line(r: dict) -> str:
    """One step's record (Trainer.train_step's, with `total_steps` and `eta_s`) as its log line."""
    total = r.get("total_steps")
    step = f"{r['step']:>{len(str(total))}d}/{total}" if total else str(r["step"])
    eta = format_duration(r["eta_s"]) if r.get("eta_s") is not None else "-"
    est = f" (est {r['estimate_gib']:.1f})" if r.get("estimate_gib") is not None else ""
    bal = f" | moe {r['moe_max_over_mean']:.2f}" if r.get("moe_max_over_mean") else ""  # max/mean expert load
    rl = ""  # task = rl: what its rollouts scored and how far the trainer's numbers are from the sampler's
    if "reward" in r:
        rl = (f" | reward {r['reward']:.3f} | len {r['length']:.1f} | clip {r['clip_frac']:.3f}"
              + (f" | dlogp {r['logp_gap']:.1e}" if r.get("logp_gap") is not None else "")
              + (f" | kl {r['kl']:.4f}" if r.get("kl") is not None else ""))
    return (f"step {step} | loss {r['loss']:.4f}{rl} | {r['tokens_per_s']:,.0f} tok/s | eta {eta} | "
            f"peak {r['peak_gib']:.2f} GiB{est} | stage {r['stage']} seq {format_tokens(r['seq_len'])} | "
            f"gnorm {r['grad_norm']:.2f}{bal}")


class Eta:
    """The time left in the run, from the step times this process has measured.

    The steps left in the current stage take its mean step time; each later stage's steps take that
    time scaled by the stage's tokens per step: a stage not yet reached has no times of its own, and a
    step's cost grows about linearly with its tokens (KDA is linear in length, DSA attends a fixed
    top-k), so a 1M-token step counts as 128 steps of 8k, not one. The mean leaves out a stage's first
    step once the stage has another: the first carries the stage's one-off costs (kernel autotuning
    and compilation for the new shapes, the allocator growing). Unknown (None) until the process has
    timed two steps, the first alone being that warm-up.
    """

    def __init__(self, stages):
        self.steps = [s.steps for s in stages]
        self.tokens = [s.seq_len * s.batch_size for s in stages]
        self.ends = [sum(self.steps[: i + 1]) for i in range(len(stages))]
        self._times: dict[int, list] = {}  # stage -> [first step's s, sum of the later steps' s, their count]
        self._stage = None
        self._timed = 0

    def add(self, stage: int, seconds: float) -> None:
        t = self._times.get(stage)
        if t is None:
            self._times[stage] = [seconds, 0.0, 0]
        else:
            t[1] += seconds
            t[2] += 1
        self._stage = stage
        self._timed += 1

    def remaining_s(self, step: int) -> float | None:
        """Seconds until the run's last step, `step` steps being done."""
        if self._timed < 2:
            return None
        si = self._stage
        first, rest, n = self._times[si]
        mean = rest / n if n else first
        later = sum(self.steps[j] * self.tokens[j] for j in range(si + 1, len(self.steps))) / self.tokens[si]
        return mean * (max(0, self.ends[si] - step) + later)


class TensorBoard:
    """TensorBoard event files in OUT/tb: each step's numbers under train/, the held-out loss under
    eval/loss and its position buckets under eval_loss_by_position/, the kernels line as text when it
    changes. Without the tensorboard package there are none, and `note` says so (the trainer says it
    once, at the start); metrics.jsonl holds every record either way."""

    SKIP = ("step", "total_steps", "eta_s")  # the x axis, and what only the step line needs

    def __init__(self, logdir: str):
        self.writer, self.note = None, None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            self.note = NOT_INSTALLED
            return
        except Exception as exc:  # an install that cannot import (a protobuf of the wrong version, say)
            self.note = (f"tensorboard cannot be imported ({type(exc).__name__}: {exc}); this run writes no "
                         "TensorBoard logs, metrics.jsonl has everything")
            return
        self.writer = SummaryWriter(logdir)

    def record(self, rec: dict) -> None:
        if self.writer is None:
            return
        step = rec["step"]
        if "loss" in rec:
            for k, v in rec.items():
                if k not in self.SKIP and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.writer.add_scalar(f"train/{k}", v, step)
        if "eval_loss" in rec:
            self.writer.add_scalar("eval/loss", rec["eval_loss"], step)
            width = len(str(rec["buckets"][-1]["end"])) if rec["buckets"] else 1
            for b in rec["buckets"]:
                if not math.isnan(b["loss"]):
                    self.writer.add_scalar(f"eval_loss_by_position/{b['start']:0{width}d}-{b['end']:0{width}d}",
                                           b["loss"], step)

    def kernels(self, report: str, step: int) -> None:
        if self.writer is not None:
            self.writer.add_text("kernels", report, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
