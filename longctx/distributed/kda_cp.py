"""Kimi Delta Attention under context parallelism: three ways to run one KDA layer when each of the
cp ranks holds only its share of the sequence's tokens.

Every function takes the layer (`longctx.layers.kda.KimiDeltaAttention`, whose weights every cp
rank holds in full), this rank's tokens x [B, S/cp, hidden] in `layout` ("zigzag", the layout
between layers, or "contiguous"; `longctx.distributed.zigzag`) and the cp process group, and
returns this rank's output tokens [B, S/cp, hidden]: the single-process layer's output at those
positions, with autograd through the exchanges, so that the parameter gradients summed over the cp
ranks and each rank's input gradient are the single-process ones. cu_seqlens (packed documents,
B == 1) are the whole sequence's, the same on every rank.

KDA is a recurrence in sequence order, so each mode first arranges for every token it runs to see
all earlier tokens of the sequence:

  hidden_gather  all-gather the hidden state (the narrowest tensor the layer reads) into sequence
                 order; each rank projects only its H/cp heads with row slices of q/k/v/f_b/b/g_b
                 (the low-rank f_a, g_a are tiny and run whole), runs the short conv for those
                 channels and KDA over the whole sequence for those heads, applies the gated norm,
                 and an all-to-all returns each token's [H/cp * K] head outputs to its owner, which
                 runs o_proj on all heads. The all-to-all moves H*K/cp values per token where a
                 reduce-scatter of o_proj partial sums would move `hidden`: equal for GLM-5.3-Flash
                 at cp 2 (64*128/2 = 4096), half at cp 4; and o_proj then runs exactly as in one
                 process instead of summing cp rounded partials.
  qkv_a2a        each rank projects its own tokens for all heads; an all-to-all moves the pre-conv
                 q, k, v, the forget-gate input and beta (4K+1 values per head) from the token
                 split to the head split; conv + KDA run as above, and the outputs return as in
                 hidden_gather. The output gate stays with its token (it is applied after the
                 return), so it is not sent.
  chunk_state    each rank runs its own tokens for all heads. The short conv reads the last
                 conv_size-1 hidden rows of the preceding span (all-gathered, then projected
                 locally). The recurrent state entering a span is affine in the state before it:
                 S_end = M S_0 + S_ext, so every rank runs its spans once with v widened by K
                 columns and the initial state [0 | I], which yields S_ext and M (the final state)
                 and each token's read-out of the incoming state (the extra K output columns);
                 the (S_ext, M) pairs are all-gathered, each rank chains the ones before its spans
                 into its incoming state and adds that state's read-out to its outputs. The
                 exchange is O(H K (K+V)) per span whatever the length; the price is a KDA pass
                 K columns wider (fla's build_cp_context does the same with two passes). On CUDA,
                 for one contiguous unpacked sequence, fla's own context parallel runs instead
                 where fla.ops.cp imports.

`kda_cp_bytes` gives what each mode sends per rank and layer from the shapes alone; the test suite
checks it against the tensors the implementation passes to the collectives.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from . import comm
from ..config.parallel import KDA_CP_MODES as MODES
from .zigzag import check_seq_len, gathered_to_sequence, segments, sequence_to_owners


# ------------------------------------------------------------------------------ shared pieces
def _config_error(msg: str):
    from ..errors import ConfigError

    return ConfigError(msg)


def _impls(layer, x: torch.Tensor) -> tuple[str, bool, bool]:
    """(KDA backend, conv through fla, norm through fla), chosen exactly as the layer chooses them."""
    backend, conv, norm = layer.pick(x)
    return backend, conv == "fla", norm == "fla"


def _head_range(layer, cp: int, rank: int) -> tuple[int, int]:
    H = layer.num_heads
    if H % cp:
        raise _config_error(f"model.kda_heads = {H} is not a multiple of parallel.cp = {cp}, and the head-split KDA "
                            f"modes give each rank an equal share of the heads; choose a cp that divides {H} or set "
                            "parallel.kda_cp = chunk_state.")
    n = H // cp
    return rank * n, (rank + 1) * n


def _conv(layer, qkv: torch.Tensor, rows: slice | None, cu_seqlens, conv_fla: bool) -> torch.Tensor:
    """The layer's own short conv + SiLU over [B, T, 3*C] (q|k|v channels), restricted to the
    channels `rows` of each of q, k, v: the conv is depthwise, so a channel slice of its weights is
    the conv of those channels."""
    rows = rows or slice(None)
    view = types.SimpleNamespace(
        conv_size=layer.conv_size,
        q_conv=types.SimpleNamespace(weight=layer.q_conv.weight[rows]),
        k_conv=types.SimpleNamespace(weight=layer.k_conv.weight[rows]),
        v_conv=types.SimpleNamespace(weight=layer.v_conv.weight[rows]),
    )
    return type(layer)._short_conv(view, qkv, None, cu_seqlens, conv_fla)


def _kda(layer, backend: str, q, k, v, g_raw, beta, A_log, dt_bias, cu_seqlens=None, initial_state=None,
         want_final=False):
    """The layer's recurrence on already-projected heads (its forward's middle, heads sliced)."""
    if backend == "fla":
        from ..ops.kda import fla_chunk_kda

        return fla_chunk_kda(q, k, v, g_raw, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=layer.lower_bound,
                             scale=layer.scale, initial_state=initial_state, output_final_state=want_final,
                             cu_seqlens=cu_seqlens, chunk_size=layer.chunk_size)
    from ..ops.kda import kda_chunk, kda_gate, l2norm

    g = kda_gate(g_raw, A_log, dt_bias, layer.lower_bound)
    return kda_chunk(l2norm(q), l2norm(k), v, g, beta, layer.scale, initial_state=initial_state,
                     output_final_state=want_final, chunk_size=layer.chunk_size, cu_seqlens=cu_seqlens)


def _gated_norm(layer, o: torch.Tensor, gate: torch.Tensor, dtype, norm_fla: bool) -> torch.Tensor:
    if norm_fla:
        from ..ops.kda import fla_gated_rms_norm

        return fla_gated_rms_norm(o.to(dtype), gate.to(dtype), layer.o_norm.weight, layer.o_norm.eps)
    return layer.o_norm(o.to(dtype), gate)


def _return_to_owners(o: torch.Tensor, group, cp: int, layout: str) -> torch.Tensor:
    """[B, S, Hl, K] (this rank's heads, whole sequence) -> [B, S/cp, cp*Hl*K] (all heads, this
    rank's tokens): one all-to-all."""
    B, S, Hl, K = o.shape
    got = comm.all_to_all(sequence_to_owners(o.reshape(B, S, Hl * K), cp, layout), group)  # [cp, B, T, Hl*K]
    return got.permute(1, 2, 0, 3).reshape(B, S // cp, cp * Hl * K)


def _check_cu(cu_seqlens, B: int, S: int) -> list[int] | None:
    if cu_seqlens is None:
        return None
    b = [int(v) for v in torch.as_tensor(cu_seqlens).tolist()]
    if B != 1 or b[0] != 0 or b[-1] != S or any(y < x for x, y in zip(b, b[1:])):
        raise ValueError(f"KDA under context parallelism: cu_seqlens must be the whole sequence's (rising from 0 to "
                         f"S = {S}) with packed rows (B == 1); got B = {B}, cu_seqlens {b[:3]}...{b[-2:]}.")
    return b


def _local_bounds(bounds: list[int] | None, start: int, end: int, device):
    """cu_seqlens of the span [start, end) of the sequence, or None when the sequence is unpacked."""
    if bounds is None:
        return None
    inner = [b - start for b in bounds if start < b < end]
    return torch.tensor([0, *inner, end - start], dtype=torch.long, device=device)


def _tag(layer, backend: str, mode: str, conv_fla: bool, norm_fla: bool) -> None:
    layer.last_impl = (f"kda:{'fla' if backend == 'fla' else 'torch'}-chunk+cp-{mode}"
                       + ("+fla-conv" if conv_fla else "") + ("+fla-norm" if norm_fla else ""))


# ------------------------------------------------------------------------------ hidden_gather
def kda_hidden_gather(layer, x: torch.Tensor, group, layout: str = "zigzag", cu_seqlens=None) -> torch.Tensor:
    """KDA with the hidden state all-gathered and this rank's H/cp heads run over the whole sequence."""
    cp, rank = comm.group_size(group), comm.group_rank(group)
    B, T, _ = x.shape
    S = T * cp
    check_seq_len(S, cp, layout)
    bounds = _check_cu(cu_seqlens, B, S)
    K = layer.head_dim
    h0, h1 = _head_range(layer, cp, rank)
    Hl, rows = h1 - h0, slice(h0 * K, h1 * K)
    backend, conv_fla, norm_fla = _impls(layer, x)
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.long, device=x.device)

    xs = gathered_to_sequence(comm.all_gather(x, group), S, layout)  # [B, S, hidden] in sequence order
    qkv = layer.qkv_projection(xs, rows)
    q, k, v = (t.view(B, S, Hl, K) for t in _conv(layer, qkv, rows, cu, conv_fla).split(Hl * K, -1))
    f_a, b, g_a = layer.gate_projections(xs, slice(h0, h1))
    g_raw = F.linear(f_a, layer.f_b_proj.weight[rows]).view(B, S, Hl, K)
    beta = torch.sigmoid(b)
    o, _ = _kda(layer, backend, q, k, v, g_raw, beta, layer.A_log[h0:h1], layer.dt_bias[rows], cu_seqlens=cu)
    gate = F.linear(g_a, layer.g_b_proj.weight[rows]).view(B, S, Hl, K)
    o = _gated_norm(layer, o, gate, x.dtype, norm_fla)
    _tag(layer, backend, "hidden_gather", conv_fla, norm_fla)
    return layer.o_proj(_return_to_owners(o, group, cp, layout))


# ------------------------------------------------------------------------------ qkv_a2a
def kda_qkv_a2a(layer, x: torch.Tensor, group, layout: str = "zigzag", cu_seqlens=None) -> torch.Tensor:
    """KDA with each rank projecting its own tokens and an all-to-all of the projections to heads."""
    cp, rank = comm.group_size(group), comm.group_rank(group)
    B, T, _ = x.shape
    S = T * cp
    check_seq_len(S, cp, layout)
    bounds = _check_cu(cu_seqlens, B, S)
    H, K = layer.num_heads, layer.head_dim
    h0, h1 = _head_range(layer, cp, rank)
    Hl, rows = h1 - h0, slice(h0 * K, h1 * K)
    backend, conv_fla, norm_fla = _impls(layer, x)
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.long, device=x.device)

    f_a, b, g_a = layer.gate_projections(x)
    packed = torch.cat([*layer.qkv_projection(x).view(B, T, 3, H, K).unbind(2),
                        layer.f_b_proj(f_a).view(B, T, H, K), torch.sigmoid(b).view(B, T, H, 1)], -1)
    # [B, T, H, 4K+1] -> [cp, B, T, Hl, 4K+1]: row j holds head group j, which rank j runs
    send = packed.view(B, T, cp, Hl, 4 * K + 1).permute(2, 0, 1, 3, 4)
    full = gathered_to_sequence(comm.all_to_all(send, group), S, layout)  # [B, S, Hl, 4K+1]
    q, k, v, g_raw, beta = full.split([K, K, K, K, 1], -1)
    qkv = torch.cat([t.reshape(B, S, Hl * K) for t in (q, k, v)], -1)
    q, k, v = (t.view(B, S, Hl, K) for t in _conv(layer, qkv, rows, cu, conv_fla).split(Hl * K, -1))
    o, _ = _kda(layer, backend, q, k, v, g_raw, beta[..., 0], layer.A_log[h0:h1], layer.dt_bias[rows], cu_seqlens=cu)
    o = _return_to_owners(o.to(x.dtype), group, cp, layout).view(B, T, H, K)
    gate = layer.g_b_proj(g_a).view(B, T, H, K)
    _tag(layer, backend, "qkv_a2a", conv_fla, norm_fla)
    return layer.o_proj(_gated_norm(layer, o, gate, x.dtype, norm_fla).reshape(B, T, H * K))


