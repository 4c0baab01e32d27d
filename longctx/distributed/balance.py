"""MoE routing statistics over every rank's tokens: the quantile balancer's bias, the per-expert load
and the auxiliary loss, equal to what one process holding all the tokens computes.

Under data or context parallelism each rank routes only its own tokens, but the balancer's
statistics are defined over all tokens of the step (SPEC, "Quantile balancing"): per token,
alpha_i = (k+1)-th largest of s_i + bias (the token's own row, so it stays local); per expert,
beta_j = (q+1)-th largest over *all* tokens i of s_ij - alpha_i with q = M k / n for the global
token count M. The second is an order statistic of a column spread over ranks, which no sum of
per-rank statistics gives; `kth_largest` computes it exactly:

    a radix select on the order-preserving 32-bit image of the fp32 values, one byte per round from
    the top. Each round every rank histograms the next byte of its values whose higher bytes match
    the prefix chosen so far, the [n, 255] int64 histograms are all-reduced (byte 0's count is the
    rest), and each column keeps the byte in which its k-th largest falls. After 4 rounds the
    prefix is the whole key, the bit pattern of a value present on some rank: the fp32 value topk
    would return, bit for bit (up to the sign of a zero and the payload of a NaN, which fp32
    comparisons do not tell apart).

Bytes: 4 rounds x n x 255 x 8 ~ 8 KiB x n per call (2.2 MiB for GLM-5.3-Flash's 288 experts),
whatever the token count; per rank, 4 histogram passes over its own [n, m_local] values.
Bisection (`bits=1`: one threshold per column per round, 32 rounds of an [n] int64 count) sends
1/32 of the bytes (72 KiB at 288 experts) but pays 32 all-reduce latencies and 32 passes over the
values instead of 4. A round of either moves a few KiB to a few MiB, so its cost is mostly the
collective's latency (tens of microseconds): 4 rounds beat 32 wherever a latency exceeds the time
to move 2 MiB, and bisection stays an option (`bits`). All-gathering the candidates instead (each
rank's local top-(q+1) per expert) sends O(q n) = O(M k) values, 32 MB per rank at 1M tokens and
top-8. Every rank runs the same rounds and decides from the same all-reduced counts, so all ranks
take every branch together (the balancer's early stop too).

    bias = quantile_bias(scores, bias, k, iters, tol, group=group)   # moe.quantile_bias + group
    load = global_load(counts, group)                                 # tokens per expert, all ranks
    aux = aux_loss_share(load, prob_sum, m, n, k, coef, group)        # this rank's share of the aux loss

`group` is the process group of every rank whose tokens one single-process forward would see: the
whole dp x cp mesh when a stage's batch is split over data-parallel ranks and each sequence over
context-parallel ones (`statistics_group`). `attach_statistics(model, group)` hands every MoE a
`GlobalStatistics` with these three as methods.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
RADIX_BITS = 8  # digits per round of the k-th largest: 4 rounds (see the module docstring)


def statistics_group(mesh):
    """The process group over all ranks of a (dp, cp) DeviceMesh: the tokens of one global batch."""
    from .fsdp import shard_mesh

    return shard_mesh(mesh).get_group()


def _ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """int32 keys whose order is the fp32 order of x (as topk sees it: NaN above +inf, -0 == +0)."""
    x = x.float()
    x = torch.where(x == 0, torch.zeros((), dtype=x.dtype, device=x.device), x)  # -0 -> +0
    x = torch.where(x.isnan(), torch.full((), float("nan"), dtype=x.dtype, device=x.device), x)  # one positive NaN
    i = x.contiguous().view(torch.int32)
    # negative floats grow in magnitude as their bits grow: flipping the 31 magnitude bits reverses them
    return torch.where(i < 0, i ^ _INT32_MAX, i)


def _values_of_keys(key: torch.Tensor) -> torch.Tensor:
    key = key.to(torch.int32)
    return torch.where(key < 0, key ^ _INT32_MAX, key).view(torch.float32)


def kth_largest(x: torch.Tensor, k: int, group=None, bits: int = RADIX_BITS, total: int | None = None) -> torch.Tensor:
    """The k-th largest (k >= 1) of each row of x [rows, cols] over the columns of every rank in
    `group` (ranks may hold different numbers of columns, zero included); fp32 [rows].

    A radix select on the order-preserving 32-bit keys, `bits` per round from the top: 32 / bits
    rounds, each one all-reduce of an [rows, 2^bits - 1] int64 histogram (bits=1: bisection, an
    [rows] count per round). `total`: the columns of all ranks when the caller knows it (else one
    more all-reduce finds it). Without a group it is x.topk(k, dim=1).values[:, -1]. k must not
    exceed the total column count."""
    if group is None:
        return x.float().topk(k, dim=1).values[:, -1]
    if bits not in (1, 2, 4, 8, 16):
        raise ValueError(f"kth_largest: bits must divide 32 and be at most 16 (got {bits})")
    rows, B = x.shape[0], 1 << bits
    dev = x.device
    if total is None:
        total = token_count(x.shape[1], group, dev)
    u = _ordered_keys(x) ^ _INT32_MIN  # the bits of u, read as unsigned, are in fp32 order
    base = torch.arange(rows, device=dev, dtype=torch.int64)[:, None] * (B + 1)  # a histogram per row, + a bin for the rest
    prefix = torch.zeros(rows, dtype=torch.int64, device=dev)  # the digits chosen so far, per row
    need = torch.full((rows,), k, dtype=torch.int64, device=dev)  # the answer's rank among the prefix's matches
    matching = torch.full((rows,), total, dtype=torch.int64, device=dev)  # values (all ranks) matching the prefix
    for shift in range(32 - bits, -1, -bits):
        digit = (u >> shift) & (B - 1)
        top = shift + bits
        if top < 32:  # only values whose higher digits are the chosen prefix take part
            match = ((u >> top) & ((1 << (32 - top)) - 1)) == prefix.to(torch.int32)[:, None]
            digit = torch.where(match, digit, B)
        # digit 0's count is `matching` less the others, so it is not sent
        hist = torch.bincount((base + digit).flatten(), minlength=rows * (B + 1)).view(rows, B + 1)[:, 1:B].contiguous()
        dist.all_reduce(hist, op=dist.ReduceOp.SUM, group=group)
        at_least = torch.cat([matching[:, None], hist.flip(1).cumsum(1).flip(1)], 1)  # [:, d]: matches with digit >= d
        d = (at_least >= need[:, None]).sum(1) - 1  # the largest digit that `need` matches reach (>= 0)
        above = torch.where(d + 1 < B, at_least.gather(1, (d + 1).clamp(max=B - 1)[:, None])[:, 0], 0)
        matching = at_least.gather(1, d[:, None])[:, 0] - above
        need = need - above
        prefix = prefix * B + d
    return _values_of_keys(prefix - 2**31)  # from the unsigned order back to the signed keys


def token_count(m: int, group=None, device=None) -> int:
    """The tokens of all ranks in `group` (m on this rank)."""
    if group is None:
        return m
    t = torch.tensor([m], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return int(t.item())


def global_load(load: torch.Tensor, group=None) -> torch.Tensor:
    """Tokens routed to each expert [n] summed over the ranks of `group` (no gradient)."""
    if group is None:
        return load
    out = load.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


@torch.no_grad()
def quantile_bias(scores: torch.Tensor, bias: torch.Tensor, k: int, iters: int = 1, tol: float = 0.0,
                  group=None) -> torch.Tensor:
    """`longctx.layers.moe.quantile_bias` over the tokens of every rank in `group`: this rank's
    scores [m_local, n] (m_local may differ between ranks, and be 0), the bias shared by all ranks.
    Returns the same new fp32 bias [n] on every rank, equal to the single-process one on the
    concatenated scores. group=None is the single-process function itself."""
    from ..layers.moe import expert_quota
    from ..layers.moe import quantile_bias as local_quantile_bias

    if group is None:
        return local_quantile_bias(scores, bias, k, iters, tol)
    s = scores.float()
    m_local, n = s.shape
    m = token_count(m_local, group, s.device)
    if k >= n or m < 2:  # every token takes every expert, or one token: nothing to balance
        return bias.detach().float().clone()
    q = expert_quota(m, n, k)
    mean = m * k / n
    b = bias.detach().float().clone()
    s_t = s.t().contiguous()
    for step in range(max(iters, 1)):
        top = (s + b).topk(k + 1, dim=1)
        if step > 0:
            load = global_load(torch.bincount(top.indices[:, :k].flatten(), minlength=n), group)
            if load.max().item() <= (1 + tol) * mean:  # the same all-reduced loads on every rank
                break
        alpha = top.values[:, k]  # (k+1)-th largest of s_i - beta: the token's own row
        b = -kth_largest(s_t - alpha[None, :], q + 1, group, total=m)  # (q+1)-th largest over all ranks' tokens
    return b


def aux_loss_share(load: torch.Tensor, prob_sum: torch.Tensor, m: int, n_experts: int, top_k: int, coef: float,
                   group=None) -> torch.Tensor:
    """This rank's share of the auxiliary balance loss coef * n * sum_j f_j P_j, where f_j is the
    fraction of all ranks' routed slots that went to expert j and P_j the mean over all ranks'
    tokens of the normalised router probability. `load` [n] and `prob_sum` [n] (differentiable) are
    this rank's; m its token count. The shares sum over the ranks to the single-process loss, and so
    do their gradients: the data-parallel gradient sum then gives the single-process gradient."""
    load_all = global_load(load.float(), group)
    m_all = token_count(m, group, load.device)
    f = load_all / (m_all * top_k)
    return coef * n_experts * (f * (prob_sum / m_all)).sum()


class GlobalStatistics:
    """An MoE's routing statistics over the tokens of every rank in `group`, as the methods an MoE
    calls on its `statistics` attribute (`attach_statistics` sets it): the layers sit below
    longctx.distributed and do not import it, so the parallel set-up hands each MoE this object."""

    def __init__(self, group):
        self.group = group

    def quantile_bias(self, scores, bias, k: int, iters: int = 1, tol: float = 0.0) -> torch.Tensor:
        return quantile_bias(scores, bias, k, iters, tol, group=self.group)

    def load(self, counts: torch.Tensor) -> torch.Tensor:
        return global_load(counts, self.group)

    def aux_loss(self, load, prob_sum, m: int, n_experts: int, top_k: int, coef: float) -> torch.Tensor:
        return aux_loss_share(load, prob_sum, m, n_experts, top_k, coef, group=self.group)


def attach_statistics(model, group) -> int:
    """Give every MoE of `model` routing statistics over `group` (see GlobalStatistics); returns how
    many MoE layers took them. group=None gives them back their own tokens' statistics."""
    from ..layers.moe import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for m in layers:
        m.statistics = None if group is None else GlobalStatistics(group)
    return len(layers)
