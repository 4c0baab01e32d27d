"""fla's KDA kernels (bf16, CUDA) against the plain-torch twin (fp32 on the same bf16 values).

Checks the wrapper's contract: fla_chunk_kda(q, k, v, g_raw, beta, A_log, dt_bias, lower_bound)
== kda_chunk(l2norm(q), l2norm(k), v, kda_gate(g_raw, A_log, dt_bias, lower_bound), beta), forward
and backward (every input, the gate parameters and the initial state), by relative RMS error.
Skipped without CUDA or fla-core.
"""

from __future__ import annotations

import pytest
import torch

from longctx.ops.kda import (
    fla_available,
    fla_chunk_kda,
    fla_recurrent_kda,
    kda_chunk,
    kda_gate,
    kda_recurrent,
    l2norm,
)

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and fla_available()), reason="needs CUDA and fla-core 0.6.0"
)

OUT_TOL, GRAD_TOL = 5e-3, 2e-2  # an op against its twin
LAYER_TOL = 2e-2  # a whole layer in bf16 with one op swapped (its rounding propagates)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _inputs(B, T, H, K, n_states, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    bf = lambda x: x.to(torch.bfloat16)
    return dict(
        q=bf(r(B, T, H, K)), k=bf(r(B, T, H, K)), v=bf(r(B, T, H, K)), g_raw=bf(r(B, T, H, K)),
        beta=bf(torch.sigmoid(r(B, T, H))), A_log=0.5 * r(H), dt_bias=r(H * K), h0=r(n_states, H, K, K),
    )


def _run(x: dict, lower_bound, cu, use_fla: bool):
    leaves = {n: (t.detach().clone() if use_fla else t.detach().float()).requires_grad_() for n, t in x.items()}
    q, k, v, g_raw, beta, A_log, dt_bias, h0 = leaves.values()
    scale = q.shape[-1] ** -0.5
    if use_fla:
        o, s = fla_chunk_kda(q, k, v, g_raw, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
                             initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=64)
    else:
        g = kda_gate(g_raw, A_log, dt_bias, lower_bound)
        o, s = kda_chunk(l2norm(q), l2norm(k), v, g, beta, scale, h0, True, chunk_size=64, cu_seqlens=cu)
    gen = torch.Generator(device="cuda").manual_seed(123)
    do = torch.randn(o.shape, device="cuda", generator=gen)
    ds = torch.randn(s.shape, device="cuda", generator=gen)
    ((o.float() * do).sum() + (s.float() * ds).sum()).backward()
    return {"o": o.detach(), "final": s.detach(), **{"d" + n: t.grad for n, t in leaves.items()}}


