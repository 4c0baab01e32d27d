"""Decoding through the recurrent KDA state and the cached DSA latents and pooled indexer keys.

The prompt is prefilled once; each new token then costs one step per layer (O(1) state for KDA,
O(#pools) indexer scoring and top-k attention for DSA) — nothing of the prefix is recomputed.

`generate` continues one prompt (the `longctx generate` command). `sample` is the batched sampler
of RL's rollouts: n completions of each prompt decoded as one batch (the prompt prefilled once, its
caches copied to the n rows), with temperature, top-k and top-p, stop tokens and stop strings, a
seed, and for every sampled token its log-probability under the model's own log-softmax at
temperature 1 — the policy's log-probability, which a policy-gradient ratio compares with the
trainer's. Rows that finish leave the batch (their cache rows are dropped), so a group whose
answers are short does not pay for its longest one on every row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float = 1.0,
                  vocab_limit: int | None = None) -> torch.Tensor:
    """[..., vocab] logits -> float64 log-weights to sample from: scaled by 1/temperature (> 0), ids at
    and above `vocab_limit` and outside the top-k / the top-p nucleus set to -inf. The nucleus is the
    smallest set of the likeliest ids whose probability (after temperature and top-k) reaches top_p;
    the likeliest id is always kept."""
    # float64 with the top logit at 0: any temperature > 0 scales without overflow or a 0 divisor
    # (float32 would round 1e-320 to 0)
    lg = logits.double()
    if vocab_limit is not None and vocab_limit < lg.shape[-1]:
        lg = lg.clone()
        lg[..., vocab_limit:] = float("-inf")
    lg = (lg - lg.amax(-1, keepdim=True)) / temperature
    if top_k:
        kth = lg.topk(min(top_k, lg.shape[-1]), dim=-1).values[..., -1:]
        lg = lg.masked_fill(lg < kth, float("-inf"))
    if top_p < 1.0:
        sorted_lg, order = lg.sort(-1, descending=True)
        probs = torch.softmax(sorted_lg, -1)
        before = probs.cumsum(-1) - probs  # the mass of the likelier ids: keep an id while that is below top_p
        drop = before >= top_p
        drop[..., 0] = False
        lg = lg.scatter(-1, order, sorted_lg.masked_fill(drop, float("-inf")))
    return lg


@torch.no_grad()
def generate(model, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
             top_k: int | None = 40, seed: int = 0, vocab_limit: int | None = None) -> torch.Tensor:
    """prompt_ids [1, T] -> [1, T + max_new_tokens]. temperature 0 = greedy; top_k 0 or None = no cut.
    vocab_limit: only ids below it are drawn (the tokenizer's count, when the model has more ids than
    the tokenizer can decode: the byte tokenizer's 256 on an h200-ref model's 32768)."""
    model.eval()
    g = torch.Generator(device=prompt_ids.device).manual_seed(seed)
    caches = model.init_caches(prompt_ids.shape[0], device=prompt_ids.device)
    # the head over the prompt's last position only: [T, vocab] logits of a long prompt are GiBs (128k x 32k
    # in bf16: 8 GiB) of which sampling reads one row
    logits = model.lm_head(model.hidden(prompt_ids, caches=caches)[:, -1])
    out = [prompt_ids]
    for _ in range(max_new_tokens):
        out.append(_draw(logits, temperature, top_k, 1.0, vocab_limit, g))
        logits = model(out[-1], caches=caches).logits[:, -1]
    return torch.cat(out, 1)


def _draw(logits, temperature, top_k, top_p, vocab_limit, g) -> torch.Tensor:
    """One id per row [rows, 1]: the argmax at temperature 0, else a draw from the filtered weights."""
    if temperature <= 0:
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits = logits[..., :vocab_limit]
        return logits.argmax(-1, keepdim=True)
    lg = filter_logits(logits, temperature, top_k, top_p, vocab_limit)
    return torch.multinomial(torch.softmax(lg, -1), 1, generator=g)


# ---------------------------------------------------------------------- batched sampling
@dataclass
class Completion:
    tokens: list[int]      # what was sampled, the stop token or the token that completed a stop string included
    logprobs: list[float]  # log p(token) under the model's log-softmax at temperature 1, one per token
    finish: str            # "stop" (a stop id), "stop_string" or "length" (max_new_tokens reached)
    text: str | None       # decode(tokens) without a stop id, cut before a stop string; None without `decode`
    routing: "Routing | None" = None  # the MoE layers' expert choices (sample(record_routing=True))


@dataclass
class Routing:
    """The expert choices the sampler made for one completion, per MoE layer in model order: the prompt's
    ([P, k], shared by the prompt's completions) and the completion's ([n, k]). The last completion token
    was never run through the model (sampling stops after drawing it); its row holds experts 0..k-1, which
    no log-prob of the completion depends on (the model is causal)."""

    prompt: list[torch.Tensor]
    tokens: list[torch.Tensor]

    def full(self, layer: int) -> torch.Tensor:
        """[P + n, k] expert indices of every position of prompt + completion, for MoE layer `layer`."""
        return torch.cat([self.prompt[layer], self.tokens[layer]])


def _batch_map(obj, fn):
    """Apply fn to every tensor of a decoding cache (each is batch-first: the KDA state's conv and
    recurrent tensors, the DSA latent rows, the indexer's pooled keys and raw rows), in place. The
    caches are plain objects of the layers (KDAState, DSACache, GrowBuffer, IndexerCache); walking
    their fields keeps this file free of a per-class list that a new cache field would silently miss."""
    if isinstance(obj, (list, tuple)):
        for x in obj:
            _batch_map(x, fn)
        return
    names = getattr(type(obj), "__slots__", None) or list(vars(obj))
    for name in names:
        v = getattr(obj, name, None)
        if isinstance(v, torch.Tensor):
            setattr(obj, name, fn(v))
        elif type(v).__module__.startswith("longctx."):
            _batch_map(v, fn)


def _rows(caches, index: torch.Tensor) -> None:
    """Keep the cache rows `index` (in that order): copies a prompt's row n times, or drops finished rows."""
    _batch_map(caches, lambda t: t.index_select(0, index))


@torch.no_grad()
def sample(model, prompts: Sequence, n: int = 1, max_new_tokens: int = 64, temperature: float = 1.0,
           top_p: float = 1.0, top_k: int | None = None, stop_ids: Sequence[int] = (),
           stop_strings: Sequence[str] = (), decode: Callable[[list[int]], str] | None = None,
           seed: int = 0, vocab_limit: int | None = None, cache_dtype: torch.dtype | None = None,
           record_routing: bool = False) -> list[list[Completion]]:
    """n completions of each prompt (1-D token ids), decoded as one batch per prompt through the caches.

    temperature 0 is greedy (every row the same). A completion ends at a stop id (kept as its last
    token: the policy chose to stop), when `decode` of its tokens contains a stop string (tokens up to
    the one that completed it are kept; `text` is cut before it), or after max_new_tokens. The draws
    come from one generator seeded with `seed`, prompt after prompt, so a call is reproducible.
    Returns one list of n Completions per prompt. The model runs in eval mode (and is left in the mode
    it was in), under the caller's autocast when there is one (`cache_dtype` is then its dtype).
    record_routing: each Completion also gets the MoE layers' expert choices of its prompt and tokens
    (`Routing`), for a training forward to replay (rl.replay_routing)."""
    if stop_strings and decode is None:
        raise ValueError("stop strings need a decode function to read the completions")
    was = model.training
    model.eval()
    try:
        return _sample(model, prompts, n, max_new_tokens, temperature, top_p, top_k, stop_ids, stop_strings, decode,
                       seed, vocab_limit, cache_dtype, record_routing)
    finally:
        model.train(was)


def _sample(model, prompts, n, max_new_tokens, temperature, top_p, top_k, stop_ids, stop_strings, decode, seed,
            vocab_limit, cache_dtype, record_routing=False) -> list[list[Completion]]:
    from .layers.moe import MoE, RoutingTape, routing_tape

    dev = model.embed.weight.device
    moes = [m for m in model.modules() if isinstance(m, MoE)] if record_routing else []
    g = torch.Generator(device=dev).manual_seed(int(seed))
    stops = set(int(s) for s in stop_ids)
    # enough trailing tokens to hold any stop string (a token decodes to at least one byte, mostly)
    tail = max((len(s.encode("utf-8")) for s in stop_strings), default=0) + 2
    out = []
    for prompt in prompts:
        ids = torch.as_tensor(prompt, dtype=torch.long, device=dev).reshape(1, -1)
        caches = model.init_caches(1, device=dev, dtype=cache_dtype)
        tape = RoutingTape() if moes else None  # records each forward's choices at tape.offset
        steps_rows: list[list[int]] = []  # the completions of each decode step's batch rows
        with routing_tape(tape):
            logits = model.lm_head(model.hidden(ids, caches=caches)[:, -1]).float()
        live = torch.zeros(n, dtype=torch.long, device=dev)  # each live row's prompt row (all 0): the copies
        _rows(caches, live)
        logits = logits.expand(n, -1)
        rows = list(range(n))  # the completion each live cache row belongs to
        toks: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        cut: list[int | None] = [None] * n  # where a stop string begins in the text
        for t in range(max_new_tokens):
            nxt = _draw(logits, temperature, top_k, top_p, vocab_limit, g)
            lp = torch.log_softmax(logits.float(), -1).gather(-1, nxt).squeeze(-1)
            keep = []
            for j, (r, tok, p) in enumerate(zip(rows, nxt.squeeze(-1).tolist(), lp.tolist())):
                toks[r].append(tok)
                lps[r].append(p)
                if tok in stops:
                    finish[r] = "stop"
                elif stop_strings:
                    at = _stop_at(decode, toks[r], stop_strings, tail)
                    if at is not None:
                        finish[r], cut[r] = "stop_string", at
                if finish[r] is None and t == max_new_tokens - 1:
                    finish[r] = "length"
                if finish[r] is None:
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(rows):
                index = torch.as_tensor(keep, device=dev)
                _rows(caches, index)
                nxt = nxt.index_select(0, index)
                rows = [rows[j] for j in keep]
            if tape is not None:
                tape.offset = ids.shape[1] + t
                steps_rows.append(list(rows))
            with routing_tape(tape):
                logits = model(nxt, caches=caches).logits[:, -1].float()
        routing = _routing(tape, moes, steps_rows, [len(x) for x in toks]) if tape is not None else [None] * n
        group = []
        for r in range(n):
            text = None
            if decode is not None:
                body = toks[r][:-1] if finish[r] == "stop" else toks[r]
                text = decode(body)
                if cut[r] is not None:
                    text = text[:cut[r]]
            group.append(Completion(toks[r], lps[r], finish[r] or "length", text, routing[r]))
        out.append(group)
    return out


def _routing(tape, moes, steps_rows: list[list[int]], lengths: list[int]) -> list[Routing]:
    """Each completion's `Routing` from the tape of one prompt: the prefill's [1, P, k] recording, then one
    [rows, 1, k] recording per decode step whose rows are the completions `steps_rows[step]`."""
    for m in moes:
        if len(tape.recorded(m)) != 1 + len(steps_rows):
            raise RuntimeError(f"sample(record_routing=True): an MoE layer recorded {len(tape.recorded(m))} forwards "
                               f"for a prefill and {len(steps_rows)} decode steps")
    prompt = [tape.recorded(m)[0][1][0] for m in moes]
    per = [[[] for _ in moes] for _ in lengths]  # completion -> layer -> [1, k] rows, step by step
    for li, m in enumerate(moes):
        for (_, idx), rows in zip(tape.recorded(m)[1:], steps_rows):
            for j, r in enumerate(rows):
                per[r][li].append(idx[j])
    out = []
    for r, n in enumerate(lengths):
        toks = []
        for li, p in enumerate(prompt):
            last = torch.arange(p.shape[-1], dtype=p.dtype, device=p.device)[None]  # never run: any k experts
            toks.append(torch.cat([*per[r][li], last])[:n] if n else p[:0])
        out.append(Routing(prompt, toks))
    return out


def _stop_at(decode, tokens: list[int], stop_strings: Sequence[str], tail: int) -> int | None:
    """Where the first stop string begins in decode(tokens), when one ends in the newest tokens."""
    recent = decode(tokens[-tail:])
    if not any(s in recent for s in stop_strings):
        return None
    text = decode(tokens)
    return min(i for s in stop_strings if (i := text.find(s)) >= 0)


@torch.no_grad()
def decode_logprobs(model, ids: torch.Tensor, prefill: int = 1) -> torch.Tensor:
    """Log-probabilities of ids[:, 1:] computed through the decode path: prefill `prefill` tokens,
    then one token at a time. Compare with the training forward's to prove they agree."""
    model.eval()
    caches = model.init_caches(ids.shape[0], device=ids.device)
    logits = [model(ids[:, :prefill], caches=caches).logits]
    for t in range(prefill, ids.shape[1] - 1):
        logits.append(model(ids[:, t : t + 1], caches=caches).logits)
    lp = torch.log_softmax(torch.cat(logits, 1).float(), -1)
    return lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