# ------------------------------------------------------------------------------ chunk_state
def _fla_cp_context(group, S: int, bounds, device):
    """fla's context-parallel context for this group, or None where fla.ops.cp does not import."""
    try:
        from fla.ops.cp import build_cp_context
    except Exception:  # noqa: BLE001 - ImportError, or a triton/torch mismatch raised while importing
        return None
    cu = torch.tensor(bounds if bounds is not None else [0, S], dtype=torch.long, device=device)
    return build_cp_context(cu, group=group)


def kda_chunk_state(layer, x: torch.Tensor, group, layout: str = "zigzag", cu_seqlens=None,
                    fla_cp: bool | None = None) -> torch.Tensor:
    """KDA with each rank running its own tokens, given the recurrent state of the tokens before them.

    fla_cp: use fla's own context parallel (CUDA, fla backend, contiguous layout, B == 1); None = where
    it applies and imports, False = never (the state pass here, through the layer's kernel)."""
    cp, rank = comm.group_size(group), comm.group_rank(group)
    B, T, _ = x.shape
    S = T * cp
    check_seq_len(S, cp, layout)
    bounds = _check_cu(cu_seqlens, B, S)
    H, K, W = layer.num_heads, layer.head_dim, layer.conv_size
    backend, conv_fla, norm_fla = _impls(layer, x)
    spans = segments(S, cp, rank, layout)
    if spans[0][1] - spans[0][0] < W - 1:
        raise _config_error(f"parallel.kda_cp = chunk_state needs each rank's spans to be at least conv_size - 1 = {W - 1} "
                            f"tokens long (got {spans[0][1] - spans[0][0]}); use a longer sequence or a smaller cp.")

    # The conv's window: the last W-1 hidden rows of every span, gathered; a span reads its predecessor's.
    offs = [0]
    for a, b in spans:
        offs.append(offs[-1] + b - a)
    halo = torch.stack([x[:, offs[i + 1] - (W - 1): offs[i + 1]] for i in range(len(spans))]) if W > 1 else None
    halos = comm.all_gather(halo, group) if halo is not None else None  # [cp, n_spans, B, W-1, hidden]
    ending_at = {b: (j, i) for j in range(cp) for i, (_, b) in enumerate(segments(S, cp, j, layout))}

    pieces, g_as = [], []  # per span: (x rows, q, k, v, g_raw, beta); the output gate's low rank
    for i, (a, b) in enumerate(spans):
        xs = x[:, offs[i]: offs[i + 1]]
        h = W - 1 if (a > 0 and halos is not None) else 0
        xw = torch.cat([halos[ending_at[a]], xs], 1) if h else xs
        qkv = _conv(layer, layer.qkv_projection(xw), None, _local_bounds(bounds, a - h, b, x.device), conv_fla)[:, h:]
        q, k, v = (t.view(B, b - a, H, K) for t in qkv.split(H * K, -1))
        f_a, logits, g_a = layer.gate_projections(xs)
        pieces.append((xs, q, k, v, layer.f_b_proj(f_a).view(B, b - a, H, K), torch.sigmoid(logits)))
        g_as.append(g_a)

    use_fla = (fla_cp is not False and backend == "fla" and layout == "contiguous" and B == 1)
    ctx = _fla_cp_context(group, S, bounds, x.device) if use_fla else None
    if fla_cp and ctx is None:
        raise _config_error("fla's context parallel was asked for (fla_cp=True) but needs CUDA, the fla KDA backend, "
                            "fla.ops.cp importable, the contiguous layout and B == 1; drop fla_cp to use the state "
                            "pass here.")
    if ctx is not None:
        outs = [_fla_cp_run(layer, ctx, *p[1:]) for p in pieces]
        received = (halos,)
    else:
        outs, received = _state_pass(layer, backend, pieces, spans, bounds, group, halos, S, cp, layout)

    ys = []
    for (xs, *_), g_a, o in zip(pieces, g_as, outs):
        gate = layer.g_b_proj(g_a).view(*xs.shape[:2], H, K)
        ys.append(layer.o_proj(_gated_norm(layer, o, gate, x.dtype, norm_fla).reshape(*xs.shape[:2], H * K)))
    _tag(layer, backend, "chunk_state" + ("-fla" if ctx is not None else ""), conv_fla, norm_fla)
    return comm.keep_in_graph(torch.cat(ys, 1), *[r for r in received if r is not None])


