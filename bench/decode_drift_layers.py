"""CPU: where the bf16 drift between the training forward and the decode path comes from, per block and
per sub-layer, and how much of it each precision change removes (the follow-up of bench/decode_drift.py).

    python bench/decode_drift_layers.py [--seqs 600] [--variants base,sel,kdaops] [--local base,kdaops]
                                        [--layers 4] [--topk 256] [--last 16] [--chunk 256] [--no-ref]

The defaults take about 4 minutes on 2 cores. Model: h200-ref cut to --layers blocks (KKKD, 'dmmm'),
random weights and the test's LM head (logit std ~3), as bench/decode_drift.py, except index_topk
(--topk, default 256): at CPU lengths the preset's 2048 selects every causal pool, so the indexer's
choice would never matter (--topk 0 keeps 2048). MoE routing is always recorded in the training forward
and replayed (the test's `recorded_routing`, here with a rewind). Both paths run under bf16 autocast and
under the same patch; a patch changes only precision (autocast off and fp32 inputs around one piece, or
the MoE's fp32 combine switch), never the function. Nothing is written.

Part 1, end to end (per --seqs and --variants): decode vs training over the last --last tokens: rel-RMS
of the residual state after each block ("blk"), of the final hidden, the mean abs log-prob difference,
the share of the decode path's selected tokens that the training forward did not select, and rel-RMS of
each sub-layer's output ("mix"/"mlp"). Then two lines: each path's block states, hidden and log-probs
against an fp32 forward (autocast off) that replays the training forward's routing and selection.
  base     as tests/test_gpu_end_to_end.py runs it
  sel      + the DSA indexer's selection recorded in the training forward and replayed
  kda32    + every KDA layer run outside autocast (fp32 inputs, fp32 projections)
  dsa32    + every DSA layer (with its indexer) outside autocast
  mlp32    + every dense MLP / MoE outside autocast
  mhc32    + every mHC enter/exit outside autocast (the streams still stored in bf16 between sub-layers)
  res32    + mhc32 and the streams kept in fp32 (the embedding not cast to bf16)
  kdaops   + only the KDA recurrence (kda_chunk / kda_step) outside autocast: the torch twin's matmuls
             (`@`, einsum) are otherwise autocast to bf16, so its state S is rounded to bf16
  idx32    + only the indexer's score matmuls (pool_scores) outside autocast
  mhcproj  + only the mHC coefficient projection (_mhc_project) outside autocast
  comb32   + MoE.combine_dtype = float32
  fix      kdaops + idx32 + mhcproj + comb32 together; fix+sel, kdaops+sel: with the selection replayed
Since the commit after this script's: the library runs the KDA twin (`kdaops`) and the indexer's score
matmuls (`idx32`) outside autocast, so `base` includes both; the figures quoted in the issue notes
were measured before (base 1.98e-2 / 0.043, kdaops 8.6e-3 / 0.028 at 4 layers, 600 tokens).
Part 2, local (per --local patch set): each sub-layer fed the *same* bf16 inputs (captured from one
training forward): rel-RMS of its training-path output and of its decode-path output (prefill chunks
through the cache, then one token at a time) against an fp32 run of the module on those inputs, and of
the two paths against each other; "floor" is the fp32 output's own bf16 rounding. For the DSA layer, how
many queries' selections differ although the inputs are the same (bf16 score ties that torch.topk
resolves differently for the decode path's shorter rows).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
import types
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import longctx.layers.kda as kda_mod
import longctx.layers.residual as res_mod
from longctx.config import preset
from longctx.layers.dsa import SparseMLA
from longctx.layers.kda import KDAState, KimiDeltaAttention
from longctx.layers.kpool_indexer import _DEFAULT, KPoolIndexer
from longctx.layers.mlp import DenseMLP
from longctx.layers.moe import Experts, MoE
from longctx.model import LongCtxModel

BF16 = torch.bfloat16


def no_autocast():
    return torch.autocast("cpu", enabled=False)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.float(), ref.float()
    return ((a - ref).pow(2).mean() / ref.pow(2).mean().clamp_min(1e-30)).sqrt().item()


# ------------------------------------------------------------------ speed only (same numbers)
_EXPERT_CASTS: dict = {}
_experts_forward = Experts.forward


def _cached_experts_forward(self, xs, counts, impl):
    """Experts.forward with its per-call `.to(xs.dtype)` of all experts' weights done once (the weights
    never change here): identical values, but a decode step no longer copies 3 x 113M weights."""
    if xs.dtype == self.gate_up.dtype:
        return _experts_forward(self, xs, counts, impl)
    key = (id(self), xs.dtype)
    if key not in _EXPERT_CASTS:
        _EXPERT_CASTS[key] = (self.gate_up.detach().to(xs.dtype), self.down.detach().to(xs.dtype))
    shim = types.SimpleNamespace(gate_up=_EXPERT_CASTS[key][0], down=_EXPERT_CASTS[key][1],
                                 intermediate=self.intermediate, limit=self.limit)
    shim._act = functools.partial(Experts._act, shim)
    return _experts_forward(shim, xs, counts, impl)


Experts.forward = _cached_experts_forward


# ------------------------------------------------------------------ patches (precision only)
@contextlib.contextmanager
def patched(obj, name, value):
    had = name in vars(obj)
    old = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


def _to32(a):
    return a.float() if torch.is_tensor(a) and a.is_floating_point() else a


def _back(o, dt):
    if torch.is_tensor(o):
        return o.to(dt) if o.is_floating_point() and dt is not None else o
    if isinstance(o, tuple):
        return tuple(_back(x, dt) for x in o)
    return o


def fp32_call(fn):
    """fn run outside autocast on fp32 copies of its float tensor arguments; float outputs cast back
    to the dtype of its first float argument (so the residual stream keeps its dtype)."""

    def call(*args, **kw):
        dt = next((a.dtype for a in args if torch.is_tensor(a) and a.is_floating_point()), None)
        with no_autocast():
            out = fn(*[_to32(a) for a in args], **{k: _to32(v) for k, v in kw.items()})
        return _back(out, dt)

    return call


def modules_fp32(pred):
    @contextlib.contextmanager
    def ctx(model):
        with contextlib.ExitStack() as st:
            for m in model.modules():
                if pred(m):
                    st.enter_context(patched(m, "forward", fp32_call(m.forward)))
            yield
    return ctx


def mhc_fp32(model):
    """Every mHC enter/exit outside autocast in fp32; their outputs back in the streams' dtype."""
    st = contextlib.ExitStack()
    for m in model.modules():
        if isinstance(m, res_mod.MHC):
            enter, exit_ = m.enter, m.exit

            def e(streams, enter=enter):
                with no_autocast():
                    x, ctx = enter(streams.float())
                return x.to(streams.dtype), ctx

            def x_(streams, ctx, y, exit_=exit_):
                with no_autocast():
                    return exit_(streams.float(), ctx, y.float()).to(streams.dtype)

            st.enter_context(patched(m, "enter", e))
            st.enter_context(patched(m, "exit", x_))
    return st


