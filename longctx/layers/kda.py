"""Kimi Delta Attention layer: the linear-attention mixer (same function as HF's GLM-5.3-Flash one).

    x -> q, k, v projections -> depthwise causal conv + SiLU (each) -> heads -> L2-norm q, k
      -> KDA recurrence with the per-channel forget gate g and the write strength beta
      -> per-head RMSNorm gated by sigmoid(g_b(g_a(x))) -> o_proj

The forget gate is the bounded decay g = lower_bound * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias)),
so each step keeps at least e^lower_bound of the state (lower_bound None gives the softplus gate).
Training runs the chunkwise form. The recurrence, the conv and the gated norm are the kda op
(`longctx.ops.kda`; settings kernels.kda, kernels.kda_conv, kernels.kda_norm): fla's Triton kernels
on CUDA under auto, the plain-torch twins elsewhere. Decoding carries a `KDAState` (the conv window
and the recurrent state).

fla's conv takes a state's window (decoding, the sequence-chunked step's carries) as its initial state
and returns the new one as its final state; the chunked step with it under its carries is as exact as
the whole step (H200: all gradients 8.47e-2 vs 8.48e-2 rel-RMS from fp32). fla's fused gated RMSNorm
(weight * RMSNorm(o) * sigmoid(gate)) matches ours within the GPU test's bounds and keeps 6,192 bytes a
token for backward against ours' 24,624 at h200-ref's width. `last_impl` ends in "+fla-conv" /
"+fla-norm" where fla's ran.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..ops import kda as kda_ops
from ..ops import pick as _pick
from ..ops.kda import (
    IMPLS,
    causal_conv1d,
    fla_causal_conv1d,
    fla_chunk_kda,
    fla_gated_rms_norm,
    fla_recurrent_kda,
    kda_chunk,
    kda_gate,
    kda_step,
    l2norm,
)
from .norms import GatedRMSNorm


class KDAState:
    """Decoding state of one KDA layer, updated in place (its fields are replaced) by each forward.

    conv: the last conv_size-1 pre-conv q|k|v projections, [B, 3*H*K, conv_size-1] (HF's layout);
    recurrent: S, [B, H, K, V] in fp32 (fp64 for an fp64 model).

    A plain class, not a dataclass: FSDP rebuilds the dataclasses among a forward's inputs (to hook
    their tensors that need a gradient), and the layer would then update the copy, not this state
    (the sequence-chunked step passes carries that need a gradient).
    """

    __slots__ = ("conv", "recurrent")

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor):
        self.conv, self.recurrent = conv, recurrent


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = cfg.hidden_size
        self.num_heads = H = cfg.kda_heads
        self.head_dim = K = cfg.kda_head_dim
        self.conv_size = cfg.kda_conv_size
        self.chunk_size = cfg.kda_chunk_size
        self.lower_bound = cfg.kda_gate_lower_bound
        self.scale = K ** -0.5
        d, hk = cfg.hidden_size, H * K

        self.q_proj = nn.Linear(d, hk, bias=False)
        self.k_proj = nn.Linear(d, hk, bias=False)
        self.v_proj = nn.Linear(d, hk, bias=False)
        self.q_conv, self.k_conv, self.v_conv = (
            nn.Conv1d(hk, hk, self.conv_size, groups=hk, bias=False) for _ in range(3)
        )
        self.f_a_proj = nn.Linear(d, K, bias=False)
        self.f_b_proj = nn.Linear(K, hk, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(hk, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.b_proj = nn.Linear(d, H, bias=False)
        self.g_a_proj = nn.Linear(d, K, bias=False)
        self.g_b_proj = nn.Linear(K, hk, bias=False)
        self.o_norm = GatedRMSNorm(K, eps=cfg.rms_norm_eps)
        self.o_proj = nn.Linear(hk, d, bias=False)
        for p in (self.dt_bias, self.A_log):
            p._no_weight_decay = True

        self.cfg = cfg  # what fla's chunk kernel is checked against (`ops.kda.unavailable`)
        self.kernels = {"kda": "auto", "kda_conv": "auto", "kda_norm": "auto"}  # set by kernels.apply_kernels
        self.last_impl: str | None = None  # what ran (the step log's implementation report)
        # Context parallel: a longctx.distributed CPContext (handed down by the trainer) when x holds only
        # this rank's tokens of each sequence; its `kda` runs the layer's CP form. None: x is whole.
        self.cp = None
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self):
        """dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1]; A_log = 0 for the bounded gate
        (the sigmoid's slope is then 1), log U(1, 16) for the softplus gate (Mamba/fla's choice)."""
        lo, hi = math.log(1e-3), math.log(1e-1)
        dt = torch.exp(torch.rand(self.dt_bias.shape) * (hi - lo) + lo).clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        if self.lower_bound is not None:
            self.A_log.zero_()
        else:
            self.A_log.copy_(torch.empty(self.A_log.shape).uniform_(1, 16).log())

    # ------------------------------------------------------------------ decoding state
    def init_state(self, batch: int, device=None, dtype=None) -> KDAState:
        dtype = dtype or self.q_proj.weight.dtype
        hk = self.num_heads * self.head_dim
        return KDAState(
            conv=torch.zeros(batch, 3 * hk, self.conv_size - 1, device=device, dtype=dtype),
            recurrent=torch.zeros(
                batch, self.num_heads, self.head_dim, self.head_dim, device=device,
                dtype=torch.float64 if dtype == torch.float64 else torch.float32,
            ),
        )

    # ------------------------------------------------------------------ pieces
    def _short_conv(self, x: torch.Tensor, state: KDAState | None, cu_seqlens: torch.Tensor | None,
                    fla: bool = False) -> torch.Tensor:
        """Depthwise causal conv + SiLU over [B, T, 3*H*K] (q, k, v channels side by side), through fla's
        kernel or the torch twin. With `state`, the window of earlier inputs is prepended (and replaced by
        the new tail); with `cu_seqlens`, taps that would reach into the previous document are dropped."""
        weight = torch.cat([self.q_conv.weight, self.k_conv.weight, self.v_conv.weight], 0)[:, 0, :]  # [C, W]
        conv = fla_causal_conv1d if fla else causal_conv1d
        if state is None:
            return conv(x, weight, cu_seqlens=cu_seqlens)
        y, window = conv(x, weight, window=state.conv)
        state.conv = window.to(state.conv.dtype)
        return y

    def pick(self, x: torch.Tensor) -> tuple[str, str, str]:
        """What runs on x for the settings in `kernels` (the rule of `longctx.ops.pick`): the recurrence,
        the conv and the gated norm, each "fla" or "torch"."""
        k, dev, cuda = self.kernels, x.device, x.is_cuda
        return (_pick("kda", k["kda"], IMPLS, cuda, lambda: kda_ops.unavailable(dev, self.cfg)),
                _pick("kda_conv", k["kda_conv"], IMPLS, cuda, lambda: kda_ops.conv_unavailable(dev)),
                _pick("kda_norm", k["kda_norm"], IMPLS, cuda, lambda: kda_ops.norm_unavailable(dev)))

    # ------------------------------------------------------------------ projections
    # Six projections read x. As six Linears, x's gradient arrives six times and autograd adds them up:
    # five adds of [T, hidden] (each reads two and writes one), and the forward concatenates q, k and v
    # for the conv. Stacking the weights by rows gives the same outputs, column for column, from two
    # matmuls: q|k|v already in the conv's layout, and the three narrow ones (K + H + K columns, too
    # narrow to run well alone) together; x's gradient is then two products and one add.
    def qkv_projection(self, x: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """The conv's input q|k|v of x: [..., 3 * H * K] (`rows`: those rows of each of the three
        weights, a head range's channels)."""
        ws = [p.weight if rows is None else p.weight[rows] for p in (self.q_proj, self.k_proj, self.v_proj)]
        return F.linear(x, torch.cat(ws))

    def gate_projections(self, x: torch.Tensor, heads: slice | None = None):
        """(f_a(x) [..., K], b(x) [..., H] (`heads`: those heads' logits), g_a(x) [..., K]): views of one
        product. Zero rows in the stacked weight pad the product to a multiple of 8 columns (K + K + H =
        268 at h200-ref becomes 272): the views f_a and g_a feed the next matmuls, whose row stride then
        stays a multiple of 16 bytes, as cuBLAS's tensor-core kernels want."""
        b = self.b_proj.weight if heads is None else self.b_proj.weight[heads]
        K, h = self.head_dim, b.shape[0]
        ws = [self.f_a_proj.weight, self.g_a_proj.weight, b]
        pad = -(2 * K + h) % 8
        if pad:
            ws.append(b.new_zeros(pad, b.shape[1]))
        f_a, g_a, logits, _ = F.linear(x, torch.cat(ws)).split([K, K, h, pad], -1)
        return f_a, logits, g_a

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, state: KDAState | None = None, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]. Without `state`: training / full prefill (chunked).
        With `state`: continue from it (prefill of T tokens or a one-token step) and update it."""
        if self.cp is not None and state is None:
            return self.cp.kda(self, x, cu_seqlens)
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        if state is not None and cu_seqlens is not None:
            raise ValueError("KimiDeltaAttention: decoding with a KDAState takes unpacked rows; drop cu_seqlens.")
        backend, conv, norm = self.pick(x)
        conv_fla, norm_fla = conv == "fla", norm == "fla"
        qkv = self._short_conv(self.qkv_projection(x), state, cu_seqlens, conv_fla)
        q, k, v = (t.view(B, T, H, K) for t in qkv.split(H * K, -1))
        f_a, b, g_a = self.gate_projections(x)
        g_raw = self.f_b_proj(f_a).view(B, T, H, K)
        beta = torch.sigmoid(b)
        initial = state.recurrent if state is not None else None
        want_final = state is not None

        if backend == "fla":
            kw = {"A_log": self.A_log, "dt_bias": self.dt_bias, "lower_bound": self.lower_bound, "scale": self.scale,
                  "initial_state": initial, "output_final_state": want_final}
            if state is not None and T == 1:
                o, final = fla_recurrent_kda(q, k, v, g_raw, beta, **kw)
                self.last_impl = "kda:fla-recurrent"
            else:
                o, final = fla_chunk_kda(q, k, v, g_raw, beta, cu_seqlens=cu_seqlens, chunk_size=self.chunk_size, **kw)
                self.last_impl = "kda:fla-chunk"
        else:
            g = kda_gate(g_raw, self.A_log, self.dt_bias, self.lower_bound)
            q, k = l2norm(q), l2norm(k)
            if state is not None and T == 1:
                o, final = kda_step(q, k, v, g, beta, self.scale, initial)
                self.last_impl = "kda:torch-step"
            else:
                o, final = kda_chunk(q, k, v, g, beta, self.scale, initial_state=initial, output_final_state=want_final,
                                     chunk_size=self.chunk_size, cu_seqlens=cu_seqlens)
                self.last_impl = "kda:torch-chunk"
        if state is not None:
            state.recurrent = final.to(state.recurrent.dtype)
        if conv_fla:
            self.last_impl += "+fla-conv"

        gate = self.g_b_proj(g_a).view(B, T, H, K)
        if norm_fla:
            o = fla_gated_rms_norm(o.to(x.dtype), gate.to(x.dtype), self.o_norm.weight, self.o_norm.eps)
            self.last_impl += "+fla-norm"
        else:
            o = self.o_norm(o.to(x.dtype), gate)
        return self.o_proj(o.reshape(B, T, H * K))
