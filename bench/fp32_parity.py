"""Where fp32 on the GPU is not fp32: longctx's plain-torch path against transformers' glm5_next, both in fp32.

    python bench/fp32_parity.py --out DIR [--seq 8192] [--audit-seq 2048] [--phases parity,audit,cudnn,fla]

One random glm5_next checkpoint of h200-ref's shapes cut to 4 layers (tests/hf_parity.H200_REF_TEXT), loaded
by both; TF32 for matmuls off (torch.backends.cuda.matmul.allow_tf32 = False), cuDNN's switch as torch leaves it
unless a phase says otherwise. Phases, in the order given:
  parity  at --seq tokens: logits and next-token log-probs with longctx's own expert / pool choices and with
          transformers' (tests/hf_parity.forced_decisions: what is left is arithmetic), the flips between the
          two, and every layer's, mixer's and MLP's output (forced choices), position 0 apart;
  audit   at --audit-seq tokens, every aten op either model runs on fp32 tensors is run again in fp64 on the
          same inputs: its relative error (||out - out64|| / ||out64||), the largest per op and module. An fp32
          op lands near 1e-7 (a long reduction 1e-6), a TF32 product near 3e-4 (METHOD.md);
  cudnn   parity again with torch.backends.cudnn.allow_tf32 = False;
  fla     transformers with the KDA kernels it binds when fla-core imports (its default then), and fla's
          chunk_kda against transformers' torch function on the same fp32 inputs.
Writes DIR/fp32_parity.json (GPU, versions, command, commit, numbers) after every phase.

H200, 8192 tokens (bench/results/fp32_parity.json): parity 3.1e-5 max |Δ logit| replayed, every sub-layer within
5e-6 rel-RMS; the audit's 218 (op, module) pairs all within 7.0e-7 of fp64 (lm_head's K = 1536 products the
largest); cuDNN's switch changes nothing; fla: chunk_kda 1.1e-3 from the torch form, 3.56 max |Δ logit| free.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from hf_parity import (H200_REF_TEXT, flips, forced_decisions, hf_decisions, hf_torch_path,  # noqa: E402
                       logit_parity, own_decisions)

from longctx.kernels import plain_torch  # noqa: E402

# ops whose fp32 output is a copy, a view or a constant of their inputs: nothing to round
_SKIP = {"aten::detach", "aten::lift_fresh", "aten::clone", "aten::_to_copy", "aten::copy_", "aten::empty_like",
         "aten::zeros_like", "aten::ones_like", "aten::full_like", "aten::fill_", "aten::zero_", "aten::contiguous",
         "aten::_local_scalar_dense", "aten::cat", "aten::stack", "aten::index", "aten::gather", "aten::index_select",
         "aten::constant_pad_nd", "aten::masked_fill", "aten::masked_fill_", "aten::where", "aten::repeat",
         "aten::tril", "aten::triu", "aten::flip", "aten::roll", "aten::new_zeros", "aten::new_empty", "aten::new_full",
         "aten::scatter", "aten::scatter_", "aten::index_put_", "aten::index_put", "aten::slice_scatter", "aten::_unsafe_view",
         "aten::relu", "aten::clamp", "aten::clamp_min", "aten::clamp_max", "aten::max", "aten::min", "aten::amax",
         "aten::amin", "aten::topk", "aten::sort", "aten::argsort", "aten::eq", "aten::ne", "aten::lt", "aten::le",
         "aten::gt", "aten::ge", "aten::isfinite", "aten::isnan", "aten::abs", "aten::neg", "aten::diag_embed", "aten::eye",
         "aten::split_with_sizes_copy", "aten::nan_to_num"}


def _rel(o: torch.Tensor, r: torch.Tensor) -> float:
    o, r = o.double(), r.to(torch.float64)
    fin = torch.isfinite(o) & torch.isfinite(r)
    num, den = (o - r)[fin].norm().item(), r[fin].norm().item()
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


class Fp32Audit(TorchDispatchMode):
    """Runs every aten op that takes an fp32 tensor twice: as asked, and in fp64 on the same inputs; keeps
    the largest relative error of each (op, module) pair, the module being the innermost one running."""

    def __init__(self, names: dict):
        super().__init__()
        self.names, self.stack, self.stats = names, [], {}

    def _record(self, func, rel, numel, note=None):
        where = re.sub(r"\.\d+(?=\.|$)", ".*", self.stack[-1] if self.stack else "-")
        key = f"{where} {func.name()}"
        s = self.stats.setdefault(key, {"calls": 0, "max_rel": 0.0, "numel": 0})
        s["calls"] += 1
        s["max_rel"] = max(s["max_rel"], rel)
        s["numel"] = max(s["numel"], numel)
        if note:
            s["note"] = note

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        if func.is_view or func._schema.name in _SKIP or not any(
                isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in flat):
            return func(*args, **kwargs)
        up = tree_map(lambda t: t.detach().to(torch.float64) if isinstance(t, torch.Tensor) and t.dtype == torch.float32
                      else t, (args, kwargs))  # before the op runs: it may write into its inputs
        out = func(*args, **kwargs)
        try:
            ref = func(*up[0], **up[1])
        except Exception as e:  # noqa: BLE001 - an op without an fp64 kernel: its twin below, or noted
            ref = _fp64_twin(func, up[0], up[1])
            if ref is None:
                self._record(func, float("nan"), 0, f"no fp64 kernel: {type(e).__name__}")
                return out
        if func._schema.name == "aten::_scaled_dot_product_efficient_attention":
            pairs = [(out[0], ref[0])]
        else:
            pairs = list(zip(tree_flatten(out)[0], tree_flatten(ref)[0]))
        for o, r in pairs:
            if isinstance(o, torch.Tensor) and o.dtype == torch.float32 and isinstance(r, torch.Tensor) \
                    and r.dtype.is_floating_point and o.numel():
                self._record(func, _rel(o, r), o.numel())
        return out


def _fp64_twin(func, args, kwargs):
    """The fp64 reference of an op whose own kernel takes no fp64, or None."""
    name = func._schema.name
    if name == "aten::_scaled_dot_product_efficient_attention":
        q, k, v, bias = args[:4]
        dropout = args[5] if len(args) > 5 else kwargs.get("dropout_p", 0.0)
        causal = args[6] if len(args) > 6 else kwargs.get("is_causal", False)
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, bias, dropout, causal,
                                                                 scale=kwargs.get("scale"))
    if name == "aten::_grouped_mm":
        a, b, offs = args[:3]
        if a.dim() == 2 and b.dim() == 3:
            ends = [0] + offs.tolist()
            return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(ends, ends[1:]))])
    return None


@contextlib.contextmanager
def audited(models: dict):
    """Fp32Audit over the forwards inside, with module names "<side>:<qualified name>"."""
    names = {id(m): f"{side}:{n}" for side, model in models.items() for n, m in model.named_modules()}
    audit = Fp32Audit(names)
    pre = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, i: audit.stack.append(names.get(id(m), type(m).__name__)))

    def leave(m, i, o):  # returns None: a forward hook's return value would replace the output
        audit.stack.pop()

    post = torch.nn.modules.module.register_module_forward_hook(leave)
    try:
        with audit:
            yield audit
    finally:
        pre.remove()
        post.remove()


@contextlib.contextmanager
def captured(model, names: list[str]):
    """{name: first tensor of the module's output} for the named modules, filled by the forwards inside."""
    out = {}
    mods = dict(model.named_modules())
    hooks = []
    for n in names:
        def keep(m, i, o, n=n):
            t = o[0] if isinstance(o, (tuple, list)) else o
            out[n] = t.detach()
        hooks.append(mods[n].register_forward_hook(keep))
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()


def _sub_layer_names(n_layers: int):
    ours, hf = ["embed"], ["model.language_model.embed_tokens"]
    for i in range(n_layers):
        for a, b in (("mixer", "self_attn"), ("mlp", "mlp"), ("", "")):
            ours.append(f"layers.{i}" + (f".{a}" if a else ""))
            hf.append(f"model.language_model.layers.{i}" + (f".{b}" if b else ""))
    return ours, hf


def _compare_outputs(o: dict, h: dict, pairs) -> list:
    rows = []
    for a, b in pairs:
        x, y = o[a].float(), h[b].float()
        if x.shape != y.shape:
            rows.append({"module": a, "note": f"shapes {tuple(x.shape)} vs {tuple(y.shape)}"})
            continue
        d = (x - y).double()
        rows.append({"module": a, "rel_rms": (d.norm() / y.double().norm()).item(),
                     "rel_pos0": (d[:, 0].norm() / y[:, 0].double().norm()).item(), "max_abs": d.abs().max().item()})
    return rows


def parity(ours, hf, ids, layers: int, hf_torch: bool = True, per_layer: bool = True) -> dict:
    """longctx plain torch vs transformers on ids: free and forced choices, and (forced) each sub-layer."""
    o_names, h_names = _sub_layer_names(layers)
    ctx = hf_torch_path() if hf_torch else contextlib.nullcontext()
    t0 = time.perf_counter()
    with torch.no_grad(), ctx, hf_decisions(hf) as rec, captured(hf, h_names if per_layer else []) as h_out:
        ref = hf(input_ids=ids).logits
    t1 = time.perf_counter()
    with torch.no_grad(), plain_torch(ours):
        with forced_decisions(ours, rec), captured(ours, o_names if per_layer else []) as o_out:
            forced = ours(ids).logits
        t2 = time.perf_counter()
        with own_decisions(ours) as mine:
            free = ours(ids).logits
    r = {"seq": ids.shape[1], "forced": logit_parity(forced, ref, ids), "free": logit_parity(free, ref, ids),
         "flips": flips(rec, mine), "impl": ours.impl_report(), "s_hf": t1 - t0, "s_ours": t2 - t1}
    if per_layer:
        r["layers"] = _compare_outputs(o_out, h_out, list(zip(o_names, h_names)))
    del ref, forced, free, o_out, h_out
    torch.cuda.empty_cache() if ids.is_cuda else None
    return r


def audit_phase(ours, hf, ids, top: int = 25) -> dict:
    with torch.no_grad(), plain_torch(ours), hf_torch_path(), audited({"ours": ours, "hf": hf}) as a:
        hf(input_ids=ids)
        ours(ids)
    rows = sorted(({"key": k, **v} for k, v in a.stats.items()), key=lambda s: -(s["max_rel"] if s["max_rel"] == s["max_rel"] else 1))
    return {"seq": ids.shape[1], "ops": len(rows), "worst": rows[:top], "all": {r["key"]: r["max_rel"] for r in rows},
            "over_1e-5": [r for r in rows if not r["max_rel"] <= 1e-5]}


def fla_phase(ours, hf, ids, layers: int) -> dict:
    from transformers.models.glm5_next import modeling_glm5_next as m

    f = m.chunk_kimi_delta_attention
    torch_fn = getattr(f, "__wrapped__", f)
    if torch_fn is f or "fla" not in (getattr(_bound_impl(f), "__module__", "") or ""):
        return {"note": f"transformers binds no fla kernel here ({_bound_impl(f)})"}
    errs = []

    def both(*a, **kw):
        out = f(*a, **kw)
        ref = torch_fn(*a, **kw)
        errs.append(_rel(out[0], ref[0]))
        return out

    m.chunk_kimi_delta_attention = both
    try:
        r = parity(ours, hf, ids, layers, hf_torch=False, per_layer=False)
    finally:
        m.chunk_kimi_delta_attention = f
    r["chunk_kda_vs_torch_rel"] = errs
    return r


def _bound_impl(f):
    """The function transformers' fallback wrapper calls (its closure's `implementation`)."""
    for c in getattr(f, "__closure__", None) or ():
        v = c.cell_contents
        if callable(v) and getattr(v, "__name__", "") in ("chunk_kda", "fused_recurrent_kda"):
            return v
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--audit-seq", type=int, default=2048)
    p.add_argument("--phases", default="parity,audit,cudnn,fla")
    p.add_argument("--device", default="cuda")
    p.add_argument("--commit", default=os.environ.get("LONGCTX_COMMIT"))
    p.add_argument("--tiny", action="store_true", help="tests/hf_reference.py's tiny text config (a CPU dry run)")
    a = p.parse_args()
    from hf_reference import make_checkpoint, text_config

    import longctx
    from longctx.hf_interop import load_pretrained

    torch.backends.cuda.matmul.allow_tf32 = False
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    commit = a.commit
    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or None
        except OSError:
            commit = None
    import transformers
    import triton

    res = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
           "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
           "command": " ".join(sys.argv), "date": datetime.date.today().isoformat(), "commit": commit,
           "flags": {"cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                     "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32}, "longctx": longctx.__file__}

    def dump():
        (out_dir / "fp32_parity.json").write_text(json.dumps(res, indent=1))

    t0 = time.perf_counter()
    kw = {} if a.tiny else H200_REF_TEXT
    layers = text_config(**kw)["num_hidden_layers"]
    with tempfile.TemporaryDirectory() as d:
        hf = make_checkpoint(Path(d) / "hf", seed=0, **kw)
        ours = load_pretrained(str(Path(d) / "hf")).to(a.device).eval()
    hf = hf.to(a.device).eval()
    vocab = text_config(**kw)["vocab_size"]
    res["build_s"] = time.perf_counter() - t0
    print(f"built in {res['build_s']:.0f} s; flags {res['flags']}", flush=True)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (1, a.seq), generator=gen).to(a.device)
    for phase in a.phases.split(","):
        t = time.perf_counter()
        if phase == "parity":
            res["parity"] = parity(ours, hf, ids, layers)
        elif phase == "audit":
            res["audit"] = audit_phase(ours, hf, ids[:, : a.audit_seq])
        elif phase == "cudnn":
            kept = torch.backends.cudnn.allow_tf32
            torch.backends.cudnn.allow_tf32 = False
            try:
                res["cudnn_off"] = parity(ours, hf, ids, layers, per_layer=False)
            finally:
                torch.backends.cudnn.allow_tf32 = kept
        elif phase == "fla":
            res["fla"] = fla_phase(ours, hf, ids, layers)
        else:
            raise SystemExit(f"unknown phase {phase!r}")
        res.setdefault("phase_s", {})[phase] = time.perf_counter() - t
        dump()
        print(f"--- {phase} ({res['phase_s'][phase]:.0f} s)", flush=True)
        print(json.dumps(res[{"cudnn": "cudnn_off"}.get(phase, phase)], indent=1)[:6000], flush=True)


if __name__ == "__main__":
    main()
