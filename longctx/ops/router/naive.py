"""The router's logits in fp32, the plain way: x cast to fp32 and multiplied by the fp32 weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Fp32Logits(torch.autograd.Function):
    """x.float() @ W^T that saves x in its own dtype: plain autograd would keep the fp32 copy of x
    (4 bytes x hidden per token, 16 GiB per layer at 1M tokens) for the weight gradient; here the
    cast is redone in backward instead (the 1M-token GLM-5.3-Flash training report's "no fp32
    copies")."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        with torch.autocast(x.device.type, enabled=False):  # autocast would redo it in bf16
            return F.linear(x.float(), weight.float())

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g = g.float()
        gx = (g @ weight.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = (g.t() @ x.float()).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw


def router_logits_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return Fp32Logits.apply(x, weight)
