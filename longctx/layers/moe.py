"""Mixture of experts: sigmoid router with a selection bias, routed clamped-SwiGLU experts, a shared
expert, and the load balancers (quantile, sign-step, auxiliary loss, none).

Same function as GLM-5.3-Flash's MoE at inference: scores = sigmoid(x W^T) in fp32 (the logits by
`longctx.ops.router`, the setting kernels.router); experts are
*chosen* by scores + bias (group-limited when n_group > 1) but *weighted* by the unbiased scores,
normalised over the chosen k and scaled by routed_scaling_factor; plus a shared dense expert.

Training layout: the k * T (token, expert) pairs are sorted by expert so that each expert reads one
contiguous slice, run as one `torch._grouped_mm` on CUDA (it takes bf16 only) or a loop over experts
otherwise (`last_impl` says which ran), and put back in token order and summed per token by `_WeightedCombine`
(a permutation gather and a batched product; the fp32 combine, a memory switch turned off, uses `index_add_`).
Nothing of the router outlives the forward ("router release", as in the 1M-token GLM-5.3-Flash
training report: a tensor kept on the module pins a recomputed graph for the rest of backward).

Quantile balancing ("Optimizing Long Context Training and Inference for Trillion-Scale Sparse Models",
section 3; Su, "MoE环游记 6"). The balanced assignment is the LP
    max sum_ij x_ij s_ij  s.t.  sum_j x_ij = k (each token),  sum_i x_ij = q = m k / n (each expert)
whose dual has a price alpha_i per token and beta_j per expert: token i takes expert j iff
s_ij - beta_j > alpha_i, i.e. j is among the top k of s_i - beta. So the routing bias is
bias = -beta, and one dual step is
    alpha_i = (k+1)-th largest over j of (s_ij + bias_j)        (= s_ij - beta_j)
    beta_j  = (q+1)-th largest over i of (s_ij - alpha_i)      -> new bias = -beta
after which q tokens have s_ij - alpha_i > beta_j (up to ties): each expert's threshold admits q.
q = m k / n is rounded to the nearest integer (`expert_quota`).
The step is a coordinate step on the dual; from a cold start on skewed scores a single step
overshoots (the popular experts' tokens all move to the next-best expert), so `quantile_bias`
repeats it, warm-started from the current bias, until the routing it implies on this batch is within
`quantile_tol` of even (at most `quantile_iters` steps; `quantile_iters = 1` is the single-step rule).
The result replaces the bias; it is computed from batch t and used from batch t+1 on: forward only
records it as pending, `apply_balance_update()` (after the optimizer step) installs it. Several
training forwards before one apply (micro-batches) average their biases (sign-step: sum their loads),
so repeating a forward on the same batch changes nothing; a recompute inside backward (activation
checkpointing) is detected and touches no module state at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError
from ..ops import router as router_ops
from ..ops import swiglu as swiglu_ops
from .mlp import DenseMLP

IMPLS = ("auto", "grouped_mm", "loop")


# ----------------------------------------------------------------------------- routing maths
def select_experts(choice: torch.Tensor, k: int, n_group: int = 1, topk_group: int = 1) -> torch.Tensor:
    """Indices [t, k] of the experts with the largest `choice` [t, E], restricted (n_group > 1) to the
    `topk_group` groups whose two best choices sum highest."""
    if n_group > 1:
        t, n = choice.shape
        per = n // n_group
        group_score = choice.view(t, n_group, per).topk(2, dim=-1).values.sum(-1)
        keep_group = group_score.topk(topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep_group, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
    return choice.topk(k, dim=-1, sorted=False).indices


def expert_quota(m: int, n: int, k: int) -> int:
    """q = m k / n tokens per expert, rounded to the nearest integer (floor would under-fill and ceil
    over-fill every expert by up to one token), kept in [0, m-1] so the (q+1)-th largest exists."""
    return min(max((m * k + n // 2) // n, 0), m - 1)


@torch.no_grad()
def quantile_bias(scores: torch.Tensor, bias: torch.Tensor, k: int, iters: int = 1, tol: float = 0.0) -> torch.Tensor:
    """The quantile-balancing bias (= -beta) for the scores [m, n] of one batch, warm-started from `bias`.

    Runs at least one dual step and at most `iters`, stopping once routing this batch by the current
    bias gives max load / mean load <= 1 + tol. Returns a new fp32 tensor [n]; the caller decides
    when it takes effect."""
    s = scores.float()
    m, n = s.shape
    if k >= n or m < 2:  # every token takes every expert, or one token: nothing to balance
        return bias.detach().float().clone()
    q = expert_quota(m, n, k)
    mean = m * k / n
    b = bias.detach().float().clone()
    s_t = s.t().contiguous()  # the per-expert quantile reads rows: topk along a contiguous dim is ~5x faster
    for step in range(max(iters, 1)):
        top = (s + b).topk(k + 1, dim=1)
        if step > 0:
            load = torch.bincount(top.indices[:, :k].flatten(), minlength=n)
            if load.max().item() <= (1 + tol) * mean:
                break
        alpha = top.values[:, k]  # (k+1)-th largest of s_i - beta
        beta = (s_t - alpha[None, :]).topk(q + 1, dim=1).values[:, q]  # (q+1)-th largest over tokens
        b = -beta
    return b


def sign_step_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's bias step: raise under-loaded experts, lower over-loaded ones, by `rate`."""
    load = load.float()
    return bias.detach().float() + rate * torch.sign(load.mean() - load)