@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("packed", [False, True])
def test_fla_chunk_matches_torch_twin(lower_bound, packed):
    H, K = 4, 128
    if packed:
        lens = [300, 1, 77, 622, 64]
        cu = torch.tensor([0] + lens, device="cuda").cumsum(0)
        x = _inputs(1, sum(lens), H, K, len(lens), seed=1)
    else:
        cu = None
        x = _inputs(2, 1000, H, K, 2, seed=2)
    got = _run(x, lower_bound, cu, use_fla=True)
    ref = _run(x, lower_bound, cu, use_fla=False)
    errs = {n: rel_rms(got[n], ref[n]) for n in ref}
    print(f"lower_bound={lower_bound} packed={packed}: " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    for n, e in errs.items():
        assert e <= (OUT_TOL if n in ("o", "final") else GRAD_TOL), (n, errs)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_fla_recurrent_matches_torch(lower_bound):
    x = _inputs(2, 9, 4, 128, 2, seed=3)
    scale = 128 ** -0.5
    with torch.no_grad():
        o, s = fla_recurrent_kda(x["q"], x["k"], x["v"], x["g_raw"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                                 lower_bound=lower_bound, scale=scale, initial_state=x["h0"], output_final_state=True)
        g = kda_gate(x["g_raw"], x["A_log"], x["dt_bias"], lower_bound)
        o_r, s_r = kda_recurrent(l2norm(x["q"]), l2norm(x["k"]), x["v"].float(), g, x["beta"].float(), scale, x["h0"], True)
    assert rel_rms(o, o_r) <= OUT_TOL and rel_rms(s, s_r) <= OUT_TOL


def test_layer_auto_picks_fla_and_matches_torch():
    """auto on CUDA runs fla's chunk kernel, conv and gated norm (the step log names all three), within the
    layer tolerance of the torch twins; decoding runs fla's recurrent kernel with the state's conv window
    through fla's conv."""
    from longctx.config import preset
    from longctx.kernels import plain_torch
    from longctx.layers.kda import KimiDeltaAttention

    cfg = preset("small")
    layer = KimiDeltaAttention(cfg, 0).cuda().to(torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() >= 2 and p.shape[-1] > 1:
                p.normal_(0, 0.05)
    x = torch.randn(2, 333, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    y = layer(x)
    assert layer.last_impl == "kda:fla-chunk+fla-conv+fla-norm"
    with plain_torch(layer):
        y_ref = layer(x)
        assert layer.last_impl == "kda:torch-chunk"
    assert rel_rms(y, y_ref) <= LAYER_TOL
    with torch.no_grad():  # decoding: prefill, then a step through fused_recurrent_kda
        st = layer.init_state(2, x.device, x.dtype)
        parts = [layer(x[:, :300], st), layer(x[:, 300:301], st)]
        assert layer.last_impl == "kda:fla-recurrent+fla-conv+fla-norm"  # the state's window through fla's conv
        parts.append(layer(x[:, 301:], st))
    assert rel_rms(torch.cat(parts, 1), y_ref) <= LAYER_TOL


@pytest.mark.parametrize("packed", [False, True])
def test_layer_fla_conv_matches_torch_conv(packed):
    """kernels.kda_conv fla (fla's causal_conv1d, SiLU fused) against the torch conv, fresh random inputs, a
    length that is no multiple of any tile: the conv alone (`_short_conv`, bf16, output and the input's
    and weights' gradients) and inside the layer under autocast (KDA through the torch twin in both runs,
    so that only the conv differs; every parameter's gradient); packed: three documents whose taps must
    not cross (cu_seqlens)."""
    from longctx.config import preset
    from longctx.layers.kda import KimiDeltaAttention

    torch.manual_seed(11 + packed)
    layer = KimiDeltaAttention(preset("small"), 0).cuda()
    layer.kernels.update(kda="torch", kda_norm="torch")
    T = 777
    B = 1 if packed else 2
    cu = torch.tensor([0, 200, 517, T], device="cuda") if packed else None
    xc = torch.randn(B, T, 3 * layer.num_heads * layer.head_dim, device="cuda", dtype=torch.bfloat16)
    convs = (layer.q_conv.weight, layer.k_conv.weight, layer.v_conv.weight)
    op = {}
    for use_fla in (False, True):
        layer.zero_grad(set_to_none=True)
        xi = xc.clone().requires_grad_(True)
        y = layer._short_conv(xi, None, cu, fla=use_fla)
        (y.float() * torch.linspace(-1, 1, y.shape[-1], device="cuda")).square().mean().backward()
        op[use_fla] = (y.detach().float(), xi.grad.float(), [w.grad.clone() for w in convs])
    assert rel_rms(op[True][0], op[False][0]) <= OUT_TOL
    assert rel_rms(op[True][1], op[False][1]) <= GRAD_TOL
    for a, b in zip(op[True][2], op[False][2]):
        assert rel_rms(a, b) <= GRAD_TOL

    x = torch.randn(B, T, layer.hidden_size, device="cuda")
    runs = {}
    for impl in ("torch", "fla"):
        layer.kernels["kda_conv"] = impl
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(xi, cu_seqlens=cu)
        y.float().pow(2).mean().backward()
        runs[impl] = (y.detach(), xi.grad, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None})
        assert layer.last_impl == ("kda:torch-chunk+fla-conv" if impl == "fla" else "kda:torch-chunk")
    # the layer: one bf16 rounding of the conv's output carried through l2norm, the delta rule, the gated
    # norm and o_proj, each rounded to bf16 again: the layer tolerance of test_layer_auto_picks (the H200
    # measured 6.3e-3 for the output here, against the op's 5e-3 above, which passed)
    (y_t, gx_t, g_t), (y_f, gx_f, g_f) = runs["torch"], runs["fla"]
    assert rel_rms(y_f, y_t) <= LAYER_TOL and rel_rms(gx_f, gx_t) <= LAYER_TOL
    for n in g_t:
        assert rel_rms(g_f[n], g_t[n]) <= LAYER_TOL, n


@pytest.mark.parametrize("T", [1, 2, 777])
def test_fla_conv_with_a_window_matches_torch_conv(T):
    """kernels.kda_conv fla with a state (decoding; the sequence-chunked step's carries): the window goes into
    fla's conv as its initial state and the new one comes back as its final state. Against the torch
    conv with the same window: the output (op tolerance), the new window (the same inputs, exactly),
    and the gradients of x, the conv weights and the old window, with a loss on the output and on
    the new window (as the chunked step's backward sends one); T shorter than the window too."""
    from longctx.config import preset
    from longctx.layers.kda import KDAState, KimiDeltaAttention

    torch.manual_seed(T)
    layer = KimiDeltaAttention(preset("small"), 0).cuda()
    C, W = 3 * layer.num_heads * layer.head_dim, layer.conv_size
    xc = torch.randn(2, T, C, device="cuda", dtype=torch.bfloat16)
    win = torch.randn(2, C, W - 1, device="cuda").bfloat16().float()  # the torch path keeps bf16 inputs in fp32
    convs = (layer.q_conv.weight, layer.k_conv.weight, layer.v_conv.weight)
    wy = torch.linspace(-1, 1, C, device="cuda")
    ww = torch.randn(2, C, W - 1, device="cuda")
    runs = {}
    for use_fla in (False, True):
        layer.zero_grad(set_to_none=True)
        xi, w0 = xc.clone().requires_grad_(True), win.clone().requires_grad_(True)
        st = KDAState(conv=w0, recurrent=torch.zeros(1, device="cuda"))
        y = layer._short_conv(xi, st, None, fla=use_fla)
        ((y.float() * wy).square().mean() + (st.conv.float() * ww).sum() * 1e-3).backward()
        runs[use_fla] = (y.detach().float(), st.conv.detach().float(), xi.grad.float(), w0.grad.float(),
                         [p.grad.clone() for p in convs])
    (y_t, n_t, gx_t, gw0_t, gp_t), (y_f, n_f, gx_f, gw0_f, gp_f) = runs[False], runs[True]
    assert rel_rms(y_f, y_t) <= OUT_TOL
    assert torch.equal(n_f, n_t)
    assert rel_rms(gx_f, gx_t) <= GRAD_TOL and rel_rms(gw0_f, gw0_t) <= GRAD_TOL
    for a, b in zip(gp_f, gp_t):
        assert rel_rms(a, b) <= GRAD_TOL


@pytest.mark.parametrize("T", [1, 777])
def test_fla_gated_norm_matches_ours_and_keeps_less(T):
    """kernels.kda_norm fla (fla's fused gated RMSNorm, sigmoid gate) against layers.norms.GatedRMSNorm on the
    same bf16 inputs: output (op tolerance) and the gradients of the input, the gate and the weight;
    fresh random inputs, 12 heads of 128 (h200-ref), T no multiple of any tile. And what each keeps
    for backward (the saved-tensor meter): per token 4 x HK x 4 (+ 48) = 24,624 bytes for ours (fp32
    input, normalised input, weighted product, sigmoid(gate)) against HK x 2 x 2 + H x 4 = 6,192 for
    fla's (x, the gate, one fp32 rstd per row), both as counted here. The bf16 output is not counted:
    the next op keeps it."""
    from longctx.layers.norms import GatedRMSNorm
    from longctx.measure.meter import SavedTensorMeter
    from longctx.ops.kda import fla_gated_rms_norm

    H, K = 12, 128
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(2, T, H, K, device="cuda", generator=gen).bfloat16()
    g = (2 * torch.randn(2, T, H, K, device="cuda", generator=gen)).bfloat16()
    norm = GatedRMSNorm(K).cuda()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(K, device="cuda", generator=gen))
    dy = torch.randn(2, T, H, K, device="cuda", generator=gen)
    runs, saved = {}, {}
    for use_fla in (False, True):
        xi, gi = x.clone().requires_grad_(True), g.clone().requires_grad_(True)
        norm.weight.grad = None
        meter = SavedTensorMeter()
        with meter.measure():
            y = fla_gated_rms_norm(xi, gi, norm.weight, norm.eps) if use_fla else norm(xi, gi)
        assert y.dtype == torch.bfloat16
        (y.float() * dy).sum().backward()
        runs[use_fla] = (y.detach().float(), xi.grad.float(), gi.grad.float(), norm.weight.grad.clone())
        saved[use_fla] = meter.total() / (2 * T)
    for a, b in zip(runs[True], runs[False]):
        assert rel_rms(a, b) <= (OUT_TOL if a is runs[True][0] else GRAD_TOL)
    print(f"T={T}: saved per token: ours {saved[False]:.0f} B, fla {saved[True]:.0f} B")
    if T > 1:
        assert saved[True] < 0.5 * saved[False]


def test_layer_fla_norm_matches_ours():
    """The layer with kernels.kda_norm fla against torch (the rest on fla, bf16): output and every
    parameter's gradient within the layer tolerance; the step log names it."""
    from longctx.config import preset
    from longctx.layers.kda import KimiDeltaAttention

    torch.manual_seed(0)
    layer = KimiDeltaAttention(preset("small"), 0).cuda().bfloat16()
    x = torch.randn(2, 777, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    out = {}
    for impl in ("torch", "fla"):
        layer.kernels["kda_norm"] = impl
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.float().square().mean().backward()
        out[impl] = (y.detach().float(), xi.grad.float(), {n: p.grad.float() for n, p in layer.named_parameters()})
        assert layer.last_impl.endswith("+fla-norm") == (impl == "fla"), layer.last_impl
    (y_t, gx_t, g_t), (y_f, gx_f, g_f) = out["torch"], out["fla"]
    assert rel_rms(y_f, y_t) <= LAYER_TOL and rel_rms(gx_f, gx_t) <= LAYER_TOL
    for n in g_t:
        assert rel_rms(g_f[n], g_t[n]) <= LAYER_TOL, n