@contextlib.contextmanager
def res_fp32(model):
    """mhc_fp32 and streams kept in fp32 from the embedding on (no bf16 cast of the residual state)."""
    with mhc_fp32(model), patched(model, "embed_state", lambda ids: model.stream.init(model.embed(ids))):
        yield


@contextlib.contextmanager
def kda_ops_fp32(model):
    with patched(kda_mod, "kda_chunk", fp32_call(kda_mod.kda_chunk)), \
         patched(kda_mod, "kda_step", fp32_call(kda_mod.kda_step)):
        yield


def _pool_scores_fp32(self, q_latent, x, pk):
    """KPoolIndexer.pool_scores with its two score matmuls really in fp32 (its .float() casts are undone
    by autocast otherwise); the projections stay as they are."""
    B, c = x.shape[:2]
    q = self.wq_b(q_latent).view(B, c, self.n_heads, self.head_dim)
    w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads**-0.5
    with no_autocast():
        s = torch.matmul(q.float(), pk.float().transpose(-1, -2).unsqueeze(1))
        s = torch.relu(s * self.head_dim**-0.5)
        return torch.matmul(w.float().unsqueeze(-2), s).squeeze(-2)


@contextlib.contextmanager
def idx_fp32(model):
    with patched(KPoolIndexer, "pool_scores", _pool_scores_fp32):
        yield


@contextlib.contextmanager
def mhc_proj_fp32(model):
    orig = res_mod._mhc_project

    def proj(streams, fn, eps):
        with no_autocast():
            return orig(streams, fn, eps)

    with patched(res_mod, "_mhc_project", proj):
        yield


@contextlib.contextmanager
def combine_fp32(model):
    with contextlib.ExitStack() as st:
        for m in model.modules():
            if isinstance(m, MoE):
                st.enter_context(patched(m, "combine_dtype", torch.float32))
        yield


def both(*ps):
    @contextlib.contextmanager
    def ctx(model):
        with contextlib.ExitStack() as st:
            for p in ps:
                st.enter_context(p(model))
            yield
    return ctx


def nothing(model):
    return contextlib.nullcontext()


