"""Benchmark: the LM head + cross entropy, fwd+bwd, our chunked torch head vs liger's fused linear + CE.

    python bench/fused_loss.py --out DIR [--quick] [--rows 65536,262144,1048576] [--modes bf16,amp]
    python bench/fused_loss.py --cpu-smoke --out DIR     # the torch side at tiny sizes on the CPU

h200-ref head: hidden 1536, vocab 32768, hidden states bf16, 1/8 of the rows ignore_index -100.
Modes: "bf16" (bf16 weight) and "amp" (fp32 master weight under bf16 autocast: what the trainer
runs). One step = the model's `chunked_token_losses` (or the liger call), loss = sum / n, backward
into the hidden states and the weight. Implementations:
  torch           kernels.loss "torch", loss_chunk 8192 (the memory plan's default), checkpointed chunks
  liger           kernels.loss "liger": reduction="none", LIGER_ROWS_PER_CALL rows per call (the model's path)
  liger_one_call  reduction="none", all rows in one call (liger's chunk then grows with the rows)
  liger_sum       reduction="sum" (grads computed in the forward; per-token losses not available)
Per case: median ms of fwd+bwd (CUDA events, after a compile step and a memory step), the peak allocated above the inputs
(hidden, labels, weight) during one step, the loss, and its relative difference from torch's.
Writes DIR/fused_loss.json (DIR/fused_loss_cpu_smoke.json for --cpu-smoke).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import env_record, timed, write_results

from longctx.model import LongCtxModel
from longctx.ops.loss import liger as fused_loss

GIB = 1 << 30


class Head(nn.Module):
    """The model's LM head + loss alone (the real `chunked_token_losses`)."""

    chunked_token_losses = LongCtxModel.chunked_token_losses

    def __init__(self, D: int, V: int, device, dtype, impl: str, loss_chunk: int | None):
        super().__init__()
        self.lm_head = nn.Linear(D, V, bias=False, device=device, dtype=dtype)
        nn.init.normal_(self.lm_head.weight, 0.0, 0.02)
        self.kernels, self.loss_chunk, self.last_impl = {"loss": impl}, loss_chunk, None


def make_step(impl: str, head: Head, h: torch.Tensor, y: torch.Tensor, autocast: bool):
    n = (y != -100).sum().clamp(min=1)
    dev = h.device.type

    def step():
        h.grad, head.lm_head.weight.grad = None, None
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
            if impl in ("torch", "liger"):
                head.kernels["loss"] = impl
                loss = head.chunked_token_losses(h[None], y[None]).sum() / n
            elif impl == "liger_one_call":
                loss = fused_loss.liger_token_losses(h, head.lm_head.weight, y).sum() / n
            elif impl == "liger_sum":
                loss = fused_loss.liger_loss_sum(h, head.lm_head.weight, y) / n
            else:
                raise ValueError(impl)
        loss.backward()
        return loss.detach()

    return step


