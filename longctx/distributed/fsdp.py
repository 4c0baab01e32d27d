"""Fully sharded data parallelism for LongCtxModel: torch's FSDP2 (`fully_shard`) applied from outside.

    mesh = build_mesh(world, ParallelConfig(cp=2))            # (dp, cp)
    model = parallelize(model, mesh)                           # after CP / recompute set-up, before the optimizer
    opt = make_optimizer(model, ...)                           # over the DTensor parameters
    loss = loss_share(out.lm_loss, labels, mesh)               # this rank's share of the global mean
    loss.backward(); clip_grad_norm_(model.parameters(), 1.0); opt.step()

What is sharded, over what. One FSDP unit per block of `model.layers`, then the root (embedding, the
residual stream's own parameters, final norm and LM head, tied or not), so that at any time one
block's parameters are whole. The units shard over *all* ranks of the (dp, cp) mesh, flattened:
the cp ranks of a sequence hold the same parameters and each computes a part of their gradient
(its tokens' share), so sharding over cp as well divides parameter, gradient and optimizer bytes by
dp x cp instead of dp, and the reduce-scatter that FSDP runs anyway over the flattened group is the
very sum over cp that context parallelism needs (see `longctx.distributed`). The all-gathers then
also cross the cp ranks, which is where a sequence's exchanges already run.

Expert parallelism (`expert_parallel.apply_expert_parallel`, applied first) makes each MoE's routed
experts a DTensor over the ep ranks; `parallelize` gives them an FSDP unit of their own over the
efsdp ranks (those holding the same experts), so each rank keeps 1 / (ep x efsdp) = 1 / world of the
routed-expert bytes, and their gradient reduce-scatter sums over efsdp what the all-to-all's
backward already summed over ep.

Gradient scale. Every rank's loss is its share of the global mean (`loss_share`: the token-loss sum
over the rank's tokens divided by the label count of all ranks), so the single-process gradient is
the *sum* of the ranks' gradients; FSDP's default divides by the group size (a mean of per-rank
means), which is right only when every rank holds as many labels. The units here sum
(`set_gradient_divide_factor(1)`, with sum-only collectives: gloo has no pre-scaled sum).

Precision. `param_dtype` is what the all-gather delivers to the compute: None keeps the fp32
parameters (the single-GPU numerics, with autocast giving bf16 matmuls), "auto" is bf16 on CUDA
and fp32 elsewhere, or a dtype. Gradients are reduced in `reduce_dtype` (fp32) and the optimizer
steps the fp32 shards. When the parameters are gathered below fp32, each MoE router is a unit of
its own that stays fp32: its sigmoid scores choose the experts and its bias steps are small (HF
keeps the router fp32; `Router` documents why).

Recompute. `longctx.memory.recompute` runs each block through `block(...)` — its module call — in
the no-grad forward and again in backward, so FSDP's hooks on the block fire both times: the
forward all-gathers and reshards, the recompute all-gathers again and registers FSDP's backward
hooks on its outputs, and the Function's inner `torch.autograd.backward` fires them (the
reduce-scatter of the block's gradient runs there). FSDP does not reshard after a forward that runs
inside backward, so the recompute's gathered parameters serve its backward: two all-gathers and one
reduce-scatter per block per step, as without recompute (a test counts them).

The sequence-chunked step (memory/sequence_chunks.py) calls the root's `embed_state`, `norm` and
`chunked_token_losses` itself, chunk by chunk, rather than `model.forward`. FSDP gathers a unit's
parameters only around a forward, so the step runs each sweep and each chunk's graph through
`model.call` (`model.CallsAsForward`), which `parallelize` registers as a forward method of the
root: the root is gathered around it (and stays so: reshard_after_forward=False), and since `call`
takes no tensors FSDP hooks no input, so the root's gradients are reduced by the final callback at
the end of each backward, after the embedding's (a hook on a chunk's carries or latent rows could
fire before the embedding's gradient arrived). The indexer KL, which that step builds outside its
block's checkpoint, runs through the block's `call`: its graph reaches only the indexer's
parameters, and its backward nodes, created after the block's and ready from the loss on, run
before the block's post-backward (the autograd engine runs the ready node created last first).
Each chunk's backward is a micro-batch's: the chunks but the last run without gradient sync (`set_gradient_sync`), so the gradients are reduce-scattered once per
step and held unsharded in between, as one process holds them. The chunked step runs over the
data-parallel (and expert-parallel) ranks; a context-parallel rank's chunk would need the other
ranks' carries and latent rows chunk by chunk, which it does not exchange.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def shard_mesh(mesh):
    """The 1-D mesh FSDP shards over: all dims of a (dp, cp) mesh flattened ("dp_cp"), or the mesh
    itself when it has one dim."""
    if mesh.ndim == 1:
        return mesh
    name = "_".join(mesh.mesh_dim_names)
    try:  # torch 2.13 returns the existing flattened mesh on a second call
        return mesh[tuple(mesh.mesh_dim_names)]._flatten(name)
    except (KeyError, RuntimeError, ValueError):  # versions that refuse a second flatten of the same dims
        return mesh[name]


def _resolve_param_dtype(param_dtype, mesh):
    if isinstance(param_dtype, str):
        if param_dtype != "auto":
            from ..errors import ConfigError

            raise ConfigError(f"parallelize: param_dtype must be 'auto', None or a torch dtype (got {param_dtype!r}).")
        return torch.bfloat16 if mesh.device_type == "cuda" else None
    return None if param_dtype == torch.float32 else param_dtype


def _sum_gradients(module) -> None:
    module.set_gradient_divide_factor(1.0)
    if hasattr(module, "set_force_sum_reduction_for_comms"):
        module.set_force_sum_reduction_for_comms(True)


def parallelize(model, mesh, *, param_dtype=None, reduce_dtype=torch.float32, reshard_after_forward: bool = True):
    """Shard `model` (a LongCtxModel) in place with FSDP2 over every rank of `mesh` and return it.

    Apply after the model is on its device and after anything that replaces its modules, before the
    optimizer is built (it must see the sharded DTensor parameters). `model.block_fn` (recompute,
    offload) keeps working: it calls the blocks."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    from ..layers.moe import MoE, Router

    fsdp_mesh = shard_mesh(mesh)
    dtype = _resolve_param_dtype(param_dtype, mesh)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
    units = []
    if dtype is not None:
        # its input stays as it comes: the router saves x in the activation dtype for backward, and
        # an fp32 cast here would double what it keeps (the memory plan's "no fp32 copies" rule)
        keep = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
        for m in model.modules():
            if isinstance(m, Router):
                units.append(fully_shard(m, mesh=fsdp_mesh, mp_policy=keep, reshard_after_forward=reshard_after_forward))
    for m in model.modules():
        if isinstance(m, MoE) and m.expert_parallel is not None:
            units.append(_shard_experts(m.experts, m.expert_parallel.mesh, policy, reshard_after_forward))
    for block in model.layers:
        units.append(fully_shard(block, mesh=fsdp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward))
        register_fsdp_forward_method(block, "call")
    # the root stays gathered from its forward to its backward, which opens with the LM head: FSDP's
    # own choice for a root, and one all-gather fewer for the price of holding embedding + head
    units.append(fully_shard(model, mesh=fsdp_mesh, mp_policy=policy, reshard_after_forward=False))
    register_fsdp_forward_method(model, "call")  # the sequence-chunked step drives the trunk through it
    for u in units:
        _sum_gradients(u)
    return model