VARIANTS = {  # name: (patch, replay the DSA selection, fp32 KDA conv cache)
    "base": (nothing, False, False),
    "sel": (nothing, True, False),
    "kda32": (modules_fp32(lambda m: isinstance(m, KimiDeltaAttention)), False, True),
    "dsa32": (modules_fp32(lambda m: isinstance(m, SparseMLA)), False, False),
    "mlp32": (modules_fp32(lambda m: isinstance(m, (MoE, DenseMLP))), False, False),
    "mhc32": (mhc_fp32, False, False),
    "res32": (res_fp32, False, False),
    "kdaops": (kda_ops_fp32, False, False),
    "idx32": (idx_fp32, False, False),
    "mhcproj": (mhc_proj_fp32, False, False),
    "comb32": (combine_fp32, False, False),
    "fix": (both(kda_ops_fp32, idx_fp32, mhc_proj_fp32, combine_fp32), False, False),
    "fix+sel": (both(kda_ops_fp32, idx_fp32, mhc_proj_fp32, combine_fp32), True, False),
    "kdaops+sel": (kda_ops_fp32, True, False),
}


# ------------------------------------------------------------------ routing / selection record, replay
@contextlib.contextmanager
def recorded_routing(model):
    """tests/test_gpu_end_to_end.py's `recorded_routing` (expert choices recorded in token order in the
    training forward, replayed by a per-layer cursor), with its `rewind()` so that the fp32 reference
    forward can replay them once more after the decode path."""
    from test_gpu_end_to_end import recorded_routing as recorded

    with recorded(model) as replay:
        yield types.SimpleNamespace(replay=replay, rewind=replay.rewind)


# ------------------------------------------------------------------ selection record / replay
@contextlib.contextmanager
def recorded_selection(model, replay_selection: bool):
    """Records each indexer's selection in the training forward (one call over the whole sequence);
    after `.replay()`, every decode-path call still runs the indexer (its cache stays current) and its
    rows are compared with the recorded ones; with replay_selection they are replaced by them."""
    rec, st = {}, {"replay": False, "force": False, "diff": 0, "total": 0, "rows": 0, "rows_diff": 0}
    orig = KPoolIndexer.select

    def select(self, x, q_latent, chunk=_DEFAULT, cache=None):
        start = 0 if cache is None else cache.length
        out = orig(self, x, q_latent, chunk=chunk, cache=cache)
        if not st["replay"]:
            rec[self] = out
            return out
        want = rec[self][:, start : start + out.shape[1]]
        if st["force"]:  # the fp32 reference forward: always the training forward's selection
            return want.clone()
        for a, b in zip(out.reshape(-1, out.shape[-1]), want.reshape(-1, want.shape[-1])):
            a, b = a[a >= 0], b[b >= 0]
            d = int((~torch.isin(b, a)).sum())
            st["diff"] += d
            st["total"] += b.numel()
            st["rows"] += 1
            st["rows_diff"] += d > 0
        return want.clone() if replay_selection else out

    with patched(KPoolIndexer, "select", select):
        yield types.SimpleNamespace(replay=lambda: st.__setitem__("replay", True),
                                    force=lambda: st.__setitem__("force", True), stats=st)


