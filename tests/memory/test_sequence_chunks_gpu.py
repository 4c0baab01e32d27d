"""On the GPU: the sequence-chunked step with the fast kernels (fla KDA with carried states, the
Triton sparse attention over a latent prefix, the fused indexer through its cache) gives the
whole-sequence loss and gradients of h200-ref under bf16 autocast. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).pow(2).mean() / b.float().pow(2).mean().clamp_min(1e-30)).sqrt().item()


@pytest.mark.parametrize("reuse_attention", [True, False], ids=["kept_attention", "attention_rerun"])
def test_chunked_step_matches_whole_sequence_h200_ref(reuse_attention):
    """The chunked step is as exact as the whole-sequence step: measured against an fp32 whole-sequence
    gradient (torch paths), each parameter's bf16 gradient from the chunked step is no further off than
    the whole step's own bf16 gradient (x2 + 2e-2: these are single samples of rounding noise; the tiny
    model on the CPU, tests/test_step_drift_gpu.py, measures x1.12 at worst, on an mHC base, 0.127/0.113).

    MoE routing is recorded in the bf16 whole-sequence forward and replayed by the others: at
    initialisation the router's scores are nearly tied, and rounding in the chunked sweep (other kernels
    than the whole forward) sends many tokens to other experts. With free routing the H200 measures
    0.66 rel-RMS over all gradients against the whole step (loss equal to 2e-5): a difference of
    functions, not of gradients; that figure is printed beside the asserted ones. Per-parameter
    comparisons of chunked with whole bf16 gradients alone are no criterion either: small parameters
    whose gradient is a sum that nearly cancels (mHC base/scale) differ by up to 0.15-0.68 between two
    bf16 runs of the same function.

    This test on the H200: all gradients vs fp32, chunked
    9.31e-2, whole 9.29e-2; chunked vs whole 6.80e-2 (routing replayed), 0.678 (free); loss 10.708808 vs
    10.708576; worst parameter ratio 0.0736/0.0358 (an mHC base: both tiny)."""
    from longctx.config import preset
    from longctx.model import LongCtxModel

    torch.manual_seed(0)
    model = LongCtxModel(preset("h200-ref")).cuda().train()
    S, C = 12288, 4096  # 3 chunks; > top-k, so the DSA layers are sparse in the later chunks
    r = compare_chunked_with_whole(model, S, C, reuse_attention=reuse_attention)
    print(f"reuse_attention={reuse_attention}: loss whole {r['loss_whole']:.6f} chunked {r['loss_chunked']:.6f}; {r['impl']}")
    print("worst chunked/whole vs fp32: " + ", ".join(f"{n} {a:.3g}/{b:.3g}" for n, a, b in r["worst"]))
    print(f"{r['n_small']} tensors of < {SMALL} elements, RMS of their rel errors vs fp32: chunked "
          f"{r['small_pooled'][0]:.3g}, whole {r['small_pooled'][1]:.3g}")
    print(f"all gradients rel-RMS vs fp32: chunked {r['chunked_vs_fp32']:.2e}, whole {r['whole_vs_fp32']:.2e}; chunked vs "
          f"whole {r['chunked_vs_whole']:.2e} (routing replayed), {r['free_chunked_vs_whole']:.2e} (free routing)")
    assert "kda:fla" in r["impl"] and "dsa:triton" in r["impl"]
    assert_as_exact_as_whole(r)


SMALL = 256  # parameters with fewer elements are judged pooled (see assert_as_exact_as_whole)


def assert_as_exact_as_whole(r: dict) -> None:
    """Loss, all gradients, each parameter of >= SMALL elements, and the small ones pooled (the RMS of
    their per-tensor relative errors). Why pooled: h200-ref has ~50 tensors of 3-24 elements (mHC scale
    and base, per-head A_log) whose gradients are sums over all tokens that nearly cancel; each one's
    error is a single draw of few-degree-of-freedom noise, and the largest chunked/whole ratio among ~50
    such draws exceeds 2 by chance: on the H200 0.094/0.029 and 0.21/0.069 on mHC scales [3] with the loss
    equal to 7e-5 and all gradients 8.47e-2 vs 8.48e-2 from fp32. A real error in the chunked mHC or A_log
    gradients moves all of them and so the pooled figure."""
    assert abs(r["loss_chunked"] - r["loss_whole"]) <= 2e-3 * abs(r["loss_whole"])
    assert r["chunked_vs_fp32"] <= 1.5 * r["whole_vs_fp32"] + 5e-3
    assert r["params_over"] == [], r["worst"]
    small_ch, small_wh = r["small_pooled"]
    assert small_ch <= 2 * small_wh + 2e-2, (r["small_pooled"], r["n_small"])


def compare_chunked_with_whole(model, S: int, C: int, seed: int = 0, reuse_attention: bool = True) -> dict:
    """bf16 whole step (routing recorded), chunked step with free and with replayed routing, fp32 whole
    step (torch paths, routing replayed); the rel-RMS figures of the docstring above. Runs on the
    model's device (tests/test_step_drift_gpu.py runs it on the CPU with the tiny model). The chunked
    step recomputes its blocks, keeping the DSA attention output unless `reuse_attention` is False
    (memory.reuse_attention, on by default)."""
    from longctx.kernels import plain_torch
    from longctx.layers.moe import RoutingTape, routing_tape
    from longctx.memory.sequence_chunks import SequenceChunker

    dev = next(model.parameters()).device
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, model.cfg.vocab_size, (1, S + 1), generator=g).to(dev)
    x, y = ids[:, :-1], ids[:, 1:]
    grads = lambda: {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}  # noqa: E731
    flat = lambda g: torch.cat([g[n].flatten().double() for n in sorted(g)])  # noqa: E731
    bf16 = lambda: torch.autocast(dev.type, dtype=torch.bfloat16)  # noqa: E731

    tape = RoutingTape()
    model.zero_grad(set_to_none=True)
    with bf16(), routing_tape(tape):
        out = model(x, labels=y, return_logits=False)
    out.loss.backward()
    impl, whole = model.impl_report(), grads()
    tape.replay = True

    def chunked(routing):
        model.zero_grad(set_to_none=True)
        with bf16():
            got = SequenceChunker(C, reuse_attention=reuse_attention).forward_backward(model, x, y, routing=routing)
        return got, grads()

    _, free = chunked(None)
    got, ch = chunked(tape)
    assert ch.keys() == whole.keys()
    free_total, vs_whole = _rel_rms(flat(free), flat(whole)), _rel_rms(flat(ch), flat(whole))
    del free

    model.zero_grad(set_to_none=True)  # the fp32 reference: plain-torch paths (mHC included), routing replayed
    with plain_torch(model), routing_tape(tape):
        model(x, labels=y, return_logits=False).loss.backward()
    f32 = grads()
    model.zero_grad(set_to_none=True)
    e_ch = {n: _rel_rms(ch[n], f32[n]) for n in f32}
    e_wh = {n: _rel_rms(whole[n], f32[n]) for n in f32}
    ranked = sorted(f32, key=lambda n: -e_ch[n] / max(e_wh[n], 1e-6))
    small = [n for n in f32 if f32[n].numel() < SMALL]
    pooled = lambda e: (sum(e[n] ** 2 for n in small) / len(small)) ** 0.5 if small else 0.0  # noqa: E731
    return {"loss_whole": out.lm_loss.item(), "loss_chunked": got.lm_loss.item(), "impl": impl,
            "chunked_vs_fp32": _rel_rms(flat(ch), flat(f32)), "whole_vs_fp32": _rel_rms(flat(whole), flat(f32)),
            "chunked_vs_whole": vs_whole, "free_chunked_vs_whole": free_total,
            "worst": [(n, e_ch[n], e_wh[n]) for n in ranked[:5]],
            "params_over": [n for n in f32 if f32[n].numel() >= SMALL and e_ch[n] > 2 * e_wh[n] + 2e-2],
            "small_pooled": (pooled(e_ch), pooled(e_wh)), "n_small": len(small)}
