"""How large the union of neighbouring queries' DSA selections is: U_G / k for G = 2, 4, 8 (the quantity the
union mode's cost model runs on, longctx/ops/sparse_attention/union.py). CPU only.

    python bench/union_size.py --ckpt runs/demo [--seqlen 4096] [--out bench/results]

Measures, each on held-out stdlib text (the embedded corpus's eval documents):
- `h200_ref_random_init`: a random-init h200-ref model cut to its first KKKD blocks, the DSA layer's k-pool
  indexer after three KDA blocks (the real trunk at init) at `--seqlen`; and the same indexer fed the
  block's normed embeddings only (`h200_ref_layer_on_embeddings`, what bench/sparse_attention.py's `indexer`
  workload runs), at longer lengths too;
- `small_trained`: the `small` preset trained by `longctx train` (the checkpoint in --ckpt), its DSA layer's
  selections at `--seqlen`; `small_random_init`: the same model freshly initialised;
- `independent`: what independent picks of the same number of pools would give (the chance overlap);
- `trained_like_fit`: the redraw rate of `naive.persistent_pool_indices` (h200-ref's 2,051 slots) whose
  U_4 / k matches the trained model's, which the benchmark's `trained_like` workload uses.
Writes OUT/union_size.json.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import env_record, write_results

from longctx.ops.sparse_attention import union as un
from longctx.ops.sparse_attention.naive import persistent_pool_indices

GROUPS = (2, 4, 8)


def held_out_ids(S: int, windows: int) -> torch.Tensor:
    """[windows, S] byte ids from the corpus's held-out documents, consecutive windows."""
    from longctx.data.sources import stdlib_corpus

    _, held = stdlib_corpus()
    data = torch.frombuffer(bytearray("".join(d.text for d in held).encode()), dtype=torch.uint8).long()
    return torch.stack([data[(w * S + torch.arange(S)) % data.numel()] for w in range(windows)])


@torch.no_grad()
def selection(model, ids: torch.Tensor, trunk: bool = True) -> torch.Tensor:
    """The first DSA layer's selection for ids [B, S]: run the blocks before it (trunk) or feed it the normed
    embeddings (trunk=False), then its indexer."""
    layer = model.cfg.layer_kinds().index("D")
    state = model.embed_state(ids)
    sel = None
    if trunk:
        for block in model.layers[:layer]:
            state, sel = block(state, sel)
    block = model.layers[layer]
    x, _ = block.mixer_res.enter(state)
    x = block.mixer_norm(x)
    mixer = block.mixer
    return mixer.indexer.select(x, mixer.q_a_norm(mixer.q_a_proj(x)))


def sizes(sel: torch.Tensor, S_kv: int) -> dict:
    """U_G / k over every window of 8 queries past the dense prefix (queries that see fewer pools than they
    select take all of them, so their neighbours trivially agree)."""
    return {str(G): r for G, r in un.union_sizes(sel, S_kv, GROUPS, windows=None).items()}


def past_prefix(sel: torch.Tensor, topk: int) -> torch.Tensor:
    return sel[:, topk + 8:].contiguous()


def independent(n_sel: int, n_pools: int) -> dict:
    """U_G / k for G independent uniform picks of n_sel pools among n_pools."""
    f = n_sel / n_pools
    return {str(G): (1 - (1 - f) ** G) / f for G in GROUPS}


def fit_redraw(target_r4: float, S: int = 16384, K: int = 2051) -> dict:
    """Bisection (log scale) on persistent_pool_indices' redraw rate for U_4 / k = target_r4."""
    lo, hi = 1e-4, 1.0

    def r_of(rd):
        sel = persistent_pool_indices(S, K, rd, device="cpu", generator=torch.Generator().manual_seed(0))[None]
        return un.union_sizes(past_prefix(sel, K), S, GROUPS, windows=512)

    for _ in range(9):
        mid = math.sqrt(lo * hi)
        if r_of(mid)[4] < target_r4:
            lo = mid
        else:
            hi = mid
    rd = math.sqrt(lo * hi)
    return {"redraw": rd, "S": S, "K": K, "ratios": {str(G): v for G, v in r_of(rd).items()}, "target_r4": target_r4}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True, help="the trained small run (longctx train's output directory)")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--windows", type=int, default=2, help="held-out windows per measurement")
    ap.add_argument("--embed-seqlens", default="8192,16384", help="lengths of the h200-ref layer-on-embeddings run")
    ap.add_argument("--skip-h200-trunk", action="store_true", help="skip the (slow on CPU) h200-ref trunk")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()

    from longctx import checkpoint
    from longctx.config.model import preset
    from longctx.model import LongCtxModel

    torch.manual_seed(0)
    S = args.seqlen
    res = {**env_record(), "groups": list(GROUPS), "seqlen": S, "windows": args.windows,
           "note": "U_G/k: mean union size of a group of G consecutive queries over a query's mean valid slots, "
                   "over every window of 8 queries past the first topk + 8 (dense-prefix) queries",
           "measurements": {}}
    meas = res["measurements"]
    ids = held_out_ids(S, args.windows)

    # the trained small model, and the same model at init
    cfg_small = preset("small")
    trained = LongCtxModel(cfg_small)
    checkpoint.load(args.ckpt, trained)
    trained.eval()
    fresh = LongCtxModel(cfg_small).eval()
    for name, model in (("small_trained", trained), ("small_random_init", fresh)):
        t0 = time.time()
        sel = past_prefix(selection(model, ids), cfg_small.index_topk)
        meas[name] = {"preset": "small", "seqlen": S, "ratios": sizes(sel, S), "seconds": time.time() - t0,
                      "independent": independent(cfg_small.index_topk // cfg_small.index_pool, S // cfg_small.index_pool)}
        print(name, meas[name], flush=True)
    res["checkpoint"] = str(args.ckpt)

    # h200-ref at init
    cfg = preset("h200-ref")
    small_cfg = cfg.replace(num_layers=4, mlp_pattern="dmmm")
    model = LongCtxModel(small_cfg).eval()
    n_sel = cfg.index_topk // cfg.index_pool
    if not args.skip_h200_trunk:
        t0 = time.time()
        sel = past_prefix(selection(model, ids[:1]), cfg.index_topk)
        meas["h200_ref_random_init"] = {"preset": "h200-ref (first 4 blocks)", "seqlen": S, "ratios": sizes(sel, S),
                                        "seconds": time.time() - t0, "independent": independent(n_sel, S // 4)}
        print("h200_ref_random_init", meas["h200_ref_random_init"], flush=True)
    meas["h200_ref_layer_on_embeddings"] = []
    for L in (int(v) for v in args.embed_seqlens.split(",")):
        t0 = time.time()
        sel = past_prefix(selection(model, held_out_ids(L, 1), trunk=False), cfg.index_topk)
        row = {"seqlen": L, "ratios": sizes(sel, L), "seconds": time.time() - t0, "independent": independent(n_sel, L // 4)}
        meas["h200_ref_layer_on_embeddings"].append(row)
        print("h200_ref_layer_on_embeddings", row, flush=True)

    target = meas["small_trained"]["ratios"]["4"]
    res["trained_like_fit"] = fit_redraw(target)
    print("trained_like_fit", res["trained_like_fit"], flush=True)
    write_results(args.out, "union_size.json", res)


if __name__ == "__main__":
    main()