# ------------------------------------------------------------------ part 1: end to end
def run_pair(model, ids, N, chunk, variant, ref=True):
    """Decode path vs training forward (both bf16) under `variant`; with `ref`, both also against an fp32
    forward (autocast off) that replays the bf16 training forward's routing and selection."""
    patch, replay_sel, conv32 = VARIANTS[variant]
    S = ids.shape[1]
    train, dec, fp32 = {}, defaultdict(list), {}
    phase = ["train"]

    def hook(key):
        def h(mod, inp, out):
            y = out[0] if isinstance(out, tuple) else out
            if phase[0] == "train":
                train[key] = y[:, S - N - 1 : S - 1].float()
            elif phase[0] == "decode":
                dec[key].append(y.float())
            elif phase[0] == "ref":
                fp32[key] = y[:, S - N - 1 : S - 1].float()
        return h

    handles = []
    for i, b in enumerate(model.layers):
        handles += [b.register_forward_hook(hook(("blk", i))), b.mixer.register_forward_hook(hook(("mix", i))),
                    b.mlp.register_forward_hook(hook(("mlp", i)))]
    try:
        with contextlib.ExitStack() as st:
            routing = st.enter_context(recorded_routing(model))
            sel = st.enter_context(recorded_selection(model, replay_sel))
            st.enter_context(patch(model))
            st.enter_context(torch.autocast("cpu", dtype=BF16))
            h = model.hidden(ids)[:, S - N - 1 : S - 1]
            full = torch.log_softmax(model.lm_head(h).float(), -1).gather(-1, ids[:, S - N :, None]).squeeze(-1)
            routing.replay()
            sel.replay()
            caches = model.init_caches(1, device="cpu", dtype=BF16)
            if conv32:
                for c in caches:
                    if isinstance(c, KDAState):
                        c.conv = c.conv.float()
            phase[0] = "prefill"
            for s0 in range(0, S - N - 1, chunk):
                model.hidden(ids[:, s0 : min(s0 + chunk, S - N - 1)], caches=caches)
            phase[0] = "decode"
            lps, hs = [], []
            for t in range(S - N, S):
                hd = model.hidden(ids[:, t - 1 : t], caches=caches)
                hs.append(hd)
                lps.append(torch.log_softmax(model.lm_head(hd)[:, -1].float(), -1).gather(-1, ids[:, t : t + 1]))
            if ref:
                phase[0] = "ref"
                routing.rewind()
                sel.force()
                with no_autocast():
                    h32 = model.hidden(ids)[:, S - N - 1 : S - 1]
    finally:
        for hd_ in handles:
            hd_.remove()
    out = {k: rel(torch.cat(v, 1), train[k]) for k, v in dec.items()}
    out["hidden"] = rel(torch.cat(hs, 1), h)
    if ref:
        for k, v in fp32.items():
            out[("ref_train",) + k] = rel(train[k], v)
            out[("ref_dec",) + k] = rel(torch.cat(dec[k], 1), v)
        out["ref_train"], out["ref_dec"] = rel(h, h32), rel(torch.cat(hs, 1), h32)
        lp32 = torch.log_softmax(model.lm_head(h32).float(), -1).gather(-1, ids[:, S - N :, None]).squeeze(-1)
        out["lp_ref_train"] = (full - lp32).abs().mean().item()
        out["lp_ref_dec"] = (torch.cat(lps, 1) - lp32).abs().mean().item()
    out["lp"] = (torch.cat(lps, 1) - full).abs().mean().item()
    s = sel.stats
    out["sel"] = s["diff"] / s["total"] if s["total"] else float("nan")
    out["selrows"] = s["rows_diff"] / s["rows"] if s["rows"] else float("nan")
    return out


# ------------------------------------------------------------------ part 2: local, same inputs
def local_errors(model, ids, N, chunk, patch_name):
    """Per sub-layer: the bf16 training-path and decode-path outputs on identical inputs against fp32."""
    patch = VARIANTS[patch_name][0]
    S = ids.shape[1]
    caps, handles = {}, []
    for i, b in enumerate(model.layers):
        for kind, m in (("mix", b.mixer), ("mlp", b.mlp)):
            handles.append(m.register_forward_hook(
                lambda mod, inp, out, key=(kind, i): caps.__setitem__(key, (inp[0], out))))
    try:
        with patch(model), torch.autocast("cpu", dtype=BF16):
            model.hidden(ids)
    finally:
        for hd in handles:
            hd.remove()
    rows = []
    last = slice(S - N - 1, S - 1)
    for i, b in enumerate(model.layers):
        for kind, m in (("mix", b.mixer), ("mlp", b.mlp)):
            x, y_train = caps[(kind, i)]
            sel_train = y_train[1] if isinstance(y_train, tuple) else None
            y_train = y_train[0] if isinstance(y_train, tuple) else y_train
            name = {KimiDeltaAttention: "KDA", SparseMLA: "DSA", MoE: "MoE"}.get(type(m), "MLP")
            if name == "DSA" and m.indexer is None:
                continue  # a shared-selection layer needs its full layer's selection: skipped
            with no_autocast():
                y_ref = m(x.float())
                y_ref = (y_ref[0] if isinstance(y_ref, tuple) else y_ref)[:, last]
            with patch(model), torch.autocast("cpu", dtype=BF16):
                ys, sels = [], []
                if kind == "mix":
                    cache = m.init_state(1, "cpu", BF16) if name == "KDA" else m.init_cache(1, "cpu", BF16)
                    kw = (lambda c: {"state": c}) if name == "KDA" else (lambda c: {"cache": c})
                    for s0 in range(0, S - N - 1, chunk):
                        y = m(x[:, s0 : min(s0 + chunk, S - N - 1)], **kw(cache))
                        sels.append(y[1] if isinstance(y, tuple) else None)
                    for t in range(S - N - 1, S - 1):
                        y = m(x[:, t : t + 1], **kw(cache))
                        ys.append(y[0] if isinstance(y, tuple) else y)
                        sels.append(y[1] if isinstance(y, tuple) else None)
                else:
                    ys = [m(x[:, t : t + 1]) for t in range(S - N - 1, S - 1)]
            y_dec = torch.cat(ys, 1)
            yt = y_train[:, last]
            extra = ""
            if sel_train is not None:  # the same inputs: a different selection is a tie resolved differently
                a, b = torch.cat(sels, 1)[0], sel_train[0, : S - 1]
                rows_diff = (a != b).any(-1)
                toks = sum(int((~torch.isin(b[r][b[r] >= 0], a[r][a[r] >= 0])).sum()) for r in rows_diff.nonzero()[:, 0])
                extra = (f"  selection differs in {int(rows_diff.sum())}/{S - 1} queries "
                         f"({toks} of {int((b >= 0).sum())} selected tokens)")
            rows.append((f"{kind}{i} {name}", rel(yt, y_ref), rel(y_dec, y_ref), rel(y_dec, yt),
                         rel(y_ref.to(BF16), y_ref), extra))
    return rows


