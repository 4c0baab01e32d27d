"""Supervised fine-tuning: `task = "sft"` of `longctx train` (and `longctx sft`, its alias).

The run is the pretraining run in every other way (the curriculum stages, the memory plan of each
stage, checkpoints and resume, the step log, metrics.jsonl, plots); what changes is the data and
the evaluation:

* data: conversations through a chat template (`data.chat`), packed into rows that keep them apart
  (`data.chat_packing`), the loss on what the assistant wrote only (-100 elsewhere). `data.path`
  None trains on the embedded retrieval task (`data.retrieval_task`), each training example drawn
  at a length from sft.min_len up to the stage's seq_len.
* evaluation (before training, every eval_every steps, at the end): held-out conversations, the
  masked loss and the exact-match accuracy of every assistant turn. For the task: accuracy by
  haystack length (sft.eval_lengths) and by question kind, and the per-position table of `train`
  with one bucket per length (the answers sit at the end of each haystack). For conversations from
  files: the turns' exact match, and the masked loss by position in the conversation.

Exact match is scored in one forward pass: a turn counts when the argmax at each of its positions
is the reference token, which is what greedy decoding from the conversation so far produces (the
answers before it in the conversation are the reference ones).

Our own module: what SFT adds is the data and the scoring around one training loop; a second loop
would have to repeat the memory plan, the checkpoints and the resume logic.
"""

from __future__ import annotations

import json
import math

import torch

from ..data.chat import EncodedChat, load_template, read_conversations
from ..data.chat_packing import ChatStream, ConversationList
from ..data.sources import held_out
from ..errors import ConfigError, DataError


def default_eval_lengths(longest_stage: int) -> list[int]:
    """4096 and its doublings up to the longest stage (the longest stage alone when shorter)."""
    if longest_stage < 4096:
        return [longest_stage]
    out, L = [], 4096
    while L <= longest_stage:
        out.append(L)
        L *= 2
    return out


