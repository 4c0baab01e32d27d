"""How far the decode path is from the training forward on the same tokens.

The decode path (prefill through the caches, then one token at a time: recurrent KDA state, cached DSA
latents and pooled indexer keys) computes the training forward's function with other kernels and in
another order, so the two differ by rounding, and a cache bug shows as a difference far larger than
that. `decode_vs_training` measures it over a sequence's last tokens; `tests/test_end_to_end_gpu.py`
runs it on h200-ref at 128k on the GPU and `bench/decode_drift.py` on a 4-layer cut on the CPU.

MoE routing is recorded in the training forward and replayed in the decode path (`moe.RoutingTape`, by
token position): at initialisation the router's scores are nearly tied, and the two paths' bf16
rounding flips top-k experts, which moves whole expert outputs without being a decode-path defect.
"""

from __future__ import annotations

import torch

from ..layers.moe import RoutingTape, routing_tape


def _at(tape: RoutingTape | None, offset: int) -> None:
    if tape is not None:
        tape.offset = offset


def decode_vs_training(model, ids: torch.Tensor, last: int, chunk: int, replay_routing: bool = True,
                       bf16: bool = True) -> tuple[float, float, float, str]:
    """(mean abs log-prob difference, hidden rel-RMS, log-prob std, impl report) of the `last` tokens of
    ids [1, S]: the training forward against prefill-through-the-caches in chunks of `chunk` tokens
    (tokens 0 .. S - last - 2), then one token at a time. `replay_routing` off lets each path route by
    itself; `bf16` off runs both in the model's dtype."""
    S, N, device = ids.shape[1], last, ids.device.type
    tape = RoutingTape() if replay_routing else None
    with torch.no_grad(), routing_tape(tape), torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
        h = model.hidden(ids)[:, S - N - 1 : S - 1]
        full = torch.log_softmax(model.lm_head(h).float(), -1)
        full = full.gather(-1, ids[:, S - N :, None]).squeeze(-1)
        impl = model.impl_report()
        if tape is not None:
            tape.replay = True
        caches = model.init_caches(1, device=ids.device, dtype=torch.bfloat16 if bf16 else torch.float32)
        for s0 in range(0, S - N - 1, chunk):
            _at(tape, s0)
            model(ids[:, s0 : min(s0 + chunk, S - N - 1)], caches=caches)
        dec, hs = [], []
        for t in range(S - N, S):
            _at(tape, t - 1)
            hd = model.hidden(ids[:, t - 1 : t], caches=caches)
            hs.append(hd)
            lp = torch.log_softmax(model.lm_head(hd)[:, -1].float(), -1)
            dec.append(lp.gather(-1, ids[:, t : t + 1]))
    dec, hd = torch.cat(dec, 1), torch.cat(hs, 1)
    diff = (dec - full).abs().mean().item()
    rel = ((hd.float() - h.float()).pow(2).mean() / h.float().pow(2).mean()).sqrt().item()
    return diff, rel, full.std().item(), impl