def _state_pass(layer, backend, pieces, spans, bounds, group, halos, S, cp, layout):
    """Each span once with v widened by K zero columns from the state [0 | I]: its final state is
    [S_ext | M] and its extra output columns are each token's read-out of the incoming state."""
    H, K = layer.num_heads, layer.head_dim
    V = K
    summaries, wide = [], []
    for (xs, q, k, v, g_raw, beta), (a, b) in zip(pieces, spans):
        cu = _local_bounds(bounds, a, b, xs.device)
        n = q.shape[0] if cu is None else cu.numel() - 1  # states: one per row, or per document in the span
        sd = torch.float64 if q.dtype == torch.float64 else torch.float32
        init = torch.zeros(n, H, K, V + K, dtype=sd, device=xs.device)
        init[: (n if cu is None else 1), :, :, V:] = torch.eye(K, dtype=sd, device=xs.device)  # only the first document continues
        o, final = _kda(layer, backend, q, k, torch.cat([v, torch.zeros_like(v)], -1), g_raw, beta,
                        layer.A_log, layer.dt_bias, cu_seqlens=cu, initial_state=init, want_final=True)
        summaries.append(final if cu is None else final[-1:])  # the state leaving the span is its last document's
        wide.append(o)
    mine = torch.stack(summaries)  # [n_spans, B or 1, H, K, V+K]
    if halos is not None:
        mine = comm.keep_in_graph(mine, halos)  # its backward then follows the summaries' on every rank
    every = comm.all_gather(mine, group)  # [cp, n_spans, ...]
    order = sorted((a, j, i) for j in range(cp) for i, (a, _) in enumerate(segments(S, cp, j, layout)))
    starts = set(bounds or [0])
    outs = []
    for o, (a, _) in zip(wide, spans):
        state = None
        for start, j, i in order:
            if start >= a:
                break
            if start in starts:
                state = None  # a document begins here: nothing earlier reaches it
            trans, inject = every[j, i, ..., V:], every[j, i, ..., :V]
            state = inject if state is None else trans @ state + inject
        if a in starts:
            state = None
        out = o[..., :V]
        if state is not None:
            out = out + torch.einsum("blhk,bhkv->blhv", o[..., V:].to(state.dtype), state).to(out.dtype)
        outs.append(out)
    return outs, (every,)