# ------------------------------------------------------------------ main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seqs", default="600", help="comma-separated sequence lengths")
    ap.add_argument("--last", type=int, default=16, help="decoded tokens compared")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk")
    ap.add_argument("--topk", type=int, default=256, help="index_topk (0: the preset's 2048)")
    ap.add_argument("--variants", default="base,sel,kdaops",
                    help=f"comma-separated, of {','.join(VARIANTS)}")
    ap.add_argument("--local", default="base,kdaops", help="patch sets for part 2 ('' skips it)")
    ap.add_argument("--no-ref", dest="ref", action="store_false",
                    help="skip the fp32 reference forward (the 'vs fp32' lines)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: with other jobs on the cores, 2 threads spin on the tiny per-channel "
                         "convs and a decode step takes 20 s instead of 0.2 s)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    kw = {"num_layers": a.layers, "mlp_pattern": "d" + "m" * (a.layers - 1)}
    if a.topk:
        kw["index_topk"] = a.topk
    cfg = preset("h200-ref").replace(**kw)
    torch.manual_seed(0)
    model = LongCtxModel(cfg).eval()
    torch.nn.init.normal_(model.lm_head.weight, 0.0, 3.0 / cfg.hidden_size**0.5)
    print(f"h200-ref, {cfg.num_layers} layers {cfg.layer_kinds()} / {cfg.mlp_kinds()}, index_topk {cfg.index_topk}, "
          f"last {a.last} tokens, prefill chunk {a.chunk}; rel-RMS decode vs training", flush=True)
    for S in (int(s) for s in a.seqs.split(",")):
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (1, S), generator=g)
        L = cfg.num_layers
        head = "".join(f"  blk{i}({k})" for i, k in enumerate(cfg.layer_kinds()))
        print(f"\nS={S}  variant   {head}    hidden  logprob  sel-diff | mix0..{L - 1} / mlp0..{L - 1}", flush=True)
        with torch.no_grad():
            for v in a.variants.split(","):
                t0 = time.perf_counter()
                r = run_pair(model, ids, a.last, a.chunk, v, ref=a.ref)
                blk = "".join(f"  {r[('blk', i)]:9.2e}" for i in range(L))
                mix = " ".join(f"{r[('mix', i)]:.1e}" for i in range(L))
                mlp = " ".join(f"{r[('mlp', i)]:.1e}" for i in range(L))
                print(f"S={S}  {v:<8}{blk}  {r['hidden']:9.2e}  {r['lp']:.4f}  {r['sel']:7.2%} | {mix} / {mlp}"
                      f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
                if a.ref:
                    for who in ("train", "dec"):
                        blk = "".join(f"  {r[('ref_' + who, 'blk', i)]:9.2e}" for i in range(L))
                        print(f"S={S}  {'':<8}{blk}  {r['ref_' + who]:9.2e}  {r['lp_ref_' + who]:.4f}"
                              f"   <- {'training' if who == 'train' else 'decode'}"
                              " path vs fp32 forward (same routing and selection)", flush=True)
            for p in filter(None, a.local.split(",")):
                t0 = time.perf_counter()
                rows = local_errors(model, ids, a.last, a.chunk, p)
                print(f"\nS={S} local errors, patch {p!r}: rel-RMS over the last {a.last} tokens "
                      f"({time.perf_counter() - t0:.0f} s)")
                print("  sub-layer   train-vs-fp32  decode-vs-fp32  decode-vs-train  bf16-floor")
                for name, tr, de, dt, fl, extra in rows:
                    print(f"  {name:<10}  {tr:12.2e}  {de:14.2e}  {dt:15.2e}  {fl:10.2e}{extra}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
