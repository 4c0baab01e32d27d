"""Projections that share an input run as one matmul over their stacked weights (the KDA layer's six, the
dense MLP's gate and up): the same function as the separate Linears, and one input gradient per matmul,
so autograd has (nearly) nothing to add up."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longctx.config import preset
from longctx.layers.kda import KimiDeltaAttention
from longctx.layers.mlp import DenseMLP


def _kda(seed: int = 0) -> KimiDeltaAttention:
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(preset("tiny"), 0).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return layer


def _separate(layer: KimiDeltaAttention):
    """The layer's projections as six Linears, each reading x by itself."""

    def qkv(x, rows=None):
        ws = [p.weight if rows is None else p.weight[rows] for p in (layer.q_proj, layer.k_proj, layer.v_proj)]
        return torch.cat([F.linear(x, w) for w in ws], -1)

    def gates(x, heads=None):
        b = layer.b_proj.weight if heads is None else layer.b_proj.weight[heads]
        return layer.f_a_proj(x), F.linear(x, b), layer.g_a_proj(x)

    return qkv, gates


def _run(module, x, seed=1):
    y = module(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)
    params = [p for p in module.parameters() if p.requires_grad]
    grads = torch.autograd.grad(y, [x, *params], g)
    return y, grads


def test_kda_stacked_projections_are_the_separate_ones():
    layer = _kda()
    x = torch.randn(2, 24, layer.hidden_size, dtype=torch.float64, requires_grad=True)
    y, grads = _run(layer, x)
    layer.qkv_projection, layer.gate_projections = _separate(layer)
    y_ref, grads_ref = _run(layer, x)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_kda_head_range_projections():
    layer = _kda(2)
    x = torch.randn(3, 5, layer.hidden_size, dtype=torch.float64)
    K = layer.head_dim
    rows, heads = slice(K, 2 * K), slice(1, 2)
    qkv, gates = _separate(layer)
    torch.testing.assert_close(layer.qkv_projection(x, rows), qkv(x, rows), rtol=1e-12, atol=1e-12)
    for a, b in zip(layer.gate_projections(x, heads), gates(x, heads)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_dense_mlp_packed_equals_two_linears():
    torch.manual_seed(3)
    mlp = DenseMLP(16, 24, swiglu_limit=1.5).double()
    x = torch.randn(4, 7, 16, dtype=torch.float64, requires_grad=True)
    y, grads = _run(mlp, x)
    limit = mlp.limit

    class Two(torch.nn.Module):  # gate and up as two Linears, the clamped SwiGLU in plain torch
        def forward(self, x):
            gate, up = mlp.gate_proj(x), mlp.up_proj(x)
            return mlp.down_proj(F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit))

    two = Two()
    two.params = torch.nn.ModuleList([mlp.gate_proj, mlp.up_proj, mlp.down_proj])
    y_ref, grads_ref = _run(two, x)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _input_grad_adds(module, x) -> int:
    """Adds of tensors of x's shape while autograd runs the backward of module(x)."""
    y = module(x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.autograd.grad(y.sum(), x)
    return sum(1 for ev in prof.events() if ev.name in ("aten::add", "aten::add_") and ev.input_shapes
               and list(ev.input_shapes[0]) == list(x.shape))


def test_input_gradient_is_summed_in_the_matmuls():
    """Six Linears on x would make autograd add x's gradient five times; the two stacked products, once.
    The dense MLP's one product needs none (two Linears: one)."""
    layer = _kda()
    x = torch.randn(1, 32, layer.hidden_size, dtype=torch.float64, requires_grad=True)
    assert _input_grad_adds(layer, x) == 1
    layer.qkv_projection, layer.gate_projections = _separate(layer)
    assert _input_grad_adds(layer, x) == 5  # the count this test is for: it sees the adds
    mlp = DenseMLP(16, 24, swiglu_limit=1.5).double()
    assert _input_grad_adds(mlp, torch.randn(2, 8, 16, dtype=torch.float64, requires_grad=True)) == 0