def _fla_cp_run(layer, ctx, q, k, v, g_raw, beta):
    """fla's chunk_kda under its context-parallel context (the state passing is fla's own)."""
    from fla.ops.kda import chunk_kda

    lb = layer.lower_bound
    o, _ = chunk_kda(q, k, v, g_raw, beta, scale=layer.scale, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                     A_log=layer.A_log, dt_bias=layer.dt_bias, lower_bound=lb,
                     safe_gate=lb is not None and -5.0 <= lb < 0.0, chunk_size=layer.chunk_size, cp_context=ctx)
    return o


# ------------------------------------------------------------------------------ dispatch and bytes
def kda_cp_forward(layer, x: torch.Tensor, group, mode: str = "hidden_gather", layout: str = "zigzag",
                   cu_seqlens=None) -> torch.Tensor:
    """The layer under context parallelism in `mode` (parallel.kda_cp)."""
    fns = {"hidden_gather": kda_hidden_gather, "qkv_a2a": kda_qkv_a2a, "chunk_state": kda_chunk_state}
    if mode not in fns:
        from ..errors import did_you_mean

        raise _config_error(f"parallel.kda_cp must be one of {', '.join(MODES)} (got {mode!r}){did_you_mean(str(mode), MODES)}.")
    return fns[mode](layer, x, group, layout=layout, cu_seqlens=cu_seqlens)