def _shard_experts(experts, expert_mesh, policy, reshard_after_forward: bool):
    """An expert-parallel rank's experts (DTensors Shard(0) over the ep dim) as an FSDP unit of their
    own over the efsdp dim: the ranks holding the same experts. FSDP shards dim 1 (gate/up rows,
    hidden rows) where it divides evenly, so each dim has one sharding and DTensor's redistribution
    is one all-gather per dim; else dim 0, which DTensor expresses as a strided shard of the ep shard."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    efsdp = expert_mesh["efsdp"]
    n = efsdp.size()

    def placement(p):
        return Shard(1) if p.ndim > 1 and p.shape[1] % n == 0 else Shard(0)

    return fully_shard(experts, mesh=efsdp, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                       shard_placement_fn=placement)


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


# ---------------------------------------------------------------------- the step around a sharded model
def loss_share(lm_loss: torch.Tensor, labels: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's share of the global mean token loss, from the model's `lm_loss` (the mean over
    this rank's labels): scaled by this rank's label count over that of all ranks in `group` (a
    process group or a mesh; None: this process alone). Summed over the ranks it is the
    single-process loss; backpropagated, the summed gradients are its gradient. A rank without
    labels contributes 0."""
    n = (labels != -100).sum()
    if group is None:
        return lm_loss
    if hasattr(group, "get_group"):
        group = shard_mesh(group).get_group()
    n_all = n.clone()
    dist.all_reduce(n_all, op=dist.ReduceOp.SUM, group=group)
    return lm_loss * (n / n_all.clamp(min=1)).to(lm_loss.dtype)


def set_gradient_sync(model, sync: bool) -> None:
    """Whether the next backward reduce-scatters the gradients: off for every micro-batch but the
    last of an accumulated step, so the gradients are reduced once per step (FSDP keeps the
    unsharded gradient of the earlier micro-batches until then)."""
    if is_sharded(model):
        model.set_requires_gradient_sync(sync)


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for sharded (DTensor) gradients as well as plain ones: the norm
    of the whole gradient over all shards, every gradient scaled by the same factor on every rank.
    Returns the total norm as a plain tensor (the same on every rank)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    # one norm per device mesh: the experts of expert parallelism live on the (efsdp, ep) mesh, the
    # rest on the (dp, cp) one, and DTensor reduces only over one mesh at a time
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=norm_type)
        if isinstance(norm, DTensor):  # a partial sum over the shards: reduce it to the whole norm
            norm = norm.full_tensor()
        norms.append(norm)
    norm = norms[0] if len(norms) == 1 else torch.nn.utils.get_total_norm(norms, norm_type=norm_type)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm
