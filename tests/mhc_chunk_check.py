"""The comparison behind the chunked liger mHC stream ops (`longctx.ops.mhc.liger`, `_ChunkedPre` /
`_ChunkedPostRes`): against liger's own autograd Functions on the same inputs, every bf16 output and
input gradient must be equal bit for bit (same kernels, same per-token arithmetic, same rounding), and
the fp32 coefficient gradients (atomically accumulated over D blocks) equal to summation order.
Used by tests/ops/test_mhc_gpu.py on CUDA and by tests/ops/test_mhc_liger_chunked.py under the Triton
interpreter. Run as a script: `python tests/mhc_chunk_check.py [cuda|cpu]` prints a RESULT line per case."""

from __future__ import annotations

import sys

import torch


def _run(chunk, inputs, g1, g2):
    from longctx.ops.mhc import liger as mhc_liger

    # the streams as two leaves, one per op: each op's bf16 gradient is compared as its kernel wrote it
    # (summed by autograd, two gradients that differ by a rounding step can cancel into any distance)
    ts = [t.clone().requires_grad_(True) for t in (inputs[0],) + tuple(inputs)]
    xs_pre, xs_post, ys, pr, po, co = ts
    h = mhc_liger.liger_mhc_pre(xs_pre, pr, chunk=chunk)
    o = mhc_liger.liger_mhc_post_res(xs_post, ys, po, co, chunk=chunk)
    (h.float() * g1).sum().backward(retain_graph=True)
    (o.float() * g2).sum().backward()
    return [h.detach(), o.detach()] + [t.grad for t in ts]


NAMES = ["pre out", "post_res out", "d streams (pre)", "d streams (post)", "d y", "d pre", "d post", "d comb"]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in representable steps between two bf16 tensors (0 for other dtypes' equal
    tensors, -1 where not comparable this way): adjacent bf16 values of one sign differ by 1 in their bits."""
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        return 0 if torch.equal(a, b) else -1
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max()) if a.numel() else 0


def compare(device: str, B: int = 2, S: int = 45, n: int = 4, D: int = 96, chunks=(7, 32, 90, 1000), seed: int = 0):
    """[(chunk, name, exact, rel, ulps)] for every output and gradient of the chunked ops against liger's Functions."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=g).to(device)  # noqa: E731
    inputs = (r(B, S, n, D).bfloat16(), r(B, S, D).bfloat16(), u(B, S, n), 2 * u(B, S, n), u(B, S, n, n))
    g1, g2 = r(B, S, D), r(B, S, n, D)
    ref = _run(0, inputs, g1, g2)
    out = []
    for chunk in chunks:
        got = _run(chunk, inputs, g1, g2)
        for name, a, b in zip(NAMES, got, ref):
            rel = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
            out.append((chunk, name, a.dtype == b.dtype and torch.equal(a, b), rel, _ulps(a, b)))
    return out


def assert_matches(rows, bf16_rel: float = 0.0, bf16_ulps: int = 0) -> None:
    """bf16_rel = 0: every bf16 tensor bit for bit, or within `bf16_ulps` representable steps per element.
    The chunked ops have the kernels store fp32 values straight into bf16 tensors, where liger's Functions
    store fp32 and cast with torch (round to nearest even). On the GPU a Triton store rounds to nearest
    even too; the Triton interpreter's fp32 -> bf16 conversion (triton/runtime/interpreter.py,
    `_convert_float` without a rounding mode) truncates, one step at most: the interpreter test allows 1.
    On the H200 the
    input gradients 'd streams' and 'd y' differ from liger's Functions by 1.18e-5 / 1.19e-5 rel-RMS at
    chunks of 1000 and 4096 alike, so not a per-chunk-length effect; our path hands the kernel the bf16
    gradient where liger's Function hands it an fp32 copy, and the dtype and strides are constexprs: a
    different compiled kernel, whose fp32 arithmetic may round differently. There bf16_rel bounds the
    rel-RMS difference."""
    for chunk, name, exact, rel, ulps in rows:
        print(f"chunk {chunk:>5} {name:<16} {'exact' if exact else f'rel {rel:.2e}, {ulps} ulp'}")
    for chunk, name, exact, rel, ulps in rows:
        if name in ("d pre", "d post", "d comb"):  # fp32 atomics: summation order only
            assert exact or rel <= 1e-6, (chunk, name, rel)
        else:
            assert exact or rel <= bf16_rel or 0 <= ulps <= bf16_ulps, (chunk, name, rel, ulps)


if __name__ == "__main__":  # tests/triton_interpreter.py collects the RESULT lines
    import json

    for chunk, name, exact, rel, ulps in compare(sys.argv[1] if len(sys.argv) > 1 else "cpu"):
        print("RESULT " + json.dumps({"name": f"{chunk}:{name}", "chunk": chunk, "what": name, "exact": exact, "rel": rel,
                                      "ulps": ulps}))