class SFTData:
    """The stream, the template and the held-out set of one SFT run."""

    def __init__(self, cfg, tokenizer, quiet: bool = False, log=print):
        s = cfg.sft
        self.cfg, self.tokenizer = cfg, tokenizer
        self.template = load_template(s.template, tokenizer)
        self.pad_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0
        longest = max(st.seq_len for st in cfg.stages)
        self.task = None
        if cfg.data.path is None:
            self._task_data(cfg, longest, quiet, log)
        else:
            self._file_data(cfg, quiet, log)
        self.stream = ChatStream(self.source, cfg.stages[0].seq_len, cfg.stages[0].batch_size, self.pad_id)
        # the trainer's `data:` line and its evaluation switch read these
        self.train_tokens, self.eval_tokens = [], [c.tokens for c in self.eval_convs]
        self.eval_set = self.eval_convs if self.eval_convs else None

    # ------------------------------------------------------------------ sources
    def _encode(self, messages, where: str) -> EncodedChat:
        return self.template.encode(messages, where)

    def _task_data(self, cfg, longest: int, quiet: bool, log) -> None:
        from ..data.retrieval_task import RetrievalTask, TrainExamples, eval_examples, stdlib_files

        s = cfg.sft
        tok = self.tokenizer

        def count(text: str) -> int:
            return len(tok.encode(text))

        def overhead(msgs) -> int:
            return len(self._encode(msgs, "the task's template"))

        train_files, held_files, root = stdlib_files()
        if not quiet:
            log(f"sft task: reading {len(train_files) + len(held_files)} stdlib files for the retrieval task")
        train = RetrievalTask(train_files, root, cfg.seed, count, overhead, s.questions, s.kinds, split="train",
                              ask_first=s.ask_first)
        self.source = TrainExamples(train, self._encode, s.min_len)
        for st in cfg.stages:  # the shortest example of each stage can be built (else one sentence now, not mid-run)
            train.example(0, min(s.min_len, st.seq_len))
        self.task = RetrievalTask(held_files, root, cfg.seed, count, overhead, s.questions, s.kinds, split="eval",
                                  ask_first=s.ask_first)
        self.lengths = list(s.eval_lengths) or default_eval_lengths(longest)
        self.eval_convs, self.eval_length, self.eval_kinds = [], [], []
        if s.eval_examples > 0:
            for L, exs in eval_examples(self.task, self.lengths, s.eval_examples).items():
                for ex in exs:
                    self.eval_convs.append(self._encode(ex.messages, f"held-out example at {L}"))
                    self.eval_length.append(L)
                    self.eval_kinds.append(ex.kinds)
        self.n_train_files, self.n_eval_files = len(train.files), len(self.task.files)

    def _file_data(self, cfg, quiet: bool, log) -> None:
        convs = read_conversations(cfg.data.path, cfg.sft.messages_field)
        named = [(where, self._encode(msgs, where)) for where, msgs in convs]
        for where, enc in named:
            if not enc.spans:
                raise DataError(f"{where} has no assistant turn to train on (or only weight-0 ones); give it one, "
                                "or drop the conversation.")
        n_eval = cfg.data.eval_docs if len(named) > cfg.data.eval_docs else 0
        # by what a conversation says, not where it is: the held-out set does not move with the file's
        # folder or the order of its lines
        held = held_out([json.dumps(msgs, sort_keys=True, ensure_ascii=False) for _, msgs in convs], n_eval)
        train = [x for i, x in enumerate(named) if i not in held]
        self.source = ConversationList([e for _, e in train], cfg.seed, names=[w for w, _ in train])
        for i, st in enumerate(cfg.stages):
            self.source.check_fits(st.seq_len, f"stages.{i}.seq_len")
        self.eval_convs = [e for i, (_, e) in enumerate(named) if i in held]
        self.eval_length, self.eval_kinds, self.lengths = [], [], []
        self.n_conversations = len(train)
        self.n_train_tokens = int(sum(len(e) for _, e in train))
        if not quiet and len(named) <= cfg.data.eval_docs:
            log(f"note: data.path has {len(named)} conversations, not more than data.eval_docs = {cfg.data.eval_docs}; "
                "none is held out, so there is no evaluation")

    def describe(self) -> str:
        if self.task is not None:
            return (f"sft on the retrieval task ({self.cfg.sft.questions} questions per haystack, kinds "
                    f"{', '.join(self.cfg.sft.kinds)}; {self.n_train_files} train / {self.n_eval_files} held-out files), "
                    f"{len(self.eval_convs)} held-out examples at {', '.join(map(str, self.lengths))} tokens; "
                    f"template {self.template.name}")
        return (f"sft on {self.n_conversations} conversations ({self.n_train_tokens:,} tokens), "
                f"{len(self.eval_convs)} held out; template {self.template.name}")

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, model, device, dtype, progress: bool = False) -> dict:
        """{"loss", "tokens", "buckets", "accuracy", "turns", ...}: the masked loss over the held-out
        conversations, in buckets (one per haystack length for the task, by position otherwise), and the
        exact-match accuracy of their assistant turns (by length and by kind for the task)."""
        from tqdm import tqdm

        was = model.training
        model.eval()
        per = []  # (length key, position of the turn's first token, n tokens, loss sum, exact, kind)
        by_pos_sum, by_pos_n = {}, {}
        try:
            for ci in tqdm(range(len(self.eval_convs)), desc="eval", disable=not progress, leave=False):
                enc = self.eval_convs[ci]
                x = torch.as_tensor(enc.tokens, device=device)[None]
                y = torch.as_tensor(enc.labels, device=device)[None]
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    h = model.hidden(x)
                    pos = torch.nonzero(y[0] != -100).squeeze(1)
                    logits = model.lm_head(h[0, pos]).float()
                tl = torch.nn.functional.cross_entropy(logits, y[0, pos], reduction="none").double().cpu()
                hit = (logits.argmax(-1) == y[0, pos]).cpu()
                where = {int(p): j for j, p in enumerate(pos.tolist())}
                kinds = self.eval_kinds[ci] if self.eval_kinds else None
                for t, (_, s, e) in enumerate(enc.spans):
                    js = [where[p] for p in range(s - 1, e - 1)]
                    key = self.eval_length[ci] if self.eval_length else None
                    per.append((key, s, len(js), float(tl[js].sum()), bool(hit[js].all()),
                                kinds[t] if kinds is not None else None))
                if not self.eval_length:
                    for j, p in enumerate(pos.tolist()):
                        by_pos_sum[p] = by_pos_sum.get(p, 0.0) + float(tl[j])
                        by_pos_n[p] = by_pos_n.get(p, 0) + 1
        finally:
            model.clear_aux()
            model.train(was)
        n_tok = sum(p[2] for p in per)
        res = {"loss": sum(p[3] for p in per) / max(n_tok, 1), "tokens": n_tok, "turns": len(per),
               "exact_match": sum(p[4] for p in per) / max(len(per), 1)}
        if self.eval_length:
            res["buckets"], res["accuracy"], prev = [], {}, 0
            for L in self.lengths:
                rows = [p for p in per if p[0] == L]
                n = sum(p[2] for p in rows)
                res["buckets"].append({"start": prev, "end": L, "loss": sum(p[3] for p in rows) / n if n else math.nan})
                res["accuracy"][str(L)] = sum(p[4] for p in rows) / max(len(rows), 1)
                prev = L
            res["by_kind"] = {k: sum(p[4] for p in per if p[5] == k) / max(1, sum(p[5] == k for p in per))
                              for k in self.cfg.sft.kinds if any(p[5] == k for p in per)}
        else:
            res["accuracy"] = {"all": res["exact_match"]}
            res["buckets"] = _position_buckets(by_pos_sum, by_pos_n, max((len(c) for c in self.eval_convs), default=1))
        return res


