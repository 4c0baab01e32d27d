"""KDA on the CPU: the chunkwise form against the token recurrence (fp64, values and gradients),
packed documents, the layer against HF's GLM-5.3-Flash linear attention, and decoding."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from longctx.config import preset
from longctx.errors import ConfigError
from longctx.layers.kda import KimiDeltaAttention
from longctx.ops.kda import kda_chunk, kda_recurrent, l2norm

F64 = torch.float64


def _inputs(B, T, H, K, V, *, gmin=-5.0, strong=True, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)
    u = lambda *s: torch.rand(*s, generator=gen, dtype=dtype)
    q, k = l2norm(r(B, T, H, K)), l2norm(r(B, T, H, K))
    # strong decays: most channels near the -5 bound, a few near 0 so the state still carries something
    g = gmin + 0.3 * u(B, T, H, K) if strong else gmin * u(B, T, H, K)
    g = torch.where(u(B, T, H, K) < 0.25, -0.05 * u(B, T, H, K), g)
    return q, k, r(B, T, H, V), g, u(B, T, H), r(B, H, K, V)


def _grads(fn, leaves, seed=1):
    """Values of fn(*leaves) = (o, S) and the gradients of a random functional of both."""
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    o, S = fn(*leaves)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() + (S * torch.randn(S.shape, generator=gen, dtype=S.dtype)).sum()
    return [o.detach(), S.detach()] + list(torch.autograd.grad(loss, leaves))


@pytest.mark.parametrize("T", [1, 17, 64, 100])
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunk_equals_recurrence_fp64(T, chunk):
    q, k, v, g, beta, h0 = _inputs(2, T, 2, 8, 6, seed=T)
    scale = 8 ** -0.5
    ref = _grads(lambda *a: kda_recurrent(*a[:5], scale, a[5], True), [q, k, v, g, beta, h0])
    got = _grads(lambda *a: kda_chunk(*a[:5], scale, a[5], True, chunk_size=chunk), [q, k, v, g, beta, h0])
    names = ["o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    for name, a, b in zip(names, got, ref):
        assert a.dtype == F64
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")


def test_chunk_odd_chunk_size_and_no_state():
    q, k, v, g, beta, _ = _inputs(1, 50, 3, 4, 5, strong=False, seed=3)
    o_ref, _ = kda_recurrent(q, k, v, g, beta, 0.7)
    o, s = kda_chunk(q, k, v, g, beta, 0.7, chunk_size=24)
    assert s is None
    torch.testing.assert_close(o, o_ref, rtol=1e-9, atol=1e-10)


def test_chunk_fp32_unbounded_decay_stays_finite():
    """Softplus-gate decays far below -5 per step: the block split keeps every exponent <= 0."""
    q, k, v, g, beta, h0 = _inputs(1, 200, 2, 16, 16, gmin=-80.0, seed=5)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, 0.25, h0, True)
    o, s = kda_chunk(*(x.float() for x in (q, k, v, g, beta)), 0.25, h0.float(), True, chunk_size=64)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert ((o.double() - o_ref).norm() / o_ref.norm()) < 1e-5
    assert ((s.double() - s_ref).norm() / s_ref.norm()) < 1e-5


def test_cu_seqlens_equals_separate_documents():
    lens = [5, 0, 40, 23, 1, 16]
    T = sum(lens)
    q, k, v, g, beta, _ = _inputs(1, T, 2, 8, 6, seed=11)
    h0 = torch.randn(len(lens), 2, 8, 6, dtype=F64)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    o, S = kda_chunk(q, k, v, g, beta, 0.5, h0, True, chunk_size=16, cu_seqlens=cu)
    assert S.shape == (len(lens), 2, 8, 6)
    for d in range(len(lens)):
        a, b = int(cu[d]), int(cu[d + 1])
        o_d, s_d = kda_recurrent(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], 0.5, h0[d : d + 1], True)
        torch.testing.assert_close(o[:, a:b], o_d, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(S[d : d + 1], s_d, rtol=1e-9, atol=1e-10)
    # gradients reach every token, and through the packing to the right places
    lv = v.detach().clone().requires_grad_()
    kda_chunk(q, k, lv, g, beta, 0.5, chunk_size=16, cu_seqlens=cu)[0][:, 45:].sum().backward()
    assert lv.grad[:, :45].abs().max() == 0 and lv.grad[:, 45:68].abs().min() > 0
    with pytest.raises(ValueError, match="B == 1"):
        kda_chunk(*(torch.cat([x, x]) for x in (q, k, v, g, beta)), 0.5, cu_seqlens=cu)


# ------------------------------------------------------------------------------ the layer
def _cfg(lower_bound=-5.0):
    return preset("tiny").replace(kda_gate_lower_bound=lower_bound)


def _randomize(layer: torch.nn.Module, seed: int):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("A_log"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def _hf_twin(ours: KimiDeltaAttention, lower_bound):
    cfgmod = pytest.importorskip("transformers.models.glm5_next.configuration_glm5_next")
    from transformers.models.glm5_next.modeling_glm5_next import (
        Glm5NextTextLinearAttention,
    )

    hcfg = cfgmod.Glm5NextTextConfig(
        hidden_size=ours.hidden_size, num_hidden_layers=4, linear_num_heads=ours.num_heads,
        linear_head_dim=ours.head_dim, linear_conv_kernel_dim=ours.conv_size, linear_lower_bound=lower_bound,
        rms_norm_eps=ours.o_norm.eps,
    )
    hf = Glm5NextTextLinearAttention(hcfg, 0).float()
    sd = ours.state_dict()
    theirs = {}
    for key in hf.state_dict():
        if key == "conv1d.weight":
            theirs[key] = torch.cat([sd["q_conv.weight"], sd["k_conv.weight"], sd["v_conv.weight"]])
        else:
            theirs[key] = sd[key.removeprefix("forget_gate.")]
    hf.load_state_dict(theirs, strict=True)
    return hf


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_layer_matches_hf(lower_bound):
    ours = KimiDeltaAttention(_cfg(lower_bound), 0)
    _randomize(ours, seed=7)
    hf = _hf_twin(ours, lower_bound)
    x = torch.randn(2, 37, ours.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y, y_ref = ours(x), hf(x)
    assert ours.last_impl == "kda:torch-chunk"
    assert y_ref.abs().mean() > 0.05  # a non-trivial output
    assert (y - y_ref).abs().max() <= 1e-5


def test_decoding_equals_full_forward():
    ours = KimiDeltaAttention(_cfg(), 0).double()
    _randomize(ours, seed=9)
    x = torch.randn(2, 30, ours.hidden_size, dtype=F64)
    with torch.no_grad():
        full = ours(x)
        st = ours.init_state(2, x.device, x.dtype)
        assert st.conv.shape == (2, 3 * 16, 3) and st.recurrent.shape == (2, 2, 8, 8)
        parts = [ours(x[:, :13], st)]  # multi-token prefill
        for t in range(13, 20):  # one-token steps
            parts.append(ours(x[:, t : t + 1], st))
            assert ours.last_impl == "kda:torch-step"
        parts.append(ours(x[:, 20:22], st))  # a short continuation (shorter than the conv window)
        parts.append(ours(x[:, 22:], st))
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-11)


def test_layer_packed_documents_equal_separate_runs():
    """cu_seqlens resets both the conv window and the recurrent state at each document."""
    ours = KimiDeltaAttention(_cfg(), 0).double()
    _randomize(ours, seed=4)
    lens = [7, 2, 25, 1, 9]
    x = torch.randn(1, sum(lens), ours.hidden_size, dtype=F64)
    cu = torch.tensor([0] + lens).cumsum(0)
    with torch.no_grad():
        packed = ours(x, cu_seqlens=cu)
        separate = torch.cat([ours(x[:, a:b]) for a, b in itertools.pairwise(cu.tolist())], 1)
    torch.testing.assert_close(packed, separate, rtol=1e-10, atol=1e-11)


def test_layer_backward_and_backend_choice():
    ours = KimiDeltaAttention(_cfg(), 0)
    names = {n for n, _ in ours.named_parameters()}
    assert names == {
        "q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv.weight", "k_conv.weight", "v_conv.weight",
        "f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log", "b_proj.weight", "g_a_proj.weight",
        "g_b_proj.weight", "o_norm.weight", "o_proj.weight",
    }
    assert ours.A_log.dtype == torch.float32 and (ours.A_log == 0).all()
    dt = torch.nn.functional.softplus(ours.dt_bias)
    assert dt.min() >= 1e-4 - 1e-9 and dt.max() <= 0.1 + 1e-6
    x = torch.randn(1, 20, ours.hidden_size, requires_grad=True)
    ours(x).square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in ours.parameters())
    assert x.grad.abs().sum() > 0
    ours.kernels["kda"] = "fla"
    with pytest.raises(ConfigError, match="kernels.kda = 'fla' cannot run here .*CUDA"):
        ours(x)
    ours.kernels["kda"] = "bogus"
    with pytest.raises(ConfigError, match="kernels.kda must be one of auto, torch, fla .got 'bogus'"):
        ours(x)


def test_twin_computes_in_fp32_under_autocast():
    """The docstring's promise under bf16 autocast (the training and decode paths of the CPU and of the
    CUDA fallback): the same result as with autocast off, not bf16 matmuls, which would round the state
    to bf16 between chunks (~1e-3 apart)."""
    from longctx.ops.kda import kda_step

    q, k, v, g, beta, S0 = (x.float() for x in _inputs(1, 100, 2, 16, 16))
    ref = kda_chunk(q, k, v, g, beta, 0.25, initial_state=S0, output_final_state=True, chunk_size=16)
    ref_step = kda_step(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], 0.25, S0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = kda_chunk(q, k, v, g, beta, 0.25, initial_state=S0, output_final_state=True, chunk_size=16)
        got_step = kda_step(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], 0.25, S0)
        got_rec = kda_recurrent(q[:, :5], k[:, :5], v[:, :5], g[:, :5], beta[:, :5], 0.25, initial_state=S0)
    assert got[1].dtype == torch.float32
    for a, b in ((got[0], ref[0]), (got[1], ref[1]), (got_step[0], ref_step[0]), (got_step[1], ref_step[1])):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()
    assert torch.allclose(got_rec[0], ref[0][:, :5], rtol=1e-4, atol=1e-4)


def test_conv_setting_rules():
    """kernels.kda_conv fla needs CUDA and fla (one sentence naming the setting and the fix), with or without
    a decoding state; an unknown value names the choices."""
    layer = KimiDeltaAttention(_cfg(), 0)
    x = torch.randn(1, 9, layer.hidden_size)
    assert layer.kernels["kda_conv"] == "auto"
    layer(x)
    assert layer.last_impl == "kda:torch-chunk"  # auto on the CPU: the torch conv, no suffix (nothing asked for was declined)
    layer.kernels["kda_conv"] = "fla"
    with pytest.raises(ConfigError, match="kernels.kda_conv = 'fla' cannot run here .*CUDA.*set kernels.kda_conv to 'auto' or 'torch'"):
        layer(x)
    with torch.no_grad(), pytest.raises(ConfigError, match="kernels.kda_conv = 'fla' cannot run here .*CUDA"):
        layer(x, layer.init_state(1))
    layer.kernels["kda_conv"] = "cuda"
    with pytest.raises(ConfigError, match="kernels.kda_conv must be one of auto, torch, fla"):
        layer(x)


def test_norm_setting_rules():
    """kernels.kda_norm fla (fla's fused gated norm) needs CUDA and fla: one sentence naming the setting and
    the fix; auto is ours on the CPU; an unknown value names the choices."""
    layer = KimiDeltaAttention(_cfg(), 0)
    x = torch.randn(1, 9, layer.hidden_size)
    assert layer.kernels["kda_norm"] == "auto"
    layer(x)
    assert layer.last_impl == "kda:torch-chunk"
    layer.kernels["kda_norm"] = "fla"
    with pytest.raises(ConfigError, match="kernels.kda_norm = 'fla' cannot run here .*CUDA.*set kernels.kda_norm to 'auto' or 'torch'"):
        layer(x)
    layer.kernels["kda_norm"] = "triton"
    with pytest.raises(ConfigError, match="kernels.kda_norm must be one of auto, torch, fla"):
        layer(x)


def test_conv_and_norm_twins_are_the_layers_maths():
    """ops.kda.causal_conv1d (with and without a window, and across packed documents) and gated_rms_norm
    are the functions the layer runs: the window continues the sequence exactly, and the gated norm of
    fp64 inputs stays in fp64."""
    from longctx.ops.kda import causal_conv1d, gated_rms_norm

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 11, 6, generator=g, dtype=F64), torch.randn(6, 4, generator=g, dtype=F64)
    full = causal_conv1d(x, w)
    y1, win = causal_conv1d(x[:, :5], w, window=torch.zeros(2, 6, 3, dtype=F64))
    y2, _ = causal_conv1d(x[:, 5:], w, window=win)
    torch.testing.assert_close(torch.cat([y1, y2], 1), full, rtol=1e-12, atol=1e-12)
    cu = torch.tensor([0, 4, 11])
    packed = causal_conv1d(x[:1], w, cu_seqlens=cu)
    torch.testing.assert_close(packed, torch.cat([causal_conv1d(x[:1, :4], w), causal_conv1d(x[:1, 4:], w)], 1))
    o, gate = torch.randn(2, 3, 8, generator=g, dtype=F64), torch.randn(2, 3, 8, generator=g, dtype=F64)
    ref = o / (o.square().mean(-1, keepdim=True) + 1e-6).sqrt() * torch.sigmoid(gate) * 2.0
    got = gated_rms_norm(o, gate, torch.full((8,), 2.0, dtype=F64), 1e-6)
    assert got.dtype == F64
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("user", [None, "0", "1"])
def test_fla_import_keeps_autotuning_choices_unless_the_user_said_otherwise(monkeypatch, user):
    """Before its first import of fla the backend sets TRITON_CACHE_AUTOTUNING=1 (fla's autotuning choices
    kept on disk across processes); a value the user set stays as it is."""
    from longctx.ops.kda import fla as fla_backend

    monkeypatch.setenv(fla_backend.AUTOTUNE_CACHE_ENV, user or "")  # so that teardown restores what was there
    if user is None:
        monkeypatch.delenv(fla_backend.AUTOTUNE_CACHE_ENV)
    fla_backend._import_error.__wrapped__()  # the uncached attempt (fla may or may not be installed here)
    assert os.environ[fla_backend.AUTOTUNE_CACHE_ENV] == (user or "1")
