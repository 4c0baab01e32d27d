"""Expert parallelism: each rank of an ep group holds 1/ep of every MoE layer's routed experts, and
the (token, expert) rows of every rank travel to the rank holding their expert and back.

    mesh = build_mesh(world, ParallelConfig(ep=2))     # the (dp, cp) mesh; ep groups its flattened ranks
    apply_expert_parallel(model, mesh, ep=2)            # before parallelize: the experts become DTensors
    parallelize(model, mesh)                            # the dense part over all ranks, the experts over efsdp
    attach_statistics(model, statistics_group(mesh))    # routing statistics over all ranks' tokens, as before

Layout. The world's ranks, flattened dp-major from the (dp, cp) mesh, form an expert mesh of shape
(efsdp, ep) = (world / ep, ep) (`mesh.expert_mesh`): an ep group is `ep` consecutive global ranks
(neighbouring GPUs), and ep rank j holds the experts [j E/ep, (j+1) E/ep) of every MoE layer as a
DTensor Shard(0) over the ep dim, so torch.distributed.checkpoint knows each expert tensor by its
global shape [E, ...] and saves or loads it at any world size. The ranks with the same ep index (one
per ep group, `efsdp` of them) hold the same experts: FSDP2 shards those over the efsdp dim
(`parallelize`), while the router, the shared expert and the rest of the model stay sharded over
all ranks as without ep. Routing is untouched: every rank routes its own tokens with the whole
(replicated) router, and the balancer's statistics stay those of all ranks' tokens (`balance`).

One chunk of an MoE forward (`ExpertParallel.run`, called by `MoE._chunk` in place of the experts):
the rows x[token] arrive sorted by global expert, hence grouped by owner rank. An all-to-all of the
per-expert int64 counts tells every rank how many rows of each source it gets for each of its
experts; the rows follow in one all-to-all with those variable splits (source-major), are put
expert-major (a stable sort of their expert index: within an expert, sources in rank order) for the
experts' one grouped GEMM or loop, and go back by the reverse all-to-all in the order they came;
the caller's combine then sums them per token in token order (`_WeightedCombine`), so the result
does not depend on the arrival order. Backward is the adjoint exchange (autograd through the
functional all-to-all), so a rank's expert gradient sums over the tokens of its whole ep group and
FSDP's reduce-scatter over efsdp adds the other groups': the sum over all ranks, the convention of
`fsdp.loss_share`.

Every rank of an ep group must take part in every exchange, so the ranks agree on the number of
chunks (an all-reduce MAX of their chunk counts, `rounds`); a rank with fewer tokens runs empty
chunks, and a rank without tokens still serves its experts.

Bytes per MoE layer per rank and forward, with m tokens on the rank, top-k routing, hidden h and
activation bytes b: the rows leaving the rank for other ranks' experts, m k (ep - 1)/ep h b when
routing is even, go out and the same number of output rows come back, so about 2 m k h b (ep-1)/ep
sent and as many received, plus 8 E bytes of counts per chunk; backward sends the same again.

Why our own dispatch: torch offers the variable-split all-to-all and DTensor but no MoE token
exchange; the layer keeps its own sort / grouped GEMM / combine, and this module only moves rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from . import comm


class ExpertParallel:
    """What an MoE calls on its `expert_parallel` attribute (the layers sit below
    longctx.distributed, so `apply_expert_parallel` hands each MoE this object)."""

    def __init__(self, mesh, n_experts: int):
        self.mesh = mesh  # the (efsdp, ep) expert mesh
        self.group = mesh.get_group("ep")
        self.size = mesh.size(mesh.mesh_dim_names.index("ep"))
        self.rank = mesh.get_local_rank("ep")
        self.n_experts = n_experts
        self.n_local = n_experts // self.size

    def rounds(self, n_chunks: int, device=None) -> int:
        """The chunk count every rank of the ep group runs: the largest of theirs."""
        t = torch.tensor([n_chunks], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def run(self, experts: nn.Module, xs: torch.Tensor, counts: torch.Tensor, impl: str) -> torch.Tensor:
        """`experts(xs, counts, impl)` for rows xs [N, h] sorted by global expert and counts [E] per
        global expert, where `experts` holds this rank's E/ep experts: the same [N, h] output rows."""
        ep, n_local = self.size, self.n_local
        send_counts = counts.view(ep, n_local).contiguous()  # row j: this rank's rows for rank j's experts
        recv_counts = torch.empty_like(send_counts)  # row s: rank s's rows for each of this rank's experts
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()  # the splits live on the host
        xr = comm.all_to_all_v(xs, recv, send, self.group)  # source-major, expert-major within a source
        expert_of_row = torch.arange(n_local, device=xs.device).repeat(ep).repeat_interleave(recv_counts.flatten())
        order = expert_of_row.argsort(stable=True)  # expert-major, sources in rank order within an expert
        ys = experts(xr[order], recv_counts.sum(0), impl)
        if xr.requires_grad and not ys.requires_grad:  # no rows came: the experts' output is a fresh zero tensor
            ys = comm.keep_in_graph(ys, xr)  # and this rank must still run the exchange's backward with the others
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        return comm.all_to_all_v(ys[inv], send, recv, self.group)  # back in the order xs came


def moe_layers(model) -> list:
    from ..layers.moe import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


@torch.no_grad()
def apply_expert_parallel(model, mesh, ep: int) -> int:
    """Give every MoE of `model` 1/ep of its routed experts (this rank's, as DTensors over the ep dim
    of `mesh.expert_mesh(mesh, ep)`) and the ExpertParallel that exchanges their rows; returns how
    many MoE layers took it. ep = 1 changes nothing. Apply before `parallelize` and before the
    optimizer; every rank must hold the same initial experts (the same seed), as FSDP assumes too."""
    from torch.distributed.tensor import DTensor, Shard

    from .mesh import expert_mesh

    layers = moe_layers(model)
    if ep == 1 or not layers:
        return 0
    emesh = expert_mesh(mesh, ep)
    for m in layers:
        if m.n_experts % ep:
            raise ConfigError(f"model.n_routed_experts = {m.n_experts} is not a multiple of parallel.ep = {ep}; "
                              f"choose an ep that divides {m.n_experts}.")
        ctx = ExpertParallel(emesh, m.n_experts)
        lo, hi = ctx.rank * ctx.n_local, (ctx.rank + 1) * ctx.n_local
        for name in ("gate_up", "down"):
            p = getattr(m.experts, name)
            if isinstance(p, DTensor):
                raise RuntimeError("apply_expert_parallel: the experts are DTensors already (applied twice, or "
                                   "after parallelize); apply it once, before parallelize.")
            local = DTensor.from_local(p.detach()[lo:hi].clone(), emesh["ep"], [Shard(0)], run_check=False)
            setattr(m.experts, name, nn.Parameter(local, requires_grad=p.requires_grad))
        m.expert_parallel = ctx
    return len(layers)


def expert_bytes(model) -> int:
    """The bytes of routed-expert parameters this rank holds (local shards of DTensors)."""
    total = 0
    for m in moe_layers(model):
        for p in (m.experts.gate_up, m.experts.down):
            t = p.to_local() if hasattr(p, "to_local") else p
            total += t.numel() * t.element_size()
    return total
