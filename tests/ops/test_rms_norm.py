"""The fused RMSNorm kernels (longctx/ops/rms_norm/triton.py) against their plain-torch twin
`naive.RMSNormFn` under the Triton interpreter on the CPU: output, input and weight gradients, in
fp32 (to fp32 summation order) and bf16 (to one rounding step), rows that are not a power of two wide,
one row, no rows. The GPU test is tests/ops/test_rms_norm_gpu.py. Run as a script under TRITON_INTERPRET=1 it
prints a RESULT line per case (tests/triton_interpreter.py)."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("triton")

CASES = [  # name, shape, x dtype, weight dtype
    ("fp32_d96", (2, 7, 96), "float32", "float32"),
    ("bf16_d1536", (5, 1536), "bfloat16", "float32"),  # h200-ref's width
    ("bf16_d100_fp32_weight", (3, 5, 100), "bfloat16", "float32"),
    ("bf16_d64_bf16_weight", (4, 64), "bfloat16", "bfloat16"),
    ("fp32_one_row_d1", (1, 1), "float32", "float32"),
    ("bf16_no_rows", (0, 32), "bfloat16", "float32"),
]


def compare(name, shape, xd, wd, seed=0):
    """{name, what: rel-RMS} of the kernels against `RMSNormFn` on the same inputs."""
    from longctx.ops.rms_norm.naive import RMSNormFn
    from longctx.ops.rms_norm.triton import rms_norm_triton

    g = torch.Generator().manual_seed(seed)
    x0 = (torch.randn(*shape, generator=g) * 3).to(getattr(torch, xd))
    w0 = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(getattr(torch, wd))
    dy = torch.randn(*shape, generator=g).to(x0.dtype)
    out = {}
    for tag, fn in (("ref", lambda x, w: RMSNormFn.apply(x, w, 1e-6)), ("tri", lambda x, w: rms_norm_triton(x, w, 1e-6))):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        y = fn(x, w)
        y.backward(dy)
        out[tag] = (y.detach(), x.grad, w.grad)
    res = {}
    for what, a, b in zip(("y", "dx", "dw"), out["tri"], out["ref"]):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, what, a.dtype, b.dtype, a.shape, b.shape)
        den = b.double().norm().clamp_min(1e-30)
        res[what] = ((a.double() - b.double()).norm() / den).item() if b.numel() else 0.0
    return res


def test_kernels_match_the_torch_twin_under_the_interpreter():
    from triton_interpreter import run_interpreted

    got = run_interpreted("tests/ops/test_rms_norm.py", timeout=300)
    assert len(got) == len(CASES)
    for name, shape, xd, _ in CASES:
        r = got[name]
        # fp32: summation order only; bf16: bit for bit here (the kernels round to nearest even on the bits),
        # but an element may round the other way where rstd differs in its last bit: a bf16 step for a few
        tol = 1e-6 if xd == "float32" else 1e-3
        assert all(v <= tol for v in (r["y"], r["dx"], r["dw"])), (name, r)


def test_unsupported_inputs_are_refused_with_the_setting(monkeypatch):
    """What the kernels do not take: `rejects` says why, kernels.rms_norm 'triton' turns it into a ConfigError
    naming the setting, a direct call into a ValueError (CPU tensors outside the interpreter, rows wider
    than a program holds, fp64)."""
    from longctx.errors import ConfigError
    from longctx.ops import rms_norm
    from longctx.ops.rms_norm.triton import MAX_WIDTH, rejects, rms_norm_triton

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w = torch.zeros(2, 4), torch.ones(4)
    assert "CUDA" in rejects(x, w)
    with pytest.raises(ConfigError, match="kernels.rms_norm = 'triton' cannot run here .*CUDA"):
        rms_norm.pick("triton", x, w)
    with pytest.raises(ValueError, match="rms_norm_triton: .*CUDA"):
        rms_norm_triton(x, w, 1e-6)
    import longctx.ops.rms_norm.triton as mod

    monkeypatch.setattr(mod, "interpreting", lambda: True)
    assert f"rows of 1..{MAX_WIDTH}" in rejects(torch.zeros(2, MAX_WIDTH + 1), torch.ones(MAX_WIDTH + 1))
    assert "bf16, fp16 or fp32" in rejects(torch.zeros(2, 4, dtype=torch.float64), torch.ones(4))
    assert rejects(torch.zeros(2, 4, dtype=torch.bfloat16), torch.ones(4)) is None


if __name__ == "__main__":
    import json

    for name, shape, xd, wd in CASES:
        print("RESULT " + json.dumps({"name": name, **compare(name, shape, xd, wd)}))
    sys.stdout.flush()
