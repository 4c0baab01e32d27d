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
    """fp32 master weights must not promote bf16 activations (an fp32 RMSNorm output would send the MoE
    down its fp32 loop path and make the DSA latents fp32)."""
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
    """`pip install -e .` (the main job's install) may bring no triton: with kernels.rms_norm auto, the
    default, a CPU step never imports it and every RMSNorm runs the torch twin. A subprocess, since this
    pytest process may have imported triton already."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\nfrom longctx.config import preset\nfrom longctx.model import LongCtxModel\n"
            "from longctx.layers.norms import RMSNorm\n"
            "m = LongCtxModel(preset('tiny'))\nids = torch.randint(0, 97, (1, 33))\n"
            "m(ids, labels=ids).loss.backward()\n"
            "norms = [x for x in m.modules() if isinstance(x, RMSNorm)]\n"
            "assert norms and all(x.kernels['rms_norm'] == 'auto' and x.last_impl == 'norm:torch' for x in norms)\n"
            "print('ok', len(norms))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-2000:]


def test_the_picking_rule_declines_aloud(monkeypatch):
    """ops.pick, the one rule every op chooses by: under auto, a CUDA input the fast path does not take (or
    a backend that does not import) runs the torch twin with a RuntimeWarning naming kernels.<op> and the
    fix, once; CPU inputs run torch silently, without asking why_not (nothing was asked of the GPU); an
    explicit backend runs where it can and is a ConfigError naming the setting where it cannot; the
    memory plan's baseline (plain) makes auto the twin; a wrong value is one ConfigError."""
    import warnings

    from longctx import errors
    from longctx.errors import ConfigError
    from longctx.ops import pick

    impls = ("auto", "torch", "triton")
    never = lambda: pytest.fail("why_not asked on the CPU")  # noqa: E731
    monkeypatch.setattr(errors, "_FALLBACKS_SAID", set())
    with pytest.warns(RuntimeWarning, match=r"kernels.swiglu auto runs the plain-torch twin on CUDA \(takes bf16 only\); "
                                            r"set kernels.swiglu = 'torch' to accept it"):
        assert pick("swiglu", "auto", impls, True, lambda: "takes bf16 only") == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pick("swiglu", "auto", impls, True, lambda: "takes bf16 only") == "torch"  # said once
        assert pick("swiglu", "auto", impls, False, never) == "torch"
        assert pick("swiglu", "auto", impls, True, never, plain=True) == "torch"
        assert pick("swiglu", "auto", impls, True, lambda: "missing", warn=False) == "torch"
    assert pick("swiglu", "auto", impls, True, lambda: None) == "triton"
    assert pick("swiglu", "triton", impls, False, lambda: None) == "triton"  # e.g. under TRITON_INTERPRET=1
    assert pick("swiglu", "triton", impls, True, lambda: None, plain=True) == "triton"  # plain binds auto only
    assert pick("swiglu", "torch", impls, True, never) == "torch"
    with pytest.raises(ConfigError, match=r"kernels.rms_norm = 'triton' cannot run here \(triton does not import\); "
                                          r"set kernels.rms_norm to 'auto' or 'torch'"):
        pick("rms_norm", "triton", impls, True, lambda: "triton does not import")
    with pytest.raises(ConfigError, match="kernels.rms_norm must be one of auto, torch, triton"):
        pick("rms_norm", "fused", impls, True, never)


def test_ops_fall_back_through_the_rule_on_what_the_kernel_does_not_take(monkeypatch):
    """rms_norm and swiglu under auto on CUDA inputs their Triton kernels refuse (here: every input, through
    `unavailable`) run the torch twin and say so naming the setting; the layers record what ran."""
    from longctx import errors
    from longctx.ops import rms_norm, swiglu

    class FakeCuda:
        is_cuda, shape, dtype, device = True, (3, 5), torch.float64, "cuda:0"

    monkeypatch.setattr(errors, "_FALLBACKS_SAID", set())
    monkeypatch.setattr(rms_norm, "unavailable", lambda device, cfg=None: "fp64 is not taken")
    monkeypatch.setattr(swiglu, "unavailable", lambda device, cfg=None: "fp64 is not taken")
    with pytest.warns(RuntimeWarning, match="kernels.rms_norm auto runs the plain-torch twin on CUDA"):
        assert rms_norm.pick("auto", FakeCuda(), FakeCuda()) == "torch"
    with pytest.warns(RuntimeWarning, match="kernels.swiglu auto runs the plain-torch twin on CUDA"):
        assert swiglu.pick("auto", FakeCuda(), FakeCuda()) == "torch"
    assert rms_norm.pick("auto", torch.zeros(2, 3), torch.ones(3)) == "torch"  # the CPU: no import, no word


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
