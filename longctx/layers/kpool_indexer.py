"""The k-pool lightning indexer of DeepSeek Sparse Attention (GLM-5.3-Flash flavour).

Each query scores *pools* of P consecutive tokens instead of single tokens, keeps the best
topk/P pools, and expands them back into token indices (plus, optionally, the tokens of its own
incomplete pool, the "tail"). For a query t < topk that is exactly dense causal attention.

Memory: pooled keys are built once for the whole sequence (O(S)); the torch twin scores and
selects a block of queries at a time, so its score workspace is O(chunk * S/P), never [S, S/P];
the Triton path keeps one block of 1024 queries' fp32 scores against the pools they see.

Backends (the indexer op, `longctx.ops.indexer`, the setting kernels.indexer): "torch" scores
`chunk` queries per pass in fp32 and keeps the best pools with torch.topk; "triton" runs the Triton
path over the whole sequence (`ops/indexer/triton.py`: a score kernel, torch.topk's k-th score, an
emit kernel); "auto" is Triton on CUDA and torch on the CPU (`longctx.ops.pick`), except with `chunk`
None: the memory plan's chunked-indexer switch turned off asks for the plain unchunked indexer (the
baseline's O(S x S/P) scores), which auto then runs in torch on CUDA too (`last_impl` says
"indexer:torch-unchunked"). `last_impl` names what ran.

Both backends select the same pools, except where scores tie at a query's k-th score:
- torch: ties are resolved by torch.topk itself, fed the same fp32 row the reference builds: one
  entry per complete pool of the sequence, unselectable pools at the fp32 minimum. Equal rows give
  equal picks, so chunked, unchunked and transformers' selection agree even on ties (a decode
  step's row is shorter, so only there an exact tie may resolve differently). The CPU default, and
  what the transformers-equivalence tests run.
- triton: the lower pool id wins, whatever the row length. Its scores are the same function
  summed in another order (fp32 accumulation of the products in the kernel's dtype), so pools
  whose scores tie to within fp32 rounding may also swap. The kernel runs in q's dtype (the
  autocast dtype under autocast, where the torch path's matmuls round their inputs, and their
  outputs, to it too); the pooled keys are cast to it.

No LM gradient reaches the indexer (selection runs under no_grad); its parameters learn only from
`kl_loss`, the DeepSeek-V3.2 KL between the main attention's distribution and the indexer's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..ops import indexer as indexer_ops
from ..ops import pick as _pick

_DEFAULT = object()
_EXPAND_ROWS = 8192  # queries per block when the kernel's pool ids are expanded into token indices


class GrowBuffer:
    """An append-only [B, n, D] tensor with doubling capacity: appending T rows costs O(T) amortised."""

    def __init__(self):
        self.data: torch.Tensor | None = None
        self.n = 0

    def append(self, rows: torch.Tensor) -> torch.Tensor:
        B, T = rows.shape[:2]
        if self.data is None:
            self.data = rows.new_empty(B, max(T, 16), *rows.shape[2:])
        elif self.n + T > self.data.shape[1]:
            bigger = rows.new_empty(B, max(self.n + T, 2 * self.data.shape[1]), *rows.shape[2:])
            bigger[:, : self.n] = self.data[:, : self.n]
            self.data = bigger
        self.data[:, self.n : self.n + T] = rows
        self.n += T
        return self.view()

    def view(self) -> torch.Tensor | None:
        return None if self.data is None else self.data[:, : self.n]


class IndexerCache:
    """Decoding state: pooled keys of the complete pools and the raw rows of the incomplete one.

    A new token adds one k_I row and one gate row; every P-th token closes a pool (O(P * D_I)), and
    scoring the new query touches each pool key once: O(#pools) per token, no prefix recomputation.
    """

    def __init__(self):
        self.pool_keys = GrowBuffer()
        self.raw_k: torch.Tensor | None = None  # [B, r, D_I], r < P
        self.raw_gate: torch.Tensor | None = None
        self.length = 0

    def extend(self, indexer: KPoolIndexer, k: torch.Tensor, gate: torch.Tensor) -> torch.Tensor | None:
        """Append new key/gate rows; return the pooled keys of all complete pools so far."""
        P = indexer.pool
        self.length += k.shape[1]
        if self.raw_k is not None:
            k, gate = torch.cat([self.raw_k, k], 1), torch.cat([self.raw_gate, gate], 1)
        n = k.shape[1] // P * P
        if n:
            self.pool_keys.append(indexer.pool_keys(k[:, :n], gate[:, :n]))
        self.raw_k, self.raw_gate = k[:, n:].clone(), gate[:, n:].clone()
        return self.pool_keys.view()


class KPoolIndexer(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.head_dim = cfg.index_heads, cfg.index_head_dim
        self.pool, self.topk, self.tail = cfg.index_pool, cfg.index_topk, cfg.index_tail
        self.width = cfg.index_width()
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        # The reference initialises the pooling as: no positional bias, gate = per-token sum of x.
        self.pool_ape = nn.Parameter(torch.zeros(self.pool, self.head_dim))
        self.pool_gate = nn.Parameter(torch.ones(self.head_dim, cfg.hidden_size))
        # Queries scored per pass by the torch twin (the memory plan's chunked-indexer switch); None = all
        # at once, in torch also under auto on CUDA (the plain baseline). The Triton path takes the
        # whole sequence.
        self.chunk: int | None = 256
        self.kernels = {"indexer": "auto"}  # set by longctx.kernels.apply_kernels
        self.last_impl: str | None = None

    # ------------------------------------------------------------------ building blocks
    def key_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token indexer key k_I = LayerNorm(wk x) and pooling gate logits x W_gate^T."""
        return self.k_norm(self.wk(x)), F.linear(x, self.pool_gate)

    def pool_keys(self, k: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """[B, n*P, D_I] rows of complete pools -> [B, n, D_I]: per-channel softmax-weighted sums."""
        B, N, D = k.shape
        P = self.pool
        logits = gate.float().view(B, N // P, P, D) + self.pool_ape.float()
        prob = logits.softmax(dim=2).to(k.dtype)
        return (prob * k.view(B, N // P, P, D)).sum(2)

    def pool_scores(self, q_latent: torch.Tensor, x: torch.Tensor, pk: torch.Tensor) -> torch.Tensor:
        """score(t, p) = sum_h w[t,h] ReLU(D^-1/2 q_I[t,h] . pk_p), in fp32: [B, c, n]."""
        B, c = x.shape[:2]
        q = self.wq_b(q_latent).view(B, c, self.n_heads, self.head_dim)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads**-0.5
        with torch.autocast(x.device.type, enabled=False):  # fp32 as promised: bf16 scores tie, and topk
            s = torch.matmul(q.float(), pk.float().transpose(-1, -2).unsqueeze(1))  # breaks ties by row length
            s = F.relu(s * self.head_dim**-0.5)  # [B, c, H, n]
            return torch.matmul(w.unsqueeze(-2), s).squeeze(-2)

    # ------------------------------------------------------------------ selection
    @torch.no_grad()
    def forward(self, x, q_latent, chunk=_DEFAULT, cache: IndexerCache | None = None) -> torch.Tensor:
        return self.select(x, q_latent, chunk=chunk, cache=cache)

    @torch.no_grad()
    def select(self, x: torch.Tensor, q_latent: torch.Tensor, chunk=_DEFAULT,
               cache: IndexerCache | None = None) -> torch.Tensor:
        """Token indices each query attends to: int32 [B, T, index_width], ascending, -1 padded.

        x [B, T, hidden] and q_latent [B, T, q_lora] are the T newest tokens; with a cache they
        follow its `length` earlier tokens and the indices are absolute positions. chunk: queries
        per pass of the torch backend (default `self.chunk`; None = all at once, the O(T * S/P)
        baseline, which auto then runs in torch on CUDA too); the Triton path selects for all T queries
        at once and ignores it.
        """
        chunk = self.chunk if chunk is _DEFAULT else chunk
        impl = self.pick(x.device, chunk)
        B, T = x.shape[:2]
        P = self.pool
        k, gate = self.key_rows(x)
        if cache is None:
            start = 0
            n = T // P * P
            pk = self.pool_keys(k[:, :n], gate[:, :n]) if n else None
        else:
            start = cache.length
            pk = cache.extend(self, k, gate)
        n_pools = 0 if pk is None else pk.shape[1]
        out = torch.full((B, T, self.width), -1, dtype=torch.int32, device=x.device)
        if impl == "triton":
            self.last_impl = "indexer:triton-two-phase"
            pools = self._kernel_pools(x, q_latent, pk, n_pools, start)  # all T queries, in blocks of its own
            for s0 in range(0, T, _EXPAND_ROWS):
                s1 = min(T, s0 + _EXPAND_ROWS)
                out[:, s0:s1] = self._select_block(x[:, s0:s1], q_latent[:, s0:s1], pk, n_pools, start + s0,
                                                   pools=None if pools is None else pools[:, s0:s1])
            return out
        self.last_impl = "indexer:torch-unchunked" if chunk is None else "indexer:torch-chunked"
        step = T if chunk is None else chunk
        for s0 in range(0, T, step):
            s1 = min(T, s0 + step)
            out[:, s0:s1] = self._select_block(x[:, s0:s1], q_latent[:, s0:s1], pk, n_pools, start + s0)
        return out

    def pick(self, device: torch.device, chunk: int | None = _DEFAULT) -> str:
        """"triton" or "torch" for kernels.indexer on `device` (the rule of `longctx.ops.pick`); `chunk`
        None (the plan's unchunked baseline) makes auto the torch twin."""
        chunk = self.chunk if chunk is _DEFAULT else chunk
        return _pick("indexer", self.kernels["indexer"], indexer_ops.IMPLS, device.type == "cuda",
                     lambda: indexer_ops.unavailable(device), plain=chunk is None)

    def _kernel_pools(self, x, q_latent, pk, n_pools: int, p0: int) -> torch.Tensor | None:
        """int32 [B, T, k_sel] pool ids from the Triton path (ascending, -1 padded); None without pools.

        Same scores as `pool_scores` with D^-1/2 moved from the dot products into w (ReLU commutes
        with a positive factor). Shapes or dtypes the kernel cannot take raise its ValueError."""
        from ..ops.indexer.triton import kpool_topk_triton

        k_sel = min(self.topk // self.pool, n_pools)
        if k_sel == 0:
            return None
        B, T = x.shape[:2]
        q = self.wq_b(q_latent).view(B, T, self.n_heads, self.head_dim)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * (self.n_heads**-0.5 * self.head_dim**-0.5)
        return kpool_topk_triton(q, w, pk.to(q.dtype), self.pool, k_sel, q_offset=p0)

    def _select_block(self, x, q_latent, pk, n_pools: int, p0: int, pools: torch.Tensor | None = None) -> torch.Tensor:
        """Queries at absolute positions p0 .. p0+c-1. `pools`: their pool ids from the kernel (int32,
        ascending, -1 padded); without them the block is scored and selected here in torch."""
        B, c = x.shape[:2]
        P = self.pool
        pos = torch.arange(p0, p0 + c, device=x.device)
        k_sel = min(self.topk // P, n_pools)
        tokens = torch.full((B, c, self.width), -1, dtype=torch.int64, device=x.device)
        n_valid = torch.zeros(B, c, dtype=torch.int64, device=x.device)
        if k_sel > 0:
            if pools is None:
                score = self.pool_scores(q_latent, x, pk)  # [B, c, n_pools]
                ends = torch.arange(n_pools, device=x.device) * P + (P - 1)
                valid = (ends[None, :] <= pos[:, None]).expand(B, c, n_pools)
                top = score.masked_fill(~valid, torch.finfo(score.dtype).min).topk(k_sel, dim=-1, sorted=False).indices
                ok = valid.gather(-1, top)
                pools = torch.where(ok, top, n_pools).sort(dim=-1).values  # ascending, unselectable last
                ok = pools < n_pools
            else:
                ok = pools >= 0
                pools = pools.long()
            offs = torch.arange(P, device=x.device)
            expanded = torch.where(ok[..., None], pools[..., None] * P + offs, -1).flatten(-2)
            tokens[..., : expanded.shape[-1]] = expanded
            n_valid = ok.sum(-1)
        if self.tail and P > 1:
            # The query's own incomplete pool: t+1 mod P tokens after the last complete pool,
            # written right after the selected pools so each row stays ascending and packed.
            j = torch.arange(P - 1, device=x.device)
            cnt = (pos + 1) % P
            tail = torch.where(j[None, :] < cnt[:, None], (pos + 1 - cnt)[:, None] + j, -1)
            slot = n_valid[..., None] * P + j
            tokens.scatter_(-1, slot, tail.expand(B, c, P - 1))
        return tokens.to(torch.int32)

    # ------------------------------------------------------------------ compact form
    def compact_width(self) -> int:
        """Entries per query of `compact`: one per group of `pool` slots of the selection."""
        return -(-self.width // self.pool)

    def compact(self, sel: torch.Tensor) -> torch.Tensor:
        """The selection [B, T, width] as one int32 entry per `pool` slots ([B, T, ceil(width/pool)]).

        `select` writes each selected pool as `pool` consecutive slots starting at a multiple of
        `pool`, then the query's own incomplete pool (the tail) in the same aligned way, then -1; so
        the first slot of every group says the whole group. The sequence-chunked step keeps every
        chunk's selection until the backward sweep (on the host on CUDA: 32 GiB per DSA layer at 4M
        tokens for h200-ref in full, a quarter of it compacted), and `expand` rebuilds it exactly."""
        return sel[..., :: self.pool].contiguous()

    def expand(self, comp: torch.Tensor, p0: int, rows: int = 16384) -> torch.Tensor:
        """Inverse of `compact` for queries at absolute positions p0, p0+1, ... (int32 throughout and
        `rows` queries at a time, so the rebuild costs one chunk's selection and not its int64 twin).

        A group whose first token starts the query's own incomplete pool is the tail: (t+1) mod pool
        tokens. No selectable pool starts there (a pool is selectable once complete), so it is never
        mistaken for one."""
        B, T, G = comp.shape
        P = self.pool
        out = torch.empty(B, T, self.width, dtype=torch.int32, device=comp.device)
        offs = torch.arange(P, dtype=torch.int32, device=comp.device)
        for r0 in range(0, T, rows):
            r1 = min(T, r0 + rows)
            first = comp[:, r0:r1].to(torch.int32)
            pos = torch.arange(p0 + r0, p0 + r1, dtype=torch.int32, device=comp.device)
            cnt = (pos + 1) % P
            tail = (first == (pos + 1 - cnt)[:, None]) & (cnt > 0)[:, None]
            n = torch.where(first < 0, 0, torch.where(tail, cnt[:, None].expand_as(first), P))
            full = torch.where(offs < n[..., None], first[..., None] + offs, -1)
            out[:, r0:r1] = full.flatten(-2)[..., : self.width]
        return out

    # ------------------------------------------------------------------ training signal
    def kl_loss(self, x: torch.Tensor, q_latent: torch.Tensor, q_attn: torch.Tensor, kv: torch.Tensor,
                scale: float, selection: torch.Tensor | None = None, dense: bool = False,
                chunk=_DEFAULT, pk: torch.Tensor | None = None, q_offset: int = 0, reduce: bool = True):
        """Mean over queries of KL(attention || indexer) over pools; gradient only into this module.

        q_attn [B, S, H, D] and kv [B, S, D] are the main attention's (absorbed) queries and latent.
        Target: the attention probability summed over heads and over each pool's tokens,
        renormalised over the support; the indexer distribution is the softmax of its pool scores
        over the same support. `dense`: support = all complete causal pools and the target is dense
        causal attention (the warm-up); otherwise support = the pools in `selection` and the target
        is the sparse attention over `selection`. Each block of queries is recomputed in backward,
        so the saved state is O(S), not O(S^2 / P).

        Sequence chunks (longctx.memory.sequence_chunks): `pk` = the pooled keys of every complete
        pool up to the chunk's end (earlier chunks' as a leaf that collects their gradient), x etc.
        the chunk's rows at absolute positions q_offset.., kv the latents up to the chunk's end;
        reduce=False returns (sum of the per-query KLs, number of queries counted).
        """
        x, q_latent, q_attn, kv = x.detach(), q_latent.detach(), q_attn.detach(), kv.detach()
        chunk = self.chunk if chunk is _DEFAULT else chunk
        if not dense and selection is None:
            raise ValueError("KPoolIndexer.kl_loss: the sparse variant needs the selection it is trained on.")
        S = x.shape[1]
        P = self.pool
        step = S if chunk is None else chunk
        with torch.enable_grad():
            if pk is None:
                k, gate = self.key_rows(x)
                n = S // P * P
                pk = self.pool_keys(k[:, :n], gate[:, :n]) if n else k[:, :0]
            total = pk.sum() * 0.0  # keeps the result attached to the graph when no query counts
            count = torch.zeros((), device=x.device)
            for s0 in range(0, S, step):
                s1 = min(S, s0 + step)
                args = (pk, x[:, s0:s1], q_latent[:, s0:s1], q_attn[:, s0:s1], kv,
                        None if dense else selection[:, s0:s1], q_offset + s0, scale)
                if torch.is_grad_enabled() and pk.requires_grad:
                    kl, cnt = checkpoint(self._kl_block, *args, use_reentrant=False)
                else:
                    kl, cnt = self._kl_block(*args)
                total = total + kl
                count = count + cnt
            return total / count.clamp(min=1) if reduce else (total, count)

    def _kl_block(self, pk, x, q_latent, q_attn, kv, sel, s0, scale):
        B, c = x.shape[:2]
        P = self.pool
        n = min(pk.shape[1], (s0 + c) // P)
        if n == 0:
            return pk.sum() * 0.0, torch.zeros((), device=x.device)
        pos = torch.arange(s0, s0 + c, device=x.device)
        with torch.no_grad():
            acc = torch.promote_types(q_attn.dtype, torch.float32)
            ends = torch.arange(n, device=x.device) * P + (P - 1)
            if sel is None:
                keys = kv[:, : s0 + c].to(acc)
                logits = torch.einsum("bchd,bkd->bchk", q_attn.to(acc), keys) * scale
                causal = torch.arange(s0 + c, device=x.device)[None, :] <= pos[:, None]
                prob = logits.masked_fill(~causal[None, :, None], float("-inf")).softmax(-1).sum(2)
                mass = prob[..., : n * P].reshape(B, c, n, P).sum(-1)
                support = (ends[None, :] <= pos[:, None]).expand(B, c, n)
            else:
                valid = sel >= 0
                flat = (sel.clamp(min=0).long() + torch.arange(B, device=x.device)[:, None, None] * kv.shape[1]).flatten()
                rows = kv.reshape(-1, kv.shape[-1]).index_select(0, flat).view(B, c, -1, kv.shape[-1]).to(acc)
                logits = torch.einsum("bchd,bcwd->bchw", q_attn.to(acc), rows) * scale
                logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
                prob = torch.nan_to_num(logits.softmax(-1), nan=0.0).sum(2)  # [B, c, W]
                pid = sel.clamp(min=0).long() // P
                in_pool = valid & (pid * P + (P - 1) <= pos[:, None]) & (pid < n)
                pid = pid.clamp(max=n - 1)
                mass = prob.new_zeros(B, c, n).scatter_add_(-1, pid, prob * in_pool)
                support = torch.zeros(B, c, n, dtype=torch.int32, device=x.device)
                support = support.scatter_add_(-1, pid, in_pool.to(torch.int32)) > 0
            mass = mass * support
            tot = mass.sum(-1, keepdim=True)
            ok = tot > 0
            target = mass / tot.clamp(min=torch.finfo(acc).tiny)
        score = self.pool_scores(q_latent, x, pk[:, :n])
        masked = score.masked_fill(~support, float("-inf")).masked_fill(~ok, 0.0)
        logq = masked.log_softmax(-1).masked_fill(~support, 0.0)
        kl = (torch.xlogy(target, target) - target * logq).sum(-1) * ok.squeeze(-1)
        return kl.sum(), ok.sum().to(kl.dtype)
