"""DeepSeek Sparse Attention under context parallelism: tokens split over the cp ranks (zigzag), the
few narrow per-token rows the attention and the indexer read from other tokens gathered.

Each rank holds its tokens x [B, S/cp, hidden] and computes, for those tokens only, the queries
(q_a -> norm -> q_b, absorbed into the latent space) and the rows other tokens will read: the
compressed latent c = RMSNorm(kv_a(x)) (kv_lora wide: keys and values of the absorbed MQA), and,
on layers that run their indexer, the indexer key k_I = LayerNorm(wk x) and the k-pool gate
logits x W_gate^T (index_head_dim wide each). One all-gather of [c | k_I | gate] puts all three
in sequence order on every rank, so each pool of P tokens combines its own tokens' keys with
their own gate scores even when the pool straddles two ranks (gathering the keys without the
scores would pool each key with a score from the wrong token). Each rank then scores only its own
queries against the pooled keys of the whole sequence (the sharded indexer: 1/cp of the scoring
work), keeps int32 token indices in sequence positions, and runs the sparse attention of its
queries over the gathered latents. The gradient of a gathered row returns to its owner through the
all-gather's backward.

The indexer KL (cfg.indexer_loss, training) is computed per rank over its own queries; the
`indexer_loss_value` a rank leaves on the layer is its share (its KL sum over the global query
count), and the cp ranks' shares add up to the single-process value, as every per-rank loss does
under context parallelism.
"""

from __future__ import annotations

import functools

import torch

from . import comm
from .zigzag import check_seq_len, gathered_to_sequence, segments


def _select_local(ind, x: torch.Tensor, q_latent: torch.Tensor, pk, spans) -> torch.Tensor:
    """The indexer's selection for this rank's queries (spans of sequence positions), against the
    whole sequence's pooled keys: `KPoolIndexer.select` with the keys given and the queries at their
    absolute positions. int32 [B, T, width], sequence positions, -1 padded."""
    from ..layers import kpool_indexer as kp

    impl = ind.pick(x.device)  # the layer's rule: with chunk None, auto is the plain-torch baseline
    n_pools = 0 if pk is None else pk.shape[1]
    out, off = [], 0
    for a, b in spans:
        xs, qs = x[:, off: off + b - a], q_latent[:, off: off + b - a]
        off += b - a
        if impl == "triton":
            pools = ind._kernel_pools(xs, qs, pk, n_pools, a)
            for s0 in range(0, b - a, kp._EXPAND_ROWS):
                s1 = min(b - a, s0 + kp._EXPAND_ROWS)
                out.append(ind._select_block(xs[:, s0:s1], qs[:, s0:s1], pk, n_pools, a + s0,
                                             pools=None if pools is None else pools[:, s0:s1]))
        else:
            step = (b - a) if ind.chunk is None else ind.chunk
            for s0 in range(0, b - a, step):
                s1 = min(b - a, s0 + step)
                out.append(ind._select_block(xs[:, s0:s1], qs[:, s0:s1], pk, n_pools, a + s0))
    ind.last_impl = ("indexer:triton-two-phase" if impl == "triton" else
                     "indexer:torch-unchunked" if ind.chunk is None else "indexer:torch-chunked") + "+cp"
    return torch.cat(out, 1)


