"""Held-out evaluation: mean loss and loss by position bucket.

Windows start at document starts, so position p has exactly p tokens of same-document context.
Local learning lowers every bucket about equally; a larger drop at late positions can only come
from using the long context. `format_table` prints the buckets for `longctx train` (before -> after)
and `longctx eval` (one checkpoint) alike.
"""

from __future__ import annotations

import torch
from tqdm import tqdm


@torch.no_grad()
def per_position_loss(model, windows: torch.Tensor, n_buckets: int = 8, batch_size: int = 1, device=None,
                      progress: bool = False, token_losses=None) -> dict:
    """windows: int64 [N, L+1]. Returns {"loss", "tokens", "buckets": [{"start", "end", "loss"}]}.
    token_losses(model, x, y) -> [B, L]: how to get them (default: one forward of the whole window;
    the trainer passes the sequence-chunked forward for lengths it trains in chunks)."""
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    N, L1 = windows.shape
    L = L1 - 1
    if N == 0 or L < 1 or not 1 <= n_buckets <= L:  # a loss over nothing would read as a real 0.0 or NaN
        raise ValueError(f"per_position_loss needs >= 1 window of >= 2 tokens and 1 <= n_buckets <= {L} "
                         f"(got {N} windows of {L1} tokens, n_buckets {n_buckets})")
    sums = torch.zeros(L, dtype=torch.float64)
    counts = torch.zeros(L, dtype=torch.float64)
    it = range(0, N, batch_size)
    for s in tqdm(it, desc="eval", disable=not progress, leave=False):
        w = windows[s : s + batch_size].to(device)
        if token_losses is None:
            tl = model(w[:, :-1], labels=w[:, 1:], return_logits=False, token_losses=True).token_losses
        else:
            tl = token_losses(model, w[:, :-1], w[:, 1:])
        mask = (w[:, 1:] != -100).double().cpu()
        sums += (tl.double().cpu() * mask).sum(0)
        counts += mask.sum(0)
    model.clear_aux()
    model.train(was_training)
    edges = [round(i * L / n_buckets) for i in range(n_buckets + 1)]
    buckets = []
    for a, b in zip(edges[:-1], edges[1:]):
        c = counts[a:b].sum().item()
        buckets.append({"start": a, "end": b, "loss": (sums[a:b].sum().item() / c) if c else float("nan")})
    total = counts.sum().item()
    return {"loss": sums.sum().item() / max(total, 1), "tokens": int(total), "buckets": buckets}


def format_table(before: dict, after: dict | None = None) -> str:
    """The loss of each position bucket and overall: one column for one evaluation (`longctx eval`),
    before, after and the change in % for two (the end of `longctx train`)."""
    if after is None:
        lines = [f"{'positions':>16} {'loss':>8}"]
        lines += [f"{b['start']:>7}-{b['end']:<8} {b['loss']:8.4f}" for b in before["buckets"]]
        lines.append(f"{'all':>16} {before['loss']:8.4f}")
        return "\n".join(lines)
    lines = [f"{'positions':>16} {'before':>8} {'after':>8} {'change':>8}"]
    for b0, b1 in zip(before["buckets"], after["buckets"]):
        ch = (b1["loss"] - b0["loss"]) / b0["loss"] * 100 if b0["loss"] else float("nan")
        lines.append(f"{b0['start']:>7}-{b0['end']:<8} {b0['loss']:8.4f} {b1['loss']:8.4f} {ch:7.1f}%")
    ch = (after["loss"] - before["loss"]) / before["loss"] * 100 if before["loss"] else float("nan")
    lines.append(f"{'all':>16} {before['loss']:8.4f} {after['loss']:8.4f} {ch:7.1f}%")
    return "\n".join(lines)
