"""longctx.measure.decode_drift on the CPU: the routing replay it relies on, and the measure itself on a
tiny model (tests/test_end_to_end_gpu.py runs it on h200-ref at 128k on the GPU)."""

from __future__ import annotations

import pytest
import torch

from longctx.config import preset
from longctx.layers.moe import MoE, RoutingTape, routing_tape
from longctx.measure.decode_drift import decode_vs_training
from longctx.model import LongCtxModel


def test_replayed_routing_repeats_the_expert_choices_across_chunks():
    """The tape as decode_vs_training uses it: recorded by one forward, then replayed by a forward over the
    same tokens in two chunks (each at its offset) it equals the recorded one; with a changed router,
    replay keeps the recorded experts (so it differs from that router's free choice); past the recorded
    tokens it refuses."""
    torch.manual_seed(0)
    model = LongCtxModel(preset("tiny")).eval()
    x = torch.randn(1, 40, model.cfg.hidden_size)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    with torch.no_grad():
        tape = RoutingTape()
        with routing_tape(tape):
            ref = moe(x)
            tape.replay = True
            parts = []
            for s0, s1 in ((0, 25), (25, 40)):
                tape.offset = s0
                parts.append(moe(x[:, s0:s1]))
        assert (torch.cat(parts, 1) - ref).abs().max() < 1e-5
        tape = RoutingTape()
        with routing_tape(tape):
            moe(x)
            tape.replay = True
            moe.router.weight.copy_(torch.randn_like(moe.router.weight))  # a different router
            forced = moe(x)
            tape.offset = 40
            with pytest.raises(RuntimeError, match="no recorded routing"):
                moe(x[:, :1])
        free = moe(x)
    assert (forced - free).abs().max() > 1e-3


def test_decode_vs_training_on_a_tiny_model():
    """The decode path (prefill in chunks through the caches, then one token at a time) against the training
    forward: in fp32 they agree to rounding, with routing replayed and free; the log-prob spread is that of
    the re-drawn head (far from uniform); the impl report is the training forward's."""
    torch.manual_seed(0)
    cfg = preset("tiny")
    model = LongCtxModel(cfg).eval()
    torch.nn.init.normal_(model.lm_head.weight, 0.0, 3.0 / cfg.hidden_size**0.5)
    ids = torch.randint(0, cfg.vocab_size, (1, 96))
    for replay in (True, False):
        diff, rel, spread, impl = decode_vs_training(model, ids, 8, 32, replay_routing=replay, bf16=False)
        assert spread > 1.0 and "kda:" in impl
        assert diff < 1e-4 and rel < 1e-4, (replay, diff, rel)
