"""The fused clamped-SwiGLU kernels (longctx/ops/swiglu/triton.py) against their plain-torch twins
`naive.ClampedSwiGLU` and `naive.ClampedSwiGLUPacked` under the Triton interpreter on the CPU: output and
both gradients, fp32 and bf16, widths that are not a multiple of the kernel's block, inputs on both sides
of the clamp (and exactly on it), the packed [gate | up] layout, no rows. The GPU test is
tests/ops/test_swiglu_gpu.py. Run as a script under TRITON_INTERPRET=1 it prints a RESULT line per case
(tests/triton_interpreter.py)."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("triton")

LIMIT = 7.0
CASES = [  # name, rows shape, width, dtype, packed
    ("fp32_w96", (2, 7), 96, "float32", False),
    ("bf16_w768_packed", (37,), 768, "bfloat16", True),  # h200-ref's experts
    ("bf16_w1100", (3, 5), 1100, "bfloat16", False),  # two column blocks, the second partial
    ("fp32_w33_packed", (4,), 33, "float32", True),
    ("bf16_no_rows", (0,), 64, "bfloat16", True),
]


def inputs(rows, width, dtype, packed, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.tensor(rows).prod()) if rows else 1
    gate = torch.randn(n, width, generator=g) * 5  # a good share beyond +-LIMIT
    up = torch.randn(n, width, generator=g) * 5
    gate.view(-1)[: min(8, gate.numel())] = LIMIT  # exactly on the clamp: the gradient passes
    up.view(-1)[: min(8, up.numel())] = -LIMIT
    dy = torch.randn(n, width, generator=g)
    dt = getattr(torch, dtype)
    gate, up, dy = (t.view(*rows, width).to(dt) for t in (gate, up, dy))
    return (torch.cat([gate, up], -1) if packed else (gate, up)), dy


def compare(name, rows, width, dtype, packed):
    """{name, what: rel-RMS, what_max: max abs} of the kernels against the torch Functions."""
    from longctx.ops.swiglu.naive import ClampedSwiGLU, ClampedSwiGLUPacked
    from longctx.ops.swiglu.triton import clamped_swiglu_packed_triton, clamped_swiglu_triton

    x0, dy = inputs(rows, width, dtype, packed)
    out = {}
    if packed:
        fns = (("ref", lambda h: ClampedSwiGLUPacked.apply(h, LIMIT)), ("tri", lambda h: clamped_swiglu_packed_triton(h, LIMIT)))
        for tag, fn in fns:
            h = x0.clone().requires_grad_(True)
            y = fn(h)
            y.backward(dy)
            out[tag] = (y.detach(), h.grad)
        whats = ("y", "dh")
    else:
        fns = (("ref", lambda a, b: ClampedSwiGLU.apply(a, b, LIMIT)), ("tri", lambda a, b: clamped_swiglu_triton(a, b, LIMIT)))
        for tag, fn in fns:
            a, b = (t.clone().requires_grad_(True) for t in x0)
            y = fn(a, b)
            y.backward(dy)
            out[tag] = (y.detach(), a.grad, b.grad)
        whats = ("y", "dgate", "dup")
    res = {}
    for what, a, b in zip(whats, out["tri"], out["ref"]):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, what, a.dtype, b.dtype, a.shape, b.shape)
        den = b.double().norm().clamp_min(1e-30)
        res[what] = ((a.double() - b.double()).norm() / den).item() if b.numel() else 0.0
        res[what + "_differ"] = int((a != b).sum())
    return res


def test_kernels_match_the_torch_twin_under_the_interpreter():
    from triton_interpreter import run_interpreted

    got = run_interpreted("tests/ops/test_swiglu.py", timeout=300)
    assert len(got) == len(CASES)
    for name, _, _, dt, packed in CASES:
        r = got[name]
        # fp32: the SiLU's exp is numpy's here and torch's there (last-bit differences); bf16: every
        # intermediate rounded where torch rounds it, so an element differs only where the fp32 SiLU's
        # last bit tips a rounding: one bf16 step in a few elements
        tol = 1e-6 if dt == "float32" else 2e-3
        whats = ("y", "dh") if packed else ("y", "dgate", "dup")
        assert all(r[w] <= tol for w in whats), (name, r)


def test_unsupported_inputs_are_refused_with_the_setting(monkeypatch):
    """What the kernels do not take: `rejects` says why, kernels.swiglu 'triton' turns it into a ConfigError
    naming the setting, a direct call into a ValueError."""
    from longctx.errors import ConfigError
    from longctx.ops import swiglu
    from longctx.ops.swiglu.triton import clamped_swiglu_packed_triton, rejects

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h = torch.zeros(2, 4)
    assert "CUDA" in rejects(h)
    with pytest.raises(ConfigError, match="kernels.swiglu = 'triton' cannot run here .*CUDA"):
        swiglu.pick("triton", h)
    with pytest.raises(ValueError, match="clamped_swiglu_triton: .*CUDA"):
        clamped_swiglu_packed_triton(h, LIMIT)
    import longctx.ops.swiglu.triton as mod

    monkeypatch.setattr(mod, "interpreting", lambda: True)
    assert "one dtype" in rejects(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(2, 4))
    assert "bf16, fp16 or fp32" in rejects(torch.zeros(2, 4, dtype=torch.float64))
    assert rejects(torch.zeros(2, 4, dtype=torch.bfloat16)) is None


def test_the_setting_reaches_every_swiglu_and_the_step_log(monkeypatch):
    """kernels.swiglu through the model: every DenseMLP and Experts takes it, the step log names what ran
    (torch on the CPU under auto, no triton import needed), and triton on CPU tensors is one ConfigError
    naming the setting, from apply_kernels before a step or from the layer."""
    from longctx.config import preset
    from longctx.config.kernels import KernelConfig
    from longctx.errors import ConfigError
    from longctx.kernels import apply_kernels, plain_torch
    from longctx.layers.mlp import DenseMLP
    from longctx.layers.moe import Experts
    from longctx.model import LongCtxModel

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    m = LongCtxModel(preset("tiny"))
    ids = torch.randint(0, 97, (1, 17))
    m(ids, labels=ids).loss.backward()
    mods = [x for x in m.modules() if isinstance(x, (DenseMLP, Experts))]
    assert mods and all(x.kernels["swiglu"] == "auto" and x.last_impl == "swiglu:torch" for x in mods)
    assert "swiglu:torch" in m.impl_report()
    with pytest.raises(ConfigError, match="kernels.swiglu = 'triton' cannot run here"):
        apply_kernels(m, KernelConfig(swiglu="triton"))
    for x in mods:
        x.kernels["swiglu"] = "triton"
    with pytest.raises(ConfigError, match="kernels.swiglu = 'triton' cannot run here"):
        m(ids, labels=ids)
    with pytest.raises(ConfigError, match="kernels.swiglu must be one of auto, torch, triton"):
        apply_kernels(m, KernelConfig(swiglu="fused"))
    with plain_torch(m):
        assert all(x.kernels["swiglu"] == "torch" for x in mods)
    assert all(x.kernels["swiglu"] == "triton" for x in mods)


if __name__ == "__main__":
    import json

    for case in CASES:
        print("RESULT " + json.dumps({"name": case[0], **compare(*case)}))
    sys.stdout.flush()
