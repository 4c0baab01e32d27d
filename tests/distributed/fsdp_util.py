"""The model, data and optimizer the FSDP and checkpoint checks share (imported in the serving
processes too): the tiny preset shrunk to hidden 16 (KKKD, dense + MoE, mHC), batches of 8
sequences of 12 tokens with some labels masked, so that ranks hold different label counts."""

from __future__ import annotations

import torch

B, S = 8, 12
LR = 1e-3


def tiny_config():
    from longctx.config import preset

    return preset("tiny").replace(hidden_size=16, kda_heads=2, kda_head_dim=8, attn_heads=2, q_lora_rank=8,
                                  kv_lora_rank=8, qk_nope_head_dim=4, v_head_dim=4, index_heads=1, index_head_dim=4,
                                  index_topk=4, intermediate_size=16, moe_intermediate_size=8)


def build(seed: int = 0):
    """The model with its own initialisation, the same on every rank (on the CPU every op takes its
    plain-torch path)."""
    from longctx.model import LongCtxModel

    torch.manual_seed(seed)
    model = LongCtxModel(tiny_config())
    model.loss_chunk = None
    return model


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 97, (B, S + 1), generator=g)
    y = x[:, 1:].clone()
    y[torch.rand(B, S, generator=g) < 0.3] = -100  # uneven label counts per rank
    y[0, :] = -100  # one sequence without a label
    return x[:, :-1].contiguous(), y


def optimizer(model):
    # Adam's first step divides each gradient element by its own magnitude (+ eps). Elements that are
    # zero in exact arithmetic (many of mHC's projection at its identical initial streams) are
    # rounding noise of ~1e-7 of the largest; a small eps would turn that noise into whole lr steps.
    # eps = lr keeps the noise at lr * 1e-7 / eps while a real gradient still moves its parameter.
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=LR, weight_decay=0.1, betas=(0.9, 0.95))




def rank_rows(x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's consecutive rows of the global batch."""
    per = x.shape[0] // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def model_piece(model, xm, ym, n) -> float:
    """One micro-batch's backward of its share of the global mean over `n` labels; returns the share."""
    part = model(xm, labels=ym, return_logits=False).lm_loss * ((ym != -100).sum() / n)
    part.backward()
    return part.item()


def one_process_step(model, opt, x, y, pieces: int, piece=model_piece) -> dict:
    """The single-process reference step: the loss and gradients of the whole batch taken in `pieces`
    consecutive micro-batches (each weighted by its share of the labels, the grouping of sums the
    sharded runs follow; `piece(model, xm, ym, n)` runs one), the clipped gradient norm, and the
    parameters after the optimizer step."""
    from longctx.distributed.fsdp import clip_grad_norm_

    n = (y != -100).sum()
    loss = sum(piece(model, xm, ym, n) for xm, ym in zip(x.chunk(pieces), y.chunk(pieces)))
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    norm = clip_grad_norm_(list(model.parameters()), 0.5)
    opt.step()
    return {"loss": loss, "grads": grads, "norm": float(norm),
            "params": {k: p.detach().clone() for k, p in model.named_parameters()}}


def step_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|, or over one step's length (lr) where the parameter is smaller: a
    zero-initialised parameter (mHC's bias) whose gradient is rounding noise stays ~1e-18."""
    return float((a - b).abs().max() / max(b.abs().max().item(), LR))


def order_noise(want: dict, one: dict) -> dict:
    """How far each gradient of the one-process reference `want` moves when the same batch is summed in
    one piece (`one`, the same step run with pieces=1): the fp32 order sensitivity of that sum. mHC's
    residual scales at the initial point (identical streams) are sums with heavy cancellation that move
    by 1e-5..2e-5 of their size this way alone, depending on the CPU's BLAS; the rest by less than 1e-5."""
    from cp_util import rel

    noise = {f"grad {k}": rel(one["grads"][k], g) for k, g in want["grads"].items()}
    assert max(noise.values()) < 1e-4, noise  # the cancellation is rounding, not a different function
    return noise


def errors_above(errs: dict, tol: float, noise: dict) -> dict:
    """The errors above `tol`, or above twice the order noise where that is the larger."""
    return {k: v for k, v in errs.items() if not v <= max(tol, 2 * noise.get(k, 0.0))}


def step_errors(model, opt, loss: torch.Tensor, want: dict) -> dict:
    """A sharded step against `one_process_step`'s: the relative error of the summed loss (`loss`, this
    rank's share, all-reduced here), of every gradient and the clipped norm, then of every parameter
    after the optimizer step (which this runs)."""
    import torch.distributed as dist

    from cp_util import rel
    from longctx.distributed.fsdp import clip_grad_norm_

    loss = loss.detach().clone()
    dist.all_reduce(loss)
    errs = {"loss": abs(loss.item() - want["loss"]) / abs(want["loss"])}
    for k, p in model.named_parameters():  # the indexer gets no gradient from the LM loss, here as there
        errs[f"grad {k}"] = rel(None if p.grad is None else p.grad.full_tensor(), want["grads"].get(k))
    norm = clip_grad_norm_(list(model.parameters()), 0.5)
    errs["grad norm"] = abs(float(norm) - want["norm"]) / want["norm"]
    opt.step()
    for k, p in model.named_parameters():
        errs[f"param {k}"] = step_rel(p.detach().full_tensor(), want["params"][k])
    return errs


class CountedCollectives:
    """Counts the all-gathers and reduce-scatters FSDP runs while the context is open (torch 2.13 calls
    the single-tensor entry points, older versions the *_tensor ones)."""

    NAMES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor")

    def __init__(self):
        self.counts = {"all_gather": 0, "reduce_scatter": 0}

    def __enter__(self):
        import torch.distributed as dist

        self._real = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}
        for name, fn in self._real.items():
            setattr(dist, name, self._counted(name, fn))
        return self

    def _counted(self, name, fn):
        kind = "all_gather" if name.startswith("all_gather") else "reduce_scatter"

        def counted(*a, **k):
            self.counts[kind] += 1
            return fn(*a, **k)

        return counted

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, fn in self._real.items():
            setattr(dist, name, fn)
        return False