_REPLAY_DEPTH = [0]


class replaying:
    """Context: the forwards inside are re-runs of a forward already recorded (the backward sweep of
    the sequence-chunked step), so they must not touch the balance bookkeeping again."""

    def __enter__(self):
        _REPLAY_DEPTH[0] += 1
        return self

    def __exit__(self, *a):
        _REPLAY_DEPTH[0] -= 1
        return False


class RoutingTape:
    """Expert choices by token position, per MoE layer: recorded by one forward, replayed by later
    forwards over the same tokens.

    Why: a recompute that is not bit-identical to the forward it redoes (the sequence-chunked step
    rebuilds each chunk through other kernels than its prefill sweep used) can send a near-tied token
    to other experts; the gradient is then that of another function than the one whose carries it
    uses. At initialisation router scores are nearly tied and bf16 flips many choices (the
    trainer-vs-inference routing mismatch of the 1M-token GLM-5.3-Flash training report). Replaying the recorded indices makes the recompute route
    exactly as the forward did; the combine weights are still computed (and differentiated) afresh.

    `offset` is the sequence position of the next forward's first token (the chunked step sets it per
    chunk); a forward of T tokens reads positions [offset, offset + T) of any recording that covers
    them. Indices are kept as int16 when the expert count allows (16 MiB per MoE layer at 1M tokens,
    top-8).

    `live`: modules that route by themselves (and record) in the coming forward even while `replay` is
    on, with their balance bookkeeping, because no earlier forward ran them: the sequence-chunked
    step's forward sweep skips the last block's MoE (nothing reads its output), so the backward sweep's
    first pass over each chunk routes it, and that pass's recompute (with `live` emptied) replays it."""

    def __init__(self, replay: bool = False):
        self.replay, self.offset = replay, 0
        self.live: set = set()
        self._rec: dict = {}  # module -> list of (offset, [B, T, k] indices)

    def record(self, module, idx: torch.Tensor, batch: int) -> None:
        small = torch.int16 if module.n_experts <= torch.iinfo(torch.int16).max else torch.int32
        self._rec.setdefault(module, []).append((self.offset, idx.to(small).view(batch, -1, idx.shape[-1])))

    def put(self, module, idx: torch.Tensor, offset: int = 0) -> None:
        """Add a recording made elsewhere: [B, T, k] expert indices of positions [offset, offset + T) (the
        sampler's choices, replayed by RL's training forward)."""
        self._rec.setdefault(module, []).append((offset, idx))

    def recorded(self, module) -> list:
        """(offset, [B, T, k] indices) of each forward `module` recorded, in order."""
        return self._rec.get(module, [])

    def lookup(self, module, batch: int, tokens: int) -> torch.Tensor:
        """The recorded [batch * tokens, k] int64 indices of positions [offset, offset + tokens)."""
        for o, t in self._rec.get(module, ()):
            if o <= self.offset and self.offset + tokens <= o + t.shape[1] and t.shape[0] == batch:
                rows = t[:, self.offset - o : self.offset - o + tokens]
                return rows.reshape(batch * tokens, -1).long()
        raise RuntimeError(f"RoutingTape: no recorded routing for {batch} x {tokens} tokens at position "
                           f"{self.offset} of this MoE layer (recorded: "
                           f"{[(o, tuple(t.shape)) for o, t in self._rec.get(module, ())]})")

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for recs in self._rec.values() for _, t in recs)


