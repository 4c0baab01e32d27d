"""longctx against transformers' glm5_next on one random checkpoint, beyond what rounding explains.

Two implementations of one function, both in fp32, differ by their op orders (~1e-6 relative) and, at
a few thousand tokens, by the odd discrete choice that such a difference tips: a token whose 4th and
5th experts score within 1e-6 of each other goes to another expert, or an indexer swaps a pool at its
k-th score; one such flip moves that token's logits by O(1). `hf_decisions` records transformers'
choices (router top-k, indexer selection) and `forced_decisions` makes longctx take them, so that what
is left is arithmetic: there, anything computed below fp32 (a TF32 product is ~1e-3 relative) shows at
every position. `own_decisions` records longctx's free choices, to count the flips.

`hf_torch_path` runs transformers' KDA on its own torch functions: with fla-core importable, its
`chunk_kimi_delta_attention` is fla's `chunk_kda`, whose Triton dots take fp32 inputs through TF32.
Used by tests/test_hf_fp32_gpu.py (and its CPU run in tests/test_step_drift_gpu.py) and bench/fp32_parity.py.
"""

from __future__ import annotations

import contextlib
import inspect
import re

import torch

# transformers' text config of longctx's h200-ref preset (longctx/config/model.py), cut to `num_hidden_layers`
# (4: KKKD, dense MLP then three MoE layers, as h200-ref's first block).
H200_REF_TEXT = dict(vocab_size=32768, hidden_size=1536, intermediate_size=4096, moe_intermediate_size=768,
                     num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=32,
                     num_experts_per_tok=4, n_shared_experts=1, kv_lora_rank=512, q_lora_rank=768, qk_nope_head_dim=128,
                     v_head_dim=128, index_topk=2048, index_head_dim=64, index_n_heads=16, linear_head_dim=128,
                     linear_num_heads=12, index_kpool=4, hc_mult=4, mlp_layer_types=["dense", "sparse", "sparse", "sparse"])

_KDA_FUNCS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn", "causal_conv1d_update")


def _layer(name: str) -> int:
    return int(re.search(r"layers\.(\d+)\.", name).group(1))


def torch_body(f):
    """transformers' torch function under the wrappers it binds in its place: functools.wraps' `__wrapped__`
    (its fla fallback) and, where the `kernels` package is installed, the hub-kernel module that holds that
    wrapper (an nn.Module whose forward calls the function its closure keeps)."""
    while True:
        if hasattr(f, "__wrapped__"):
            f = f.__wrapped__
            continue
        fwd = getattr(type(f), "forward", None) if isinstance(f, torch.nn.Module) else None
        inner = [c.cell_contents for c in getattr(fwd, "__closure__", None) or () if inspect.isfunction(c.cell_contents)]
        if len(inner) != 1:
            return f
        f = inner[0]


@contextlib.contextmanager
def hf_torch_path():
    """transformers' glm5_next with its KDA (and conv) functions on their torch bodies, whatever packages
    it found at import (it binds fla's kernels, or causal-conv1d's, when they import)."""
    from transformers.models.glm5_next import modeling_glm5_next as m

    kept = {n: getattr(m, n) for n in _KDA_FUNCS}
    try:
        for n, f in kept.items():
            setattr(m, n, torch_body(f))
        yield
    finally:
        for n, f in kept.items():
            setattr(m, n, f)


@contextlib.contextmanager
def hf_decisions(hf_model):
    """Yields {"experts": {layer: [tokens, k] indices}, "tokens": {layer: [B, S, width] int32}} that the
    forwards inside fill from every router and every indexer of the text model."""
    from transformers.models.glm5_next import modeling_glm5_next as m

    rec = {"experts": {}, "tokens": {}}
    hooks = []
    for name, mod in hf_model.named_modules():
        if isinstance(mod, m.Glm5NextTextTopkRouter):
            hooks.append(mod.register_forward_hook(
                lambda mod, inp, out, i=_layer(name): rec["experts"].__setitem__(i, out[2].detach())))
        elif isinstance(mod, m.Glm5NextTextIndexer):
            hooks.append(mod.register_forward_hook(
                lambda mod, inp, out, i=_layer(name): rec["tokens"].__setitem__(i, out.detach())))
    try:
        yield rec
    finally:
        for h in hooks:
            h.remove()


def _moe_and_indexers(model):
    from longctx.layers.dsa import SparseMLA
    from longctx.layers.moe import MoE

    moes = [m for m in model.modules() if isinstance(m, MoE)]
    idx = [m.indexer for m in model.modules() if isinstance(m, SparseMLA) and m.indexer is not None]
    return moes, idx


@contextlib.contextmanager
def _decisions(model, choose):
    """Inside, every MoE layer's expert choice and every indexer's selection of `model` go through
    choose(kind, layer, own), `own` computing the layer's own choice (called or not)."""
    import longctx.layers.moe as moe_mod

    moes, indexers = _moe_and_indexers(model)
    current = [None]
    hooks = [m.register_forward_pre_hook(lambda mod, inp: current.__setitem__(0, mod)) for m in moes]
    orig = moe_mod.select_experts
    moe_mod.select_experts = lambda choice, k, *a, **kw: choose(
        "experts", current[0].layer_idx, lambda: orig(choice, k, *a, **kw)).to(choice.device)
    for ix in indexers:
        select = ix.select
        ix.select = lambda *a, _s=select, _i=ix.layer_idx, **kw: choose("tokens", _i, lambda: _s(*a, **kw))
    try:
        yield
    finally:
        moe_mod.select_experts = orig
        for h in hooks:
            h.remove()
        for ix in indexers:
            del ix.select


def forced_decisions(model, rec: dict):
    """longctx's MoE layers route to the experts in rec["experts"][layer] and its indexers select
    rec["tokens"][layer] (as `hf_decisions` records them; one chunk of tokens per MoE call)."""

    def choose(kind, layer, own):
        if layer not in rec[kind]:
            raise KeyError(f"no recorded {kind} for layer {layer} (recorded: {sorted(rec[kind])})")
        return rec[kind][layer]

    return _decisions(model, choose)


@contextlib.contextmanager
def own_decisions(model):
    """Yields a dict like `hf_decisions`', filled with longctx's own choices."""
    rec = {"experts": {}, "tokens": {}}

    def choose(kind, layer, own):
        rec[kind][layer] = out = own()
        return out

    with _decisions(model, choose):
        yield rec


def flips(a: dict, b: dict) -> dict:
    """How many tokens got another expert set and how many queries another token set, per layer, between
    two decision records (order within a choice does not matter; -1 slots are no choice)."""
    out = {}
    for kind in ("experts", "tokens"):
        for layer in sorted(set(a[kind]) & set(b[kind])):
            x, y = (t.reshape(-1, t.shape[-1]).long().sort(-1).values for t in (a[kind][layer], b[kind][layer]))
            out[f"{kind}{layer}"] = int((x != y.to(x.device)).any(-1).sum())
    return out


def logit_parity(got: torch.Tensor, ref: torch.Tensor, ids: torch.Tensor) -> dict:
    """max |Δ logit| (everywhere and at position 0), rel-RMS, and the mean |Δ| of the next token's log-prob."""
    d = (got.float() - ref.float()).abs()
    lp = [torch.log_softmax(t[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1) for t in (got, ref)]
    return {"max_logit": d.max().item(), "max_logit_pos0": d[:, 0].max().item(),
            "rel_rms": ((d.double().square().mean() / ref.double().square().mean()).sqrt()).item(),
            "mean_logprob": (lp[0] - lp[1]).abs().mean().item(), "max_abs_ref": ref.abs().max().item()}
