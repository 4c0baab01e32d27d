"""How far bf16 autocast moves a tiny model's gradients from fp32, with our torch mHC, on the CPU.

The yardstick for tests/test_gpu_mhc.py: liger's mHC differed from our torch mHC by 5.5% rel-RMS
over all gradients of this model on the H200; this prints how much the torch path alone drifts from
fp32 (and an fp32 residual update, to see whether the bf16 update is the cause).

    python bench/bf16_drift.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longctx.config import preset  # noqa: E402
from longctx.layers.residual import MHC  # noqa: E402
from longctx.model import LongCtxModel  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    model = LongCtxModel(preset("tiny").replace(layer_pattern="K", mlp_pattern="d"))  # as tests/test_gpu_mhc.py
    ids = torch.randint(0, 97, (1, 129))

    def grads(bf16: bool) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(ids[:, :-1], labels=ids[:, 1:])
        out.lm_loss.backward()
        return torch.cat([p.grad.flatten().double() for _, p in sorted(model.named_parameters()) if p.grad is not None])

    def rel(a, b):
        return ((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()

    fp32, bf16 = grads(False), grads(True)
    original = MHC.exit

    def exit_fp32(self, streams, ctx, y):  # the residual update summed in fp32, cast once
        post, comb, _ = ctx
        out = post.unsqueeze(-1) * y.float().unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams.float())
        return out.to(streams.dtype)

    MHC.exit = exit_fp32
    try:
        bf16_fp32_update = grads(True)
    finally:
        MHC.exit = original
    print(f"gradient rel-RMS, bf16 autocast vs fp32: torch mHC {rel(bf16, fp32):.4f}; "
          f"with an fp32 residual update {rel(bf16_fp32_update, fp32):.4f}; between the two {rel(bf16_fp32_update, bf16):.4f}")


if __name__ == "__main__":
    main()