_TAPE: list = [None]


class routing_tape:
    """Context: MoE forwards inside record into (or, when `tape.replay`, replay from) `tape`."""

    def __init__(self, tape: RoutingTape | None):
        self.tape = tape

    def __enter__(self):
        self._prev, _TAPE[0] = _TAPE[0], self.tape
        return self.tape

    def __exit__(self, *a):
        _TAPE[0] = self._prev
        return False


def _in_backward() -> bool:
    """True while autograd's engine runs (an activation-recompute forward) or during a replay."""
    return torch._C._current_graph_task_id() != -1 or _REPLAY_DEPTH[0] > 0


# ----------------------------------------------------------------------------- modules
class Router(nn.Module):
    """fp32 router weight [E, hidden] and the fp32 selection bias [E] (a persistent buffer, moved
    only by the balancer, never by the optimizer). Both stay fp32 through `model.to(bf16)`, as HF
    keeps its router in fp32: a bf16 bias could not hold the balancer's small steps."""

    def __init__(self, n_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, hidden, dtype=torch.float32))
        self.register_buffer("bias", torch.zeros(n_experts, dtype=torch.float32))
        self.kernels = {"router": "auto"}  # set by longctx.kernels.apply_kernels
        self.last_impl: str | None = None  # which ran (the step log's implementation report)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.weight.dtype != torch.float32:
            self.weight.data = self.weight.data.float()
        if self.bias.dtype != torch.float32:
            self.bias = self.bias.float()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        impl = router_ops.pick(self.kernels["router"], x, self.weight)
        self.last_impl = f"router:{impl}"
        return router_ops.router_logits(x, self.weight, impl).sigmoid()


class _GatherRows(torch.autograd.Function):
    """x[token] for token = order // k: each of the t rows k times, in expert order. Backward sums each row's
    k gradients, which sit at positions inv[t k .. t k + k - 1], with one embedding_bag: a gather and a sum in
    one deterministic pass. Autograd's backward of the index would zero-fill x's gradient and accumulate
    into it through index_put_, which on CUDA sorts the positions first."""

    @staticmethod
    def forward(ctx, x, token, inv, k):
        ctx.save_for_backward(inv)
        ctx.k = k
        return x[token]

    @staticmethod
    def backward(ctx, g):
        inv, = ctx.saved_tensors
        return F.embedding_bag(inv.view(-1, ctx.k), g, mode="sum"), None, None, None


