"""Whole-model checks that the GPU recipe relies on, run on the CPU: bf16 autocast, parameter counts."""

from __future__ import annotations

import pytest
import torch

from longctx.config import preset
from longctx.model import LongCtxModel


@pytest.mark.parametrize("residual", ["mhc", "plain", "attnres"])
def test_bf16_autocast_step_keeps_the_stream_in_bf16(residual):
    torch.manual_seed(0)
    model = LongCtxModel(preset("tiny").replace(residual=residual))
    ids = torch.randint(0, 97, (2, 41))
    seen = []
    model.layers[1].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids[:, :-1], labels=ids[:, 1:])
    out.loss.backward()
    state = seen[0] if isinstance(seen[0], torch.Tensor) else seen[0][0][0]
    assert state.dtype == torch.bfloat16  # the residual state kept per layer is half the fp32 size
    assert torch.isfinite(out.loss)
    assert all(p.grad is not None for n, p in model.named_parameters() if "indexer" not in n)
    # fp32 where the reference keeps fp32
    moe = model.layers[1].mlp
    assert moe.router.weight.dtype == torch.float32


def test_h200_ref_parameter_counts():
    with torch.device("meta"):
        model = LongCtxModel(preset("h200-ref"))
    n = model.num_parameters()
    # the headline: about 1.5B total, 0.35B active
    assert 1.3e9 < n["total"] < 1.7e9, n
    assert 0.25e9 < n["active"] < 0.45e9, n


def test_activations_stay_in_the_autocast_dtype():
    """fp32 master weights must not promote bf16 activations (found on the H200: RMSNorm returned
    fp32, so the MoE ran its fp32 loop path and the DSA latents were fp32)."""
    import dataclasses

    from longctx.layers.dsa import SparseMLA
    from longctx.layers.moe import MoE

    torch.manual_seed(0)
    m = LongCtxModel(dataclasses.replace(preset("tiny"), index_heads=16))
    seen = {}
    for name, mod in m.named_modules():
        if isinstance(mod, (MoE, SparseMLA)):
            mod.register_forward_hook(lambda mod, a, out, name=name: seen.__setitem__(name, (a[0].dtype, (out[0] if isinstance(out, tuple) else out).dtype)))
    caches = m.init_caches(1, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(torch.randint(0, 97, (1, 40)), labels=torch.randint(0, 97, (1, 40)))
        m(torch.randint(0, 97, (1, 40)), caches=caches)
    assert seen and all(v == (torch.bfloat16, torch.bfloat16) for v in seen.values()), seen
    dsa = [c for c in caches if hasattr(c, "latent")]
    assert dsa and all(c.latent.view().dtype == torch.bfloat16 for c in dsa)


def test_default_norms_train_without_triton_installed():
    """`pip install -e .` (the main job's install) may bring no triton: with norm_impl auto, the default,
    a CPU step never imports it and every RMSNorm runs the torch form. A subprocess, since this pytest
    process may have imported triton already."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\nfrom longctx.config import preset\nfrom longctx.model import LongCtxModel\n"
            "from longctx.layers.norms import RMSNorm\n"
            "m = LongCtxModel(preset('tiny'))\nids = torch.randint(0, 97, (1, 33))\n"
            "m(ids, labels=ids).loss.backward()\n"
            "norms = [x for x in m.modules() if isinstance(x, RMSNorm)]\n"
            "assert norms and all(x.impl == 'auto' and x.last_impl == 'norm:torch' for x in norms)\n"
            "print('ok', len(norms))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-2000:]


def test_fused_kernels_auto_declines_aloud(monkeypatch):
    """ops.fused_kernel_runs (norm_impl, swiglu_impl): under auto, a CUDA input the kernel does not take,
    or a kernel module that does not import, runs the torch form with a RuntimeWarning naming the setting
    and the fix; CPU inputs run torch silently (nothing was asked of the GPU); triton always runs the
    kernel (which raises for what it cannot take); a wrong value is one ConfigError."""
    import sys
    import types

    from longctx import errors
    from longctx.errors import ConfigError
    from longctx.ops import fused_kernel_runs

    class FakeCuda:
        is_cuda, shape, dtype = True, (3, 5), torch.float64

    monkeypatch.setattr(errors, "_FALLBACKS_SAID", set())
    monkeypatch.setitem(sys.modules, "longctx.ops.fake_kernel", types.SimpleNamespace(runs_here=lambda *t: False))
    with pytest.warns(RuntimeWarning, match=r"swiglu_impl auto runs the torch form on CUDA .*\(3, 5\) torch.float64.*"
                                            r"set swiglu_impl = 'torch'"):
        assert not fused_kernel_runs("swiglu_impl", "auto", "fake_kernel", FakeCuda())
    with pytest.warns(RuntimeWarning, match="norm_impl auto runs the torch form on CUDA because the fused kernel does not import"):
        assert not fused_kernel_runs("norm_impl", "auto", "no_such_kernel", FakeCuda())
    monkeypatch.setitem(sys.modules, "longctx.ops.fake_kernel", types.SimpleNamespace(runs_here=lambda *t: True))
    assert fused_kernel_runs("swiglu_impl", "auto", "fake_kernel", FakeCuda())
    assert not fused_kernel_runs("swiglu_impl", "auto", "no_such_kernel", torch.zeros(2))  # CPU: torch, no import
    assert fused_kernel_runs("swiglu_impl", "triton", "no_such_kernel", torch.zeros(2))
    assert not fused_kernel_runs("swiglu_impl", "torch", "fake_kernel", FakeCuda())
    with pytest.raises(ConfigError, match="norm_impl must be one of auto, torch, triton"):
        fused_kernel_runs("norm_impl", "fused", "fake_kernel", FakeCuda())


def test_generate_prefills_without_the_prompts_logits():
    """The prompt's prefill applies the LM head to its last position only ([T, vocab] logits of a long prompt
    are GiBs); greedy decoding gives the tokens of a loop over the full logits."""
    from longctx.generate import generate

    torch.manual_seed(0)
    m = LongCtxModel(preset("tiny")).eval()
    prompt = torch.randint(0, m.cfg.vocab_size, (1, 40))
    rows = []
    hook = m.lm_head.register_forward_hook(lambda mod, args, out: rows.append(tuple(args[0].shape)))
    got = generate(m, prompt, 5, temperature=0)
    hook.remove()
    assert rows[0] == (1, m.cfg.hidden_size) and all(r[-2] == 1 for r in rows[1:]), rows
    caches, toks = m.init_caches(1, device=prompt.device), [prompt]
    with torch.no_grad():
        logits = m(prompt, caches=caches).logits[:, -1]
        for _ in range(5):
            toks.append(logits.argmax(-1, keepdim=True))
            logits = m(toks[-1], caches=caches).logits[:, -1]
    assert torch.equal(got, torch.cat(toks, 1))