def _position_buckets(sums: dict, counts: dict, length: int, n: int = 8) -> list[dict]:
    """The masked loss in n equal position ranges of [0, length), the empty ones left out."""
    edges = [round(i * length / n) for i in range(n + 1)]
    out = []
    for a, b in zip(edges[:-1], edges[1:]):
        c = sum(counts.get(p, 0) for p in range(a, b))
        if c:
            out.append({"start": a, "end": b, "loss": sum(sums.get(p, 0.0) for p in range(a, b)) / c})
    return out


def accuracy_table(before: dict | None, after: dict) -> str:
    """Exact match by haystack length (and kind) for the end of a run: before -> after, in points."""
    keys = list(after.get("accuracy", {}))
    lines = [f"{'exact match':>16} {'before':>8} {'after':>8} {'change':>8}"]
    rows = [(k, before["accuracy"].get(k) if before else None, after["accuracy"][k]) for k in keys]
    rows += [(f"kind {k}", before.get("by_kind", {}).get(k) if before else None, v)
             for k, v in after.get("by_kind", {}).items()]
    for name, b, a in rows:
        bs = f"{100 * b:7.1f}%" if b is not None else f"{'-':>8}"
        ch = f"{100 * (a - b):+7.1f}" if b is not None else f"{'':>8}"
        lines.append(f"{name:>16} {bs} {100 * a:7.1f}% {ch}")
    return "\n".join(lines)


def accuracy_plot(history: list[dict], before: dict | None, after: dict, path: str) -> None:
    """accuracy.png: exact match by haystack length, before and after (and at each evaluation between)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(after.get("accuracy", {}))
    xs = list(range(len(keys)))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    evals = [r for r in history if "accuracy" in r and r.get("eval") not in ("before", "after")]
    for r in evals:
        ax.plot(xs, [100 * r["accuracy"].get(k, math.nan) for k in keys], "-", color="gray", lw=0.6, alpha=0.6)
    if before is not None:
        ax.plot(xs, [100 * before["accuracy"].get(k, math.nan) for k in keys], "o-", label="before")
    ax.plot(xs, [100 * after["accuracy"][k] for k in keys], "o-", label="after")
    ax.set_xticks(xs, keys)
    ax.set_xlabel("haystack length (tokens)" if keys and keys[0].isdigit() else "held-out turns")
    ax.set_ylabel("exact match (%)")
    ax.set_ylim(-2, 102)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def model_inputs(batch, rows, mesh, memory_policy):
    """(x, y, cu_seqlens) for one SFT step: this rank's rows (`rows`, the trainer's sharding) flattened
    into one packed row, the conversations' boundaries for KDA and DSA."""
    if getattr(memory_policy, "forward_backward", None) is not None:
        raise ConfigError("task = sft keeps packed conversations apart, which the sequence-chunked step "
                          "(memory.seq_chunk) does not; set memory.seq_chunk = 0.")
    ids = rows(batch.doc_ids)
    x, y = rows(batch.inputs), rows(batch.labels)
    b, t = ids.shape
    starts = torch.ones(b, t, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    idx = torch.nonzero(starts.reshape(-1)).squeeze(1)
    cu = torch.cat([idx, torch.tensor([b * t])]).to(torch.int64)
    return x.reshape(1, -1), y.reshape(1, -1), cu


def check_parallel(cfg, world: int) -> None:
    if world > 1 and cfg.parallel.cp > 1:
        raise ConfigError(f"task = sft keeps packed conversations apart, which context parallelism does not yet; set "
                          f"parallel.cp = 1 (the {world} processes then split the batch's rows).")


__all__ = ["SFTData", "accuracy_plot", "accuracy_table", "check_parallel", "default_eval_lengths", "model_inputs"]
