"""Decoding through the recurrent KDA state and the cached DSA latents and pooled indexer keys.

The prompt is prefilled once; each new token then costs one step per layer (O(1) state for KDA,
O(#pools) indexer scoring and top-k attention for DSA) — nothing of the prefix is recomputed.
"""

from __future__ import annotations

import torch


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
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits = logits.clone()
            logits[..., vocab_limit:] = float("-inf")
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            # float64 with the top logit at 0: any temperature > 0 scales without overflow or a 0 divisor
            # (float32 would round 1e-320 to 0)
            lg = logits.double()
            lg = (lg - lg.amax(-1, keepdim=True)) / temperature
            if top_k:
                kth = lg.topk(min(top_k, lg.shape[-1]), dim=-1).values[..., -1:]
                lg = lg.masked_fill(lg < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(lg, -1), 1, generator=g)
        out.append(nxt)
        logits = model(nxt, caches=caches).logits[:, -1]
    return torch.cat(out, 1)


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