def kda_cp_bytes(mode: str, *, seq_len: int, hidden: int, heads: int, head_dim: int, cp: int, batch: int = 1,
                 conv_size: int = 4, dtype_bytes: int = 2, state_bytes: int = 4, layout: str = "zigzag") -> dict:
    """Bytes one rank sends in one KDA layer's forward (the backward sends the same amounts back
    through the adjoint collectives): {"inbound": before the recurrence runs, "outbound": returning
    outputs to their owners, "total"}. An all-gather of n local bytes sends (cp-1)*n; an all-to-all
    of n local bytes keeps the 1/cp addressed to itself and sends the rest. Unpacked rows (B =
    batch); for chunk_state the summaries are per span and row."""
    T = seq_len // cp
    K = V = head_dim
    per_rank_heads = heads // cp
    if mode == "hidden_gather":
        inbound = (cp - 1) * batch * T * hidden * dtype_bytes
    elif mode == "qkv_a2a":
        inbound = (cp - 1) * batch * T * per_rank_heads * (4 * K + 1) * dtype_bytes
    elif mode == "chunk_state":
        spans = 2 if layout == "zigzag" else 1
        halo = (cp - 1) * spans * batch * (conv_size - 1) * hidden * dtype_bytes
        inbound = halo + (cp - 1) * spans * batch * heads * K * (V + K) * state_bytes
    else:
        raise _config_error(f"parallel.kda_cp must be one of {', '.join(MODES)} (got {mode!r}).")
    outbound = 0 if mode == "chunk_state" else (cp - 1) * batch * T * per_rank_heads * V * dtype_bytes
    return {"inbound": inbound, "outbound": outbound, "total": inbound + outbound}
