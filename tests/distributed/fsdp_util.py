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




def one_process_step(model, opt, x, y, pieces: int) -> dict:
    """The single-process reference step: the loss and gradients of the whole batch taken in `pieces`
    consecutive micro-batches (each weighted by its share of the labels, the grouping of sums the
    sharded runs follow), the clipped gradient norm, and the parameters after the optimizer step."""
    from longctx.distributed.fsdp import clip_grad_norm_

    n = (y != -100).sum()
    loss = 0.0
    for xm, ym in zip(x.chunk(pieces), y.chunk(pieces)):
        part = model(xm, labels=ym, return_logits=False).lm_loss * ((ym != -100).sum() / n)
        part.backward()
        loss += part.item()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    norm = clip_grad_norm_(list(model.parameters()), 0.5)
    opt.step()
    return {"loss": loss, "grads": grads, "norm": float(norm),
            "params": {k: p.detach().clone() for k, p in model.named_parameters()}}
