"""Whole-model checks that the GPU recipe relies on, run on the CPU: bf16 autocast, parameter counts."""

from __future__ import annotations

import pytest
import torch

from longctx.config import preset
from longctx.model import LongCtxModel


@pytest.mark.parametrize("residual", ["mhc", "plain", "attnres"])
def test_bf16_autocast_step_keeps_the_stream_in_bf16(residual):
    torch.manual_seed(0)
    model = LongCtxModel(preset("tiny").replace(residual=residual))
    ids = torch.randint(0, 97, (2, 41))
    seen = []
    model.layers[1].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids[:, :-1], labels=ids[:, 1:])
    out.loss.backward()
    state = seen[0] if isinstance(seen[0], torch.Tensor) else seen[0][0][0]
    assert state.dtype == torch.bfloat16  # the residual state kept per layer is half the fp32 size
    assert torch.isfinite(out.loss)
    assert all(p.grad is not None for n, p in model.named_parameters() if "indexer" not in n)
    # fp32 where the reference keeps fp32
    moe = model.layers[1].mlp
    assert moe.router.weight.dtype == torch.float32


def test_h200_ref_parameter_counts():
    with torch.device("meta"):
        model = LongCtxModel(preset("h200-ref"))
    n = model.num_parameters()
    # the headline: about 1.5B total, 0.35B active
    assert 1.3e9 < n["total"] < 1.7e9, n
    assert 0.25e9 < n["active"] < 0.45e9, n