class _WeightedCombine(torch.autograd.Function):
    """out[t] = sum_j w[t, j] * ys[row of (t, j)]: the experts' output rows (sorted by expert) put back
    in token order by a permutation gather and summed by a batched product. Backward keeps only ys (the
    weights' gradient needs it), w and the two permutations. The plain form,
    zeros.index_add_(0, token, ys * w), also keeps the [k x tokens, hidden] product (index_add_ saves
    its source): 12.3 KB per token and MoE layer at h200-ref, what the H200's allocation trace at the
    peak (`python bench/memory.py --peak S --peak-trace`) shows alive with it, 12.5 KB a token over the
    estimate's count (`tests/layers/test_moe.py` counts both on the CPU). Unlike index_add_, no atomics.
    `base` [t, hidden] (the shared expert's output, or None) is added in the product's epilogue (baddbmm),
    not by a separate add; its gradient is the output's."""

    @staticmethod
    def forward(ctx, ys, w, order, inv, base=None):
        (t, k), D = w.shape, ys.shape[-1]  # D named: a chunk with no tokens cannot infer it
        rows, wt = ys[inv].view(t, k, D), w.to(ys.dtype).unsqueeze(1)
        if base is None:
            out = torch.bmm(wt, rows).squeeze(1)
        else:
            out = torch.baddbmm(base.to(ys.dtype).unsqueeze(1), wt, rows).squeeze(1)
        ctx.save_for_backward(ys, w, order, inv)
        ctx.base_dtype = None if base is None else base.dtype
        return out

    @staticmethod
    def backward(ctx, g):
        ys, w, order, inv = ctx.saved_tensors
        t, k = w.shape
        g = g.to(ys.dtype)
        gbase = g.to(ctx.base_dtype) if ctx.base_dtype is not None and ctx.needs_input_grad[4] else None
        # in expert order, row p of ys is token order[p] // k's, weighted by w.flatten()[order[p]]: that
        # token's gradient, gathered once, serves both products (one [t k, hidden] tensor, not three)
        gt = g[order // k]
        gys = gw = None
        if ctx.needs_input_grad[1]:  # w[t, j]'s: ys' row (t, j) . g[t], back from expert order
            gw = torch.bmm(ys.unsqueeze(1), gt.unsqueeze(-1)).view(-1)[inv].view(t, k).to(w.dtype)
        if ctx.needs_input_grad[0]:  # row (t, j) of ys gets w[t, j] * g[t]
            gys = gt.mul_(w.flatten()[order].to(ys.dtype).unsqueeze(-1))
        return gys, gw, None, None, gbase


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p  # a DTensor's own shard (its gradient stays a DTensor)


class Experts(nn.Module):
    """All routed experts' weights as two 3-D tensors (HF's packed layout: gate rows, then up rows)."""

    def __init__(self, n_experts: int, hidden: int, intermediate: int, swiglu_limit: float):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(n_experts, 2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(n_experts, hidden, intermediate))
        self.intermediate = intermediate
        self.limit = swiglu_limit
        self.kernels = {"swiglu": "auto"}  # set by longctx.kernels.apply_kernels
        self.last_impl: str | None = None  # which ran (the step log's implementation report)

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        impl = swiglu_ops.pick(self.kernels["swiglu"], h)
        self.last_impl = f"swiglu:{impl}"
        return swiglu_ops.clamped_swiglu_packed(h, self.limit, impl)  # h: [rows, 2I], gate rows then up rows

    def forward(self, xs: torch.Tensor, counts: torch.Tensor, impl: str) -> torch.Tensor:
        """xs [N, hidden] sorted by expert, counts [E] rows per expert -> [N, hidden]. Under expert
        parallelism the weights are a DTensor of the ep ranks' experts and E is this rank's share:
        the rows here are those of its own experts, so it computes on its local tensor."""
        gate_up, down = _local(self.gate_up).to(xs.dtype), _local(self.down).to(xs.dtype)
        if impl == "grouped_mm":
            offs = counts.cumsum(0).to(torch.int32)
            h = torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(self._act(h), down.transpose(-2, -1), offs=offs)
        outs, start = [], 0
        for e, c in enumerate(counts.tolist()):
            if c:
                h = F.linear(xs[start : start + c], gate_up[e])
                outs.append(F.linear(self._act(h), down[e]))
                start += c
        return torch.cat(outs) if outs else xs.new_zeros(0, xs.shape[-1])


class MoE(nn.Module):
    """Routed experts + shared expert with a pluggable load balancer (see the module docstring).

    Switches set from outside (not part of the model config):
      chunk_tokens          run over the tokens in chunks of this size (peak independent of skew)
      combine_dtype         None: sum expert outputs in the activation dtype, keeping only the experts'
                            outputs for backward (_WeightedCombine); torch.float32: in fp32, the plain
                            index_add_ form (it keeps the fp32 products as well)
      release_router_state  True: keep nothing of the router after forward; False: keep the
                            detached scores, indices and weights of each chunk in `router_state`
      impl                  "auto" (grouped_mm on CUDA bf16, else loop), "grouped_mm" or "loop"
      quantile_iters, quantile_tol   see `quantile_bias`
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        E, k = cfg.n_routed_experts, cfg.experts_per_token
        if cfg.n_group > 1 and k > cfg.topk_group * (E // cfg.n_group):
            raise ConfigError(
                f"model.experts_per_token ({k}) exceeds the experts in the {cfg.topk_group} groups a token may use "
                f"({cfg.topk_group * (E // cfg.n_group)}); raise model.topk_group or lower model.experts_per_token."
            )
        self.layer_idx = layer_idx
        self.n_experts, self.top_k = E, k
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        self.balancer, self.balancer_rate, self.aux_loss_coef = cfg.balancer, cfg.balancer_rate, cfg.aux_loss_coef
        self.router = Router(E, cfg.hidden_size)
        self.experts = Experts(E, cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit)
        if cfg.n_shared_experts > 0:
            self.shared = DenseMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.swiglu_limit)
        else:
            self.shared = None
        nn.init.normal_(self.router.weight, std=cfg.init_std)
        nn.init.normal_(self.experts.gate_up, std=cfg.init_std)
        nn.init.normal_(self.experts.down, std=cfg.init_std)

        self.chunk_tokens: int | None = None
        self.combine_dtype: torch.dtype | None = None
        self.release_router_state = True
        self.impl = "auto"
        self.quantile_iters = 32
        self.quantile_tol = 0.01

        self.aux_loss: torch.Tensor | None = None
        self.last_load: torch.Tensor | None = None
        self.last_impl: str | None = None
        self.router_state: list[dict] | None = None
        # Routing statistics over other ranks' tokens as well (data / context parallel): an object with
        # load, aux_loss and quantile_bias (longctx.distributed.balance.GlobalStatistics, handed down by
        # attach_statistics); None = this process's tokens are all the tokens.
        self.statistics = None
        # Expert parallelism: an object whose `run(experts, xs, counts, impl)` takes the place of
        # `experts(xs, counts, impl)` (sends the rows to the ranks holding their experts and returns
        # their outputs in the same order) and whose `rounds(n, device)` is the chunk count every rank
        # of the ep group runs (longctx.distributed.expert_parallel.ExpertParallel, handed down by
        # apply_expert_parallel); None = this process holds every expert.
        self.expert_parallel = None
        self._reset_pending()

    # ------------------------------------------------------------------ balance bookkeeping
    def _reset_pending(self) -> None:
        # Accumulated over the forwards since the last apply (micro-batches): quantile averages the
        # per-forward biases, sign sums the loads. Identical forwards (a recompute that is not inside
        # backward) leave both unchanged, so the pending bias is idempotent.
        self._pending_sum: torch.Tensor | None = None
        self._pending_count = 0

    @property
    def pending_bias(self) -> torch.Tensor | None:
        """The bias that `apply_balance_update` will install, or None when there is nothing to apply."""
        if self._pending_sum is None:
            return None
        if self.balancer == "quantile":
            return self._pending_sum / self._pending_count
        return sign_step_bias(self.router.bias, self._pending_sum, self.balancer_rate)

    @torch.no_grad()
    def apply_balance_update(self) -> bool:
        """Install the pending bias (call after the optimizer step). Returns whether anything changed."""
        new = self.pending_bias
        self._reset_pending()
        if new is None:
            return False
        self.router.bias.copy_(new)
        return True

    @property
    def last_balance(self) -> float | None:
        """max expert load / mean load of the last forward (a host sync, so only when asked)."""
        if self.last_load is None:
            return None
        return (self.last_load.max() / self.last_load.mean().clamp_min(1e-20)).item()

    # ------------------------------------------------------------------ forward
    def _pick_impl(self, x: torch.Tensor) -> str:
        if self.impl not in IMPLS:
            raise ValueError(f"MoE.impl must be one of {IMPLS} (got {self.impl!r})")
        impl = self.impl
        if impl == "auto":
            grouped_ok = x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16
            impl = "grouped_mm" if grouped_ok else "loop"
        if impl == "grouped_mm":
            h, i = x.shape[-1], self.experts.intermediate
            if not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")) or h % 8 or i % 8:
                raise ValueError(
                    f"the grouped_mm experts path takes bf16 CUDA tensors with hidden and expert width multiples of 8; "
                    f"got {x.dtype} on {x.device} with hidden {h}, width {i}; set MoE.impl = 'loop'."
                )
        return impl

    def _chunk(self, x: torch.Tensor, impl: str, want_aux: bool, keep: list | None, forced: torch.Tensor | None = None):
        """Route and run one chunk of tokens x [t, h] (to the experts `forced` [t, k] when given: a
        replayed RoutingTape). Returns (output, detached scores, load, prob sum, expert indices)."""
        t, k = x.shape[0], self.top_k
        scores = self.router(x)  # [t, E] fp32, grad flows to router.weight through the weights
        if forced is not None:
            idx = forced
        else:
            with torch.no_grad():
                idx = select_experts(scores + self.router.bias, k, self.n_group, self.topk_group)
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * self.scaling

        flat = idx.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts)
        token = order // k
        inv = torch.empty_like(order)  # position of (token t, its j-th expert) in expert order: t k + j -> p
        inv[order] = torch.arange(order.numel(), device=order.device)
        xs = _GatherRows.apply(x, token, inv, k)
        if self.expert_parallel is None:
            ys = self.experts(xs, counts, impl)
        else:  # the rows go to their experts' ranks and come back in the same order
            ys = self.expert_parallel.run(self.experts, xs, counts, impl)
        cdtype = self.combine_dtype or x.dtype
        shared = self.shared(x) if self.shared is not None else None
        if cdtype == ys.dtype:  # the memory plan's moe_bf16_combine (on): keeps only ys for backward
            out = _WeightedCombine.apply(ys, w, order, inv, shared).to(x.dtype)
        else:  # fp32 combine (the switch off, a plain implementation): also keeps the fp32 products
            contrib = (ys * w.flatten()[order][:, None]).to(cdtype)
            out = torch.zeros(t, x.shape[-1], dtype=cdtype, device=x.device).index_add_(0, token, contrib).to(x.dtype)
            if shared is not None:
                out = out + shared
        prob_sum = (scores / scores.sum(-1, keepdim=True)).sum(0) if want_aux else None
        if keep is not None:
            keep.append({"scores": scores.detach(), "indices": idx, "weights": w.detach()})
        return out, scores.detach(), counts, prob_sum, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        m = x.shape[0]
        impl = self._pick_impl(x)
        tape = _TAPE[0]
        live = tape is not None and self in tape.live and torch._C._current_graph_task_id() == -1
        # a recompute in backward must not touch the module's state; a live pass is this forward's first
        record = live or not _in_backward()
        train = self.training and record
        want_aux = train and self.balancer == "aux" and torch.is_grad_enabled()

        ep = self.expert_parallel
        if m == 0 and ep is None:
            return x.new_zeros(shape)
        step = self.chunk_tokens or max(m, 1)
        if step < 1:
            raise ValueError(f"MoE.chunk_tokens must be >= 1 or None (got {self.chunk_tokens})")
        n_chunks = -(-m // step)
        if ep is not None:  # every rank of the ep group joins every exchange, with empty chunks if need be
            n_chunks = ep.rounds(n_chunks, x.device)
        keep = [] if record and not self.release_router_state else None
        batch = shape[0] if len(shape) == 3 else 1
        replay = tape is not None and tape.replay and not live
        forced = tape.lookup(self, batch, m // batch) if replay else None
        outs, scores, load, prob_sum, chosen = [], [], None, None, []
        for start in range(0, n_chunks * step, step):
            f = forced[start : start + step] if forced is not None else None
            o, s, c, p, idx = self._chunk(x[start : start + step], impl, want_aux, keep, f)
            if tape is not None and not replay:
                chosen.append(idx)
            outs.append(o)
            if train and self.balancer == "quantile":
                scores.append(s)
            load = c if load is None else load + c
            if p is not None:
                prob_sum = p if prob_sum is None else prob_sum + p
        out = torch.cat(outs) if len(outs) != 1 else outs[0]
        if chosen:
            tape.record(self, torch.cat(chosen) if len(chosen) != 1 else chosen[0], batch)

        st = self.statistics
        if record:
            self.last_impl = f"moe:{impl}"
            self.router_state = keep
            self.last_load = (load if st is None else st.load(load)).detach().float()
            self.aux_loss = None
        if want_aux:
            if st is not None:  # this rank's share: the shares sum to the loss over all ranks' tokens
                self.aux_loss = st.aux_loss(load, prob_sum, m, self.n_experts, self.top_k, self.aux_loss_coef)
            else:
                f = load.float() / (m * self.top_k)  # fraction of routed slots per expert (sums to 1)
                self.aux_loss = self.aux_loss_coef * self.n_experts * (f * (prob_sum / m)).sum()
        if train and self.balancer in ("quantile", "sign"):
            if self.balancer == "quantile":
                s_all = torch.cat(scores) if len(scores) != 1 else scores[0]
                qb = quantile_bias if st is None else st.quantile_bias
                new = qb(s_all, self.router.bias, self.top_k, self.quantile_iters, self.quantile_tol)
            else:  # the step's load over all ranks, so every rank moves the bias the same way
                new = self.last_load
            self._pending_sum = new if self._pending_sum is None else self._pending_sum + new
            self._pending_count += 1
        return out.reshape(shape)