def inputs(rows: int, D: int, V: int, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(rows, D, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, V, (rows,), device=device, generator=g)
    y[: rows // 8] = -100
    return h, y


def run_gpu(args) -> dict:

    D, V = 1536, 32768
    rows_list = [65536] if args.quick else [int(r) for r in args.rows.split(",")]
    modes = args.modes.split(",")
    impls = args.impls.split(",")
    warmup, reps = 0, (2 if args.quick else 3)  # the compile step and the memory step before timing warm it up
    if not fused_loss.liger_available():
        raise SystemExit(f"liger-kernel is not importable here ({fused_loss._import_error()}); put liger-kernel 0.8.5 "
                         "on PYTHONPATH (e.g. pip install --no-deps --target /tmp/site liger_kernel-0.8.5-*.whl).")
    from liger_kernel.ops import LigerFusedLinearCrossEntropyFunction

    res = {
        **env_record(),
        "liger_kernel": fused_loss.liger_version(),
        "liger_flce_class": f"{LigerFusedLinearCrossEntropyFunction.__module__}.{LigerFusedLinearCrossEntropyFunction.__name__}",
        "hidden": D, "vocab": V, "torch_loss_chunk": args.loss_chunk,
        "liger_rows_per_call": fused_loss.LIGER_ROWS_PER_CALL,
        "notes": "peak_extra_gib = max allocated during one fwd+bwd minus allocated before it (inputs, weight); "
                 "it includes the gradients of hidden [rows, 1536] and of the weight.",
        "cases": [],
    }
    for mode in modes:
        autocast = mode == "amp"
        for rows in rows_list:
            row = {"mode": mode, "rows": rows}
            ref_loss = None
            for impl in impls:
                head = Head(D, V, "cuda", torch.float32 if autocast else torch.bfloat16, "torch", args.loss_chunk)
                h, y = inputs(rows, D, V, "cuda")
                step = make_step(impl, head, h, y, autocast)
                try:
                    loss = step()  # compile + warm the allocator
                    torch.cuda.synchronize()
                    h.grad, head.lm_head.weight.grad = None, None
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                    step()
                    torch.cuda.synchronize()
                    peak = torch.cuda.max_memory_allocated() - before
                    ms = timed(step, warmup, reps)
                    r = {"fwd_bwd_ms": ms, "peak_extra_gib": peak / GIB, "loss": loss.item(), "impl": head.last_impl}
                    if impl == "torch":
                        ref_loss = loss.item()
                    elif ref_loss is not None:
                        r["loss_rel_diff_vs_torch"] = abs(loss.item() - ref_loss) / abs(ref_loss)
                except torch.cuda.OutOfMemoryError as e:
                    r = {"error": "oom: " + str(e)[:200]}
                row[impl] = r
                print(f"{mode} rows={rows} {impl}: {r}", flush=True)
                del head, h, y, step
                torch.cuda.empty_cache()
            t = row.get("torch", {}).get("fwd_bwd_ms")
            for impl in impls:
                if impl != "torch" and t and "fwd_bwd_ms" in row[impl]:
                    row[impl]["speedup_vs_torch"] = t / row[impl]["fwd_bwd_ms"]
            res["cases"].append(row)
    return res


def run_cpu_smoke(args) -> dict:
    """The torch side (and the step/measurement code) at tiny sizes on the CPU."""
    D, V = 64, 512
    res = {**env_record("cpu (smoke)"), "cpu_smoke": True, "hidden": D, "vocab": V, "cases": []}
    for mode in ("bf16", "amp"):
        for rows in (64, 256):
            head = Head(D, V, "cpu", torch.float32 if mode == "amp" else torch.bfloat16, "torch", 32)
            h, y = inputs(rows, D, V, "cpu")
            step = make_step("torch", head, h, y, mode == "amp")
            loss = step()
            ms = timed(step, 0, 3, device="cpu")
            ref = torch.nn.functional.cross_entropy(
                (h.detach().float() @ head.lm_head.weight.detach().float().T), y, ignore_index=-100)
            row = {"mode": mode, "rows": rows, "torch": {"fwd_bwd_ms": ms, "loss": loss.item(), "impl": head.last_impl,
                                                         "loss_rel_diff_vs_fp32": abs(loss.item() - ref.item()) / ref.item()}}
            assert head.last_impl == "loss:torch-chunked" and row["torch"]["loss_rel_diff_vs_fp32"] < 2e-2, row
            assert h.grad is not None and head.lm_head.weight.grad is not None
            print(row, flush=True)
            res["cases"].append(row)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="64k rows only, fewer reps")
    ap.add_argument("--rows", default="65536,262144,1048576")
    ap.add_argument("--modes", default="bf16,amp")
    ap.add_argument("--impls", default="torch,liger,liger_one_call,liger_sum")
    ap.add_argument("--loss-chunk", type=int, default=8192, help="rows per chunk of the torch head")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    res = run_cpu_smoke(args) if args.cpu_smoke else run_gpu(args)
    write_results(args.out, "fused_loss_cpu_smoke.json" if args.cpu_smoke else "fused_loss.json", res)


if __name__ == "__main__":
    main()