def dsa_cp_forward(layer, x: torch.Tensor, group, prev_selection: torch.Tensor | None = None,
                   forced_selection: torch.Tensor | None = None, layout: str = "zigzag"):
    """One DSA layer (`longctx.layers.dsa.SparseMLA`) on this rank's tokens x [B, S/cp, hidden] ->
    (y [B, S/cp, hidden], selection int32 [B, S/cp, width]): the single-process layer's output and
    selection at this rank's positions (indices are sequence positions). prev_selection /
    forced_selection: as the layer's forward, this rank's rows. No decoding caches: CP is for training."""
    cp, rank = comm.group_size(group), comm.group_rank(group)
    B, T, _ = x.shape
    S = T * cp
    check_seq_len(S, cp, layout)
    spans = segments(S, cp, rank, layout)
    H, nope, L = layer.n_heads, layer.nope, layer.kv_lora
    q_latent = layer.q_a_norm(layer.q_a_proj(x))
    q = layer.q_b_proj(q_latent).view(B, T, H, nope)
    c = layer.kv_a_norm(layer.kv_a_proj(x))
    w = layer.kv_b_proj.weight.view(H, nope + layer.v_dim, L)
    q_abs = torch.einsum("bthn,hnl->bthl", q, w[:, :nope])
    c = c.to(q_abs.dtype)

    ind, cfg = layer.indexer, layer.cfg
    in_backward = torch._C._current_graph_task_id() != -1  # a block recompute: the first pass's KL counts
    want_kl = (ind is not None and cfg.indexer_loss and layer.training and forced_selection is None
               and not in_backward)
    need_keys = ind is not None and (forced_selection is None or want_kl)
    if ind is None and forced_selection is None and prev_selection is None:
        raise ValueError(f"DSA layer {layer.layer_idx} shares the previous full layer's selection (indexer_pattern 's') "
                         "but no prev_selection was passed.")

    parts = [c]
    if need_keys:
        # the KL trains only the indexer: its keys come from a detached x, as in the layer
        with torch.set_grad_enabled(want_kl):
            parts += list(ind.key_rows(x.detach()))
    dt = functools.reduce(torch.promote_types, [p.dtype for p in parts])  # one exchange; widening is exact
    pk = k_all = None
    # with the KL on, its graph is built even under no_grad (a recompute's first pass), as in the layer
    with torch.set_grad_enabled(torch.is_grad_enabled() or want_kl):
        rows = gathered_to_sequence(comm.all_gather(torch.cat([p.to(dt) for p in parts], -1), group), S, layout)
        got = rows.split([p.shape[-1] for p in parts], -1)
        kv = got[0].to(c.dtype)  # [B, S, kv_lora], sequence order
        if need_keys:
            k_all, gate_all = got[1].to(parts[1].dtype), got[2].to(parts[2].dtype)
            n = S // ind.pool * ind.pool
            pk = ind.pool_keys(k_all[:, :n], gate_all[:, :n]) if n else None

    if forced_selection is not None:
        selection = forced_selection
    elif ind is not None:
        with torch.no_grad():
            selection = _select_local(ind, x, q_latent, None if pk is None else pk.detach(), spans)
    else:
        selection = prev_selection
    if selection.shape[:2] != (B, T):
        raise ValueError(f"DSA layer {layer.layer_idx}: selection has shape {tuple(selection.shape)}, "
                         f"expected [{B}, {T}, width].")

    o_lat = layer._attend(q_abs, kv, selection)
    o = torch.einsum("bthl,hvl->bthv", o_lat, w[:, nope:])
    y = layer.o_proj(o.reshape(B, T, H * layer.v_dim))
    if layer.last_impl:
        layer.last_impl += "+cp"

    if not in_backward:
        layer.indexer_loss_value = None
    if want_kl:
        layer.indexer_loss_value = _kl_share(layer, x, q_latent, q_abs, kv, selection, pk, k_all, spans, S, group)
    return y, selection


def _kl_share(layer, x, q_latent, q_abs, kv, selection, pk, k_all, spans, S, group) -> torch.Tensor:
    """This rank's share of the indexer KL: the sum over its queries over the whole group's count."""
    ind = layer.indexer
    dense = S <= layer.cfg.indexer_loss_dense_below
    keys = pk if pk is not None else k_all[:, :0]  # no complete pool yet: the layer's empty pooled keys
    total, count, off = None, None, 0
    for a, b in spans:
        sl = slice(off, off + b - a)
        off += b - a
        t, n = ind.kl_loss(x[:, sl], q_latent[:, sl], q_abs[:, sl], kv, layer.scale,
                           selection=None if dense else selection[:, sl], dense=dense, pk=keys, q_offset=a,
                           reduce=False)
        total, count = (t, n) if total is None else (total + t, count + n)
    return total / comm.all_reduce_sum(count, group).clamp(min=1)


def dsa_cp_bytes(*, seq_len: int, kv_lora: int, index_head_dim: int, cp: int, batch: int = 1,
                 dtype_bytes: int = 2, indexer: bool = True) -> int:
    """Bytes one rank sends in one DSA layer's forward: the all-gather of its tokens' latent rows (and,
    with the indexer, key and gate rows); the backward's reduce-scatter sends the same."""
    width = kv_lora + (2 * index_head_dim if indexer else 0)
    return (cp - 1) * batch * (seq_len // cp) * width * dtype_bytes
