"""Kimi Delta Attention layer: the linear-attention mixer (same function as HF's GLM-5.3-Flash one).

    x -> q, k, v projections -> depthwise causal conv + SiLU (each) -> heads -> L2-norm q, k
      -> KDA recurrence with the per-channel forget gate g and the write strength beta
      -> per-head RMSNorm gated by sigmoid(g_b(g_a(x))) -> o_proj

The forget gate is the bounded decay of seed 001, g = lower_bound * sigmoid(exp(A_log) *
(f_b(f_a(x)) + dt_bias)), so each step keeps at least e^lower_bound of the state (lower_bound
None gives the softplus gate). Training runs the chunkwise form: fla's Triton kernel on CUDA, the
plain-torch twin elsewhere. Decoding carries a `KDAState` (the conv window and the recurrent state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError, warn_fallback
from ..ops.kda import (
    fla_available,
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

BACKENDS = ("auto", "torch", "fla", "triton")
NORM_IMPLS = ("auto", "torch", "fla")  # the gated output norm: ours (torch, fp32) or fla's fused kernel; auto = fla's where KDA runs fla
# until the H200 has compared them (bench/NOTES.md, "Next GPU calls")
CONV_IMPLS = ("auto", "torch", "fla")  # the short conv: fla's Triton causal_conv1d where KDA runs fla (auto), or forced


@dataclass
class KDAState:
    """Decoding state of one KDA layer, updated in place (its fields are replaced) by each forward.

    conv: the last conv_size-1 pre-conv q|k|v projections, [B, 3*H*K, conv_size-1] (HF's layout);
    recurrent: S, [B, H, K, V] in fp32 (fp64 for an fp64 model).
    """

    conv: torch.Tensor
    recurrent: torch.Tensor


def _part_uses_fla(x: torch.Tensor, backend: str, part: str, impl: str, impls: tuple) -> bool:
    """Whether KDA's `part` ("conv" or "norm"; layer attribute `{part}_impl`, training setting
    `kda_{part}`) runs fla's kernel: "auto" wherever the layer's KDA kernel (`backend`, what
    `_pick_backend` chose) is fla's; "fla" the same, and a ConfigError where fla cannot run; "torch" ours."""
    attr, setting = f"{part}_impl", f"kda_{part}"
    if impl not in impls:
        raise ConfigError(f"KDA {attr} must be one of {', '.join(impls)} (got {impl!r}).")
    if impl == "torch":
        return False
    if impl == "auto":
        return backend == "fla"
    if not x.is_cuda or not fla_available():
        raise ConfigError(f"KDA {part} 'fla' (setting {setting}, layer {attr}) needs CUDA tensors and fla-core 0.6.0 "
                          f"(tensors on {x.device}, fla {'importable' if fla_available() else 'not importable'}); "
                          f"set {setting} to 'auto' or 'torch'.")
    return True


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

        self.backend = "auto"
        self.norm_impl = "auto"  # "auto" | "torch" | "fla" (NORM_IMPLS)
        self.conv_impl = "auto"  # "auto" | "torch" | "fla": auto = fla's conv where the chunk kernel is fla's (128k step 5.93 -> 5.45 s)
        self.last_impl: str | None = None
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
                    conv_fla: bool = False) -> torch.Tensor:
        """Depthwise causal conv + SiLU over [B, T, 3*H*K] (q, k, v channels side by side).

        With `state`, the window of earlier inputs is prepended (and replaced by the new tail);
        with `cu_seqlens`, taps that would reach into the previous document are dropped."""
        _, T, C = x.shape
        W = self.conv_size
        weight = torch.cat([self.q_conv.weight, self.k_conv.weight, self.v_conv.weight], 0)  # [C, 1, W]
        if conv_fla:
            if state is None:
                return fla_causal_conv1d(x, weight[:, 0, :], cu_seqlens=cu_seqlens)
            # the window goes in as fla's initial state and the new one comes back as its final state
            y, window = fla_causal_conv1d(x, weight[:, 0, :], window=state.conv)
            state.conv = window.to(state.conv.dtype)
            return y
        xt = x.transpose(1, 2).to(weight.dtype)  # [B, C, T]
        if state is not None:
            xt = torch.cat([state.conv.to(weight.dtype), xt], -1)
            state.conv = xt[..., xt.shape[-1] - (W - 1):].to(state.conv.dtype)
            y = F.conv1d(xt, weight, groups=C)
        elif cu_seqlens is None:
            y = F.conv1d(F.pad(xt, (W - 1, 0)), weight, groups=C)
        else:
            starts = cu_seqlens.to(device=x.device, dtype=torch.long)
            pos = torch.arange(T, device=x.device)
            pos = pos - starts[torch.searchsorted(starts, pos, right=True) - 1]  # position inside its document
            y = xt * weight[:, :, W - 1]
            for i in range(1, W):  # tap i reads x_{t-i}: valid when the token is >= i into its document
                y = y + F.pad(xt, (i, 0))[..., :T] * weight[:, :, W - 1 - i] * (pos >= i)
        return F.silu(y).transpose(1, 2).to(x.dtype)

    # Which of the conv and the gated output norm run fla's kernels (`_part_uses_fla`). The conv: a state's
    # window (decoding, the sequence-chunked step's carries) goes in as fla's initial state and comes out
    # as its final state; auto took the torch conv under a state until the H200 showed
    # (bench/results/memory_runs/18_sequence_chunks_with_fla_conv_state.log) that the chunked step with
    # fla's conv under its carries is as exact as the whole step (all gradients 8.47e-2 vs 8.48e-2 rel-RMS
    # from fp32; with the torch conv there 9.11e-2 vs 8.49e-2). The norm: fla's fused gated RMSNorm
    # (weight * RMSNorm(o) * sigmoid(gate), SiLU-free) against ours (layers/norms.GatedRMSNorm, fp32
    # inside); on the H200 (call 23) fla's matched ours within the GPU test's bounds, kept 6,192 bytes per
    # token for backward against ours' 24,624 (h200-ref's width), and the 128k step ran 4.68 -> 4.55 s.
    # `last_impl` ends in "+fla-conv" / "+fla-norm" whenever fla's ran.

    def _pick_backend(self, x: torch.Tensor) -> str:
        if self.backend not in BACKENDS:
            raise ConfigError(f"KDA backend must be one of {', '.join(BACKENDS)} (got {self.backend!r}).")
        if self.backend == "torch":
            return "torch"
        if self.backend in ("fla", "triton"):
            if not x.is_cuda or not fla_available():
                raise ConfigError(
                    f"KDA backend {self.backend!r} needs CUDA tensors and fla-core 0.6.0 (tensors on {x.device}, "
                    f"fla {'importable' if fla_available() else 'not importable'}); set the backend to 'auto' or 'torch'."
                )
            return "fla"
        if x.is_cuda and not fla_available():
            warn_fallback("KDA runs the plain-torch twin on CUDA because fla-core is not importable (much slower and "
                       "more memory); install fla-core==0.6.0 (`pip install -e .[gpu]`) or set backend=torch to accept it.")
            return "torch"
        return "fla" if x.is_cuda else "torch"

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, state: KDAState | None = None, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]. Without `state`: training / full prefill (chunked).
        With `state`: continue from it (prefill of T tokens or a one-token step) and update it."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        if state is not None and cu_seqlens is not None:
            raise ValueError("KimiDeltaAttention: decoding with a KDAState takes unpacked rows; drop cu_seqlens.")
        backend = self._pick_backend(x)
        conv_fla = _part_uses_fla(x, backend, "conv", self.conv_impl, CONV_IMPLS)
        norm_fla = _part_uses_fla(x, backend, "norm", self.norm_impl, NORM_IMPLS)
        qkv = self._short_conv(torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1), state, cu_seqlens,
                               conv_fla)
        q, k, v = (t.view(B, T, H, K) for t in qkv.split(H * K, -1))
        g_raw = self.f_b_proj(self.f_a_proj(x)).view(B, T, H, K)
        beta = torch.sigmoid(self.b_proj(x))
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

        gate = self.g_b_proj(self.g_a_proj(x)).view(B, T, H, K)
        if norm_fla:
            o = fla_gated_rms_norm(o.to(x.dtype), gate.to(x.dtype), self.o_norm.weight, self.o_norm.eps)
            self.last_impl += "+fla-norm"
        else:
            o = self.o_norm(o.to(x.dtype), gate)
        return self.o_proj(o.reshape(B, T, H * K))
