"""RL's rollouts: where the prompts come from, the rollouts file format, the reward function.

A rollout is one sampled completion of a prompt, with the log-probability of each of its tokens
under the policy that sampled it and a reward. RL (`train/rl.py`) gets them in one of two ways:

* sampled by longctx itself (`generate.sample`) from the prompts of the embedded retrieval task
  (`TaskPrompts`): a training haystack and one of its questions, the answers to the questions
  before it in place, the reference answer kept for the reward;
* read from `rl.rollouts`, a .jsonl file another engine (vLLM, SGLang, ...) wrote (`RolloutFile`),
  one rollout a line:

      {"step": 3,                          # optional: the step that trains on it (0-based)
       "group": 7,                         # optional: rollouts of one prompt share it (default: the prompt)
       "prompt": [{"role": "user", ...}],  # the conversation so far, rendered with the template's
                                           #   generation prompt; or "prompt_ids": [token ids]
       "completion_ids": [...],            # the sampled tokens (the stop token included); or "completion": "text"
       "logprobs": [...],                  # the engine's log p of each completion token (temperature 1)
       "reward": 1.0,                      # optional: else rl.reward(completion text, answer)
       "answer": "..."}                    # optional: the reference the reward function compares with

  Lines with "step" are trained at that step (a file per step, or one file for many); without it,
  each step takes the next stage.batch_size groups in file order. `rl.save_rollouts` writes
  longctx's own rollouts in this format (`rollout_line`), so a run's rollouts can be trained on again.

The reward is a plain function named by `rl.reward`: "package.module:function" or
"path/to/file.py:function", called as f(completion_text, answer) -> float.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data.chat import _first_line, _short
from ..errors import ConfigError, DataError, UserError, did_you_mean


@dataclass
class Rollout:
    prompt: np.ndarray             # int64 token ids: what the completion continues
    tokens: list[int]              # the completion
    logprobs: list[float] | None   # the sampler's log p of each completion token; None: the engine gave none
    text: str                      # the completion as the reward reads it
    answer: str | None             # the reference answer, when the prompt has one
    group: int                     # which group of its step (the completions of one prompt)
    reward: float | None = None
    prompt_len: int = 0            # the haystack's length for a task prompt (tokens it was built for)
    finish: str | None = None      # how the sampler ended it: "stop", "stop_string", "length"
    routing: object = None         # the sampler's MoE expert choices (generate.Routing), for rl.replay_routing


# ------------------------------------------------------------------------------ the reward
def load_reward(spec: str):
    """The function rl.reward names ("module:function" or "file.py:function"), or one ConfigError sentence."""
    target, _, name = spec.rpartition(":")
    fix = "set rl.reward to MODULE:FUNCTION or FILE.py:FUNCTION of a function f(completion, answer) -> float"
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise ConfigError(f"rl.reward {spec!r}: the file {target!r} does not exist; {fix}.")
        try:
            spec_ = importlib.util.spec_from_file_location(f"longctx_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(spec_)
            spec_.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - the user's file: any error it raises is theirs to fix
            raise ConfigError(f"rl.reward {spec!r}: running {target!r} raised {type(e).__name__} ({_first_line(e)}); "
                              "fix the file.") from None
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            raise ConfigError(f"rl.reward {spec!r}: there is no module {e.name or target!r} to import; {fix}.") from None
        except Exception as e:  # noqa: BLE001 - the module imported but failed: its own error
            raise ConfigError(f"rl.reward {spec!r}: importing {target!r} raised {type(e).__name__} ({_first_line(e)}); "
                              "fix the module.") from None
    fn = getattr(module, name, None)
    if fn is None:
        names = [n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise ConfigError(f"rl.reward {spec!r}: {target!r} has no function {name!r}"
                          + (did_you_mean(name, names) or f"; {fix}."))
    if not callable(fn):
        raise ConfigError(f"rl.reward {spec!r}: {name!r} in {target!r} is a {type(fn).__name__}, not a function; {fix}.")
    return fn


def score(fn, spec: str, text: str, answer: str | None) -> float:
    """fn(text, answer) as a float; an exception or a value that is not a finite number is one sentence."""
    try:
        v = fn(text, answer)
    except Exception as e:  # noqa: BLE001 - the user's function
        raise UserError(f"rl.reward {spec!r} raised {type(e).__name__} ({_first_line(e)}) on the completion "
                        f"{_short(text)}; fix the function.") from None
    try:
        v = float(v)
    except (TypeError, ValueError):
        v = math.nan
    if not math.isfinite(v):
        raise UserError(f"rl.reward {spec!r} returned {_short(v)} for the completion {_short(text)}; return a "
                        "finite number.")
    return v


# ------------------------------------------------------------------------------ the task's prompts
class TaskPrompts:
    """Prompt k of the embedded task: training example k at a length drawn from [min_len, limit]
    (limit: the stage's seq_len less rl.max_new_tokens, so that prompt and completion fit the stage),
    up to one of its questions, drawn too; a pure function of (seed, k, limit)."""

    def __init__(self, task, template, min_len: int, max_new_tokens: int, seed: int):
        self.task, self.template = task, template
        self.min_len, self.max_new, self.seed = int(min_len), int(max_new_tokens), int(seed)

    def lengths(self, seq_len: int) -> tuple[int, int]:
        """The range of haystack lengths a stage of `seq_len` draws from."""
        hi = max(seq_len - self.max_new, 64)
        return min(self.min_len, hi), hi

    def check(self, seq_len: int, setting: str) -> None:
        """One sentence now, not mid-run, when the shortest haystack of a stage cannot be built (eight of
        them tried: at a length that is just enough, some draws fit and some do not)."""
        lo, _ = self.lengths(seq_len)
        try:
            for k in range(8):
                self.task.example(k, lo)
        except DataError:
            raise DataError(f"task = rl: no haystack of {lo} tokens (the shortest that {setting} less rl.max_new_tokens, "
                            f"and sft.min_len, allow) holds sft.questions = {self.task.questions} questions; raise "
                            "sft.min_len or the stage's seq_len, or lower sft.questions.") from None

    def get(self, k: int, seq_len: int) -> tuple[np.ndarray, list[dict], str, int]:
        """(prompt ids, prompt messages, reference answer, the haystack's length)."""
        lo, hi = self.lengths(seq_len)
        rng = np.random.default_rng([self.seed, 3, k])
        length = int(rng.integers(lo, hi + 1))
        ex = self.task.example(k, length)
        j = int(rng.integers(len(ex.questions)))
        msgs = ex.messages[: 2 * j + 1]
        return self.template.generation_prompt(msgs, f"task prompt {k}"), msgs, ex.answers[j], length

    def state_key(self) -> tuple:
        return ("rl-task", self.seed, self.task.questions, self.task.kinds, self.min_len, self.max_new)


def completion_text(template, tokens: list[int], stop: list[str]) -> str:
    """A sampled completion as the reward reads it: the template's parse of the turn (up to its stop
    token), cut before the first stop string."""
    text = template.completion(tokens)["content"]
    cuts = [i for s in stop if (i := text.find(s)) >= 0]
    return text[: min(cuts)] if cuts else text


# ------------------------------------------------------------------------------ the rollouts file
class RolloutFile:
    """rl.rollouts, read and checked whole when the run starts (a mistake is one sentence naming the line)."""

    def __init__(self, path: str, template, tokenizer, need_logprobs: bool):
        p = Path(path).expanduser()
        if not p.is_file():
            raise DataError(f"rl.rollouts '{path}' does not exist (or is not a file); point it at a .jsonl file of "
                            "rollouts.")
        self.path = path
        self.by_step: dict[int, list[list]] = {}  # step -> its groups, each a list of (line, Rollout)
        self.groups: list[list] = []              # without "step": every group in file order
        steps = set()
        keyed: dict = {}
        with open(p, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"rl.rollouts '{path}' line {n}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where} is not JSON ({e.msg}); write one rollout object per line.") from None
                if not isinstance(row, dict):
                    raise DataError(f"{where} is {type(row).__name__}, not an object; write one rollout object per line.")
                ro, step, key = self._rollout(row, where, template, tokenizer, need_logprobs)
                steps.add(step is None)
                group_key = (step, key)
                if group_key not in keyed:
                    keyed[group_key] = []
                    (self.by_step.setdefault(step, []) if step is not None else self.groups).append(keyed[group_key])
                keyed[group_key].append(ro)
        if not keyed:
            raise DataError(f"rl.rollouts '{path}' has no rollouts (it is empty); give at least one.")
        if len(steps) > 1:
            raise DataError(f"rl.rollouts '{path}' gives a \"step\" on some lines and not on others; give it on every "
                            "line (or on none: each step then takes the next groups in file order).")
        self.stepped = bool(self.by_step)

    @staticmethod
    def _rollout(row: dict, where: str, template, tokenizer, need_logprobs: bool):
        known = ("step", "group", "prompt", "prompt_ids", "completion", "completion_ids", "logprobs", "reward",
                 "answer", "finish", "prompt_len")
        for k in row:
            if k not in known:
                raise DataError(f"{where} has the unknown field {k!r}" + (did_you_mean(k, known) or
                                f"; a rollout takes {', '.join(known)}."))
        step = row.get("step")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise DataError(f"{where} has the step {_short(step)}; give the 0-based step that trains on it.")
        if "prompt_ids" in row:
            prompt = _ids(row["prompt_ids"], where, "prompt_ids", tokenizer)
            key = ("ids", tuple(prompt.tolist()))
        elif "prompt" in row:
            prompt = template.generation_prompt(row["prompt"], f"{where}, prompt")
            key = ("messages", json.dumps(row["prompt"], sort_keys=True))
        else:
            raise DataError(f"{where} has no prompt; give \"prompt\" (messages) or \"prompt_ids\" (token ids).")
        if not len(prompt):
            raise DataError(f"{where} has an empty prompt; give the conversation the completion continues.")
        if "completion_ids" in row:
            tokens = _ids(row["completion_ids"], where, "completion_ids", tokenizer).tolist()
            text = row["completion"] if isinstance(row.get("completion"), str) else template.completion(tokens)["content"]
        elif isinstance(row.get("completion"), str):
            text = row["completion"]
            tokens = [int(t) for t in tokenizer.encode(text)]
        else:
            raise DataError(f"{where} has no completion; give \"completion_ids\" (token ids) or \"completion\" (text).")
        if not tokens:
            raise DataError(f"{where} has an empty completion; a rollout needs at least one sampled token.")
        lps = row.get("logprobs")
        if lps is None and need_logprobs:
            raise DataError(f"{where} has no logprobs, which rl.old_logprobs = \"rollout\" divides by; give the engine's "
                            "log-probability of each completion token, or set rl.old_logprobs = \"trainer\".")
        if lps is not None:
            if not isinstance(lps, list) or len(lps) != len(tokens) or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and x <= 0 and math.isfinite(x) for x in lps):
                raise DataError(f"{where} has logprobs that are not {len(tokens)} finite numbers <= 0 (one per "
                                "completion token); give the engine's log-probability of each sampled token.")
            lps = [float(x) for x in lps]
        reward = row.get("reward")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                                   or not math.isfinite(reward)):
            raise DataError(f"{where} has the reward {_short(reward)}; give a finite number, or leave it out to "
                            "score the completion with rl.reward.")
        answer = row.get("answer")
        if answer is not None and not isinstance(answer, str):
            raise DataError(f"{where} has an answer of type {type(answer).__name__}; make it a string.")
        if "group" in row:
            key = ("group", json.dumps(row["group"]))
        finish = row.get("finish")
        ro = Rollout(prompt, tokens, lps, text, answer, group=-1, reward=None if reward is None else float(reward),
                     prompt_len=int(row.get("prompt_len") or len(prompt)), finish=finish if isinstance(finish, str) else None)
        return ro, step, key

    def step(self, step: int, cursor: int, n_groups: int) -> tuple[list[list[Rollout]], int]:
        """(the groups step `step` trains on, how many groups of the file in order that took)."""
        if self.stepped:
            if step not in self.by_step:
                have = sorted(self.by_step)
                raise DataError(f"rl.rollouts '{self.path}' has no rollouts for step {step} (it has steps "
                                f"{_ranges(have)}); give them, or stop the run before that step (--max-steps {step}).")
            return self.by_step[step], 0
        if cursor + n_groups > len(self.groups):
            raise DataError(f"rl.rollouts '{self.path}' has {len(self.groups)} groups, and step {step} needs groups "
                            f"{cursor}..{cursor + n_groups - 1}; give more rollouts, or fewer steps or prompts a step "
                            "(stages.N.batch_size).")
        return self.groups[cursor: cursor + n_groups], n_groups

    def state_key(self) -> tuple:
        # not the path: a loop with an outside engine gives each round's file to the run it resumes
        return ("rl-rollouts", self.stepped)


def rollout_line(step: int, r: Rollout) -> dict:
    """One rollout in the rl.rollouts format (what rl.save_rollouts writes)."""
    line = {"step": step, "group": r.group, "prompt_ids": [int(t) for t in r.prompt], "completion_ids": r.tokens,
            "completion": r.text, "logprobs": r.logprobs, "reward": r.reward, "answer": r.answer,
            "prompt_len": r.prompt_len, "finish": r.finish}
    return {k: v for k, v in line.items() if v is not None}


def _ids(v, where: str, name: str, tokenizer) -> np.ndarray:
    n = tokenizer.vocab_size
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n for t in v):
        raise DataError(f"{where} has {name} that are not token ids in [0, {n}); give a list of the tokenizer's ids.")
    return np.asarray(v, dtype=np.int64)


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "none"
    out, a, b = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == b + 1:
            b = x
            continue
        out.append(f"{a}" if a == b else f"{a}..{b}")
        if x is not None:
            a = b = x
    return ", ".join(out)
