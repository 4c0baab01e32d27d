"""Union mode of DSA sparse attention: G neighbouring queries attend together over the union of their
selections (plain torch: the union's construction, the cost model that picks G, and the torch twin of the
union kernels in `triton.py`).

For a group of G consecutive queries t0 .. t0+G-1 with selections I_t (-1 = unused slot), the union U is
the set of rows any of them selected; the kernel's tile then has G x H rows (query, head), each gathered
latent row is loaded once for all G queries, and the score of a (query, row) pair the query did not
select is -inf. The backward sums each union row's dKV contribution over all G x H rows in the MMA before
one atomic per (group, row), instead of one per (query, row). Same function, summed in another order.

The union, packed: int32 [B, NG, U_pad] (NG = ceil(S / G)), slot = (row << 8) | bits, bit g set when
query t0+g selected the row, -1 for padding; `length` [B, NG] is each group's number of slots. Slots are
in ascending row order (neighbouring rows of a pool are neighbours in memory). A query whose list repeats
a row attends to it once per repetition (the reference's softmax counts every slot), so the union holds
the row once per occurrence: the m-th occurrence of row j in any query's list is the pair (j, m), and the
union is over those pairs; each query is then a member of a slot at most once, and a bit is enough.
Indices outside [0, S_kv) are unused slots, as in the kernel.

The build (`build_union`) takes the selection's form into account. The indexer's selections list each
query's rows strictly ascending (`KPoolIndexer.select`: the pools ascending, then the query's own
incomplete pool, -1 after; `persistent_pool_indices` has -1s between the pools too), and for those the
union is a merge, not a sort (`_union_by_merge`): each query's in-range rows are moved to the front of its
list in order (a cumsum and a scatter: -1s may sit anywhere) as keys (row << 8) | (1 << g), then log2(G)
rounds merge pairs of lists (G padded to a power of two with empty lists) with two batched searchsorted
calls, a_i to i + #(b < a_i) and b_j to j + #(a <= b_j), and a last pass gives each distinct row one slot
with its keys' bits or-ed (a cumsum over row changes and a scatter-add). Any other selection (a row
repeated within a query, a list out of order, as `causal_pool_indices`' shuffled slots) is built by one
sort of each group's G x K keys by (row, query) (`_union_of_groups`), which also counts the repeats. A
check on the device decides: every list's in-range rows strictly ascending; it is read back in the build's
one host sync, with the union's width, and when it fails the merge's result is discarded and the sort
builds the union. This is a choice of algorithm by the input's form, not a fallback between backends:
both builds give the same Union (same packed, length and width); `method="merge"` or
`"sort"` forces one (benchmarks, tests). The merge build holds one int32 [groups, G x K] buffer of the whole
sequence until that sync (the union's width is not known before it).

The cost model (per query, H200, from bench/results/sparse_attention.json at 128k). A program of M rows
costs c(M) per slot it visits; the per-query kernel visits k ~ 2051 slots per query at M = H; the union kernel
visits U_G slots per group of G queries at M = G x H (rows padded to 16 .. 64; more than 64 rows take
ceil(G H / 64) programs that each visit the whole union):

    M     fwd ns/slot   bwd ns/slot   what bounds it
    16    0.267         1.330         fwd: the gather (1 KB a slot, ~3.8 TB/s); bwd: fp32 dKV atomics (4 KB)
    32    0.45 (est.)   1.60 (est.)   between the two (no measured H = 32 run)
    64    0.690         2.505         MMAs: fwd 2 x 64 x 1024 flop a slot at 190 TFLOP/s, bwd 2.5x at 131

    t(G) = ceil(G H / 64) x (U_G / G) x (c_fwd(M) + c_bwd(M)) + c_build x k      (t(1) = k (c_fwd + c_bwd)(H))

Flops per query grow as U_G / k (the masked pairs are computed too), gathered bytes per query are
U_G / G rows of 1 KB instead of k, and dKV atomics per query are U_G / G instead of k (4 KB of fp32
read-modify-write each). At H = 16 that is t(1) = 1.597 k ns against t(4) = 0.799 (U_4 / k) k and
t(2) = 1.025 (U_2 / k) k: G = 4 breaks even at U_4 / k = 2.0 and is 2.0 / (U_4 / k) x faster (so 2x needs
every query of a group to select the same rows); G = 2 breaks even at U_2 / k = 1.56; with the build and
the 10% margin below, G = 4 is chosen while U_4 / k < 1.61 and G = 2 while U_2 / k < 1.26. G = 8 at 16
heads needs two programs per group and never beats G = 4. At H = 64
only G = 1 has M <= 64 (two programs of 64 rows per group would each re-gather the union and do U_G / k
times the flops of a kernel that is already MMA-bound), so the model keeps the per-query kernel. The build is
costed at c_build = 0.15 ns a (query, slot), the merge build's on the H200 (10.1 ms at 32k, 38.9 ms at
128k on trained-like selections, `bench/sparse_attention.py --union-only`). G is chosen from U_G / k
measured on a sample of 128 windows of 8 queries spread over the sequence, and only where the model
predicts at least 10% less time than G = 1 (`choose_group`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

GROUPS = (1, 2, 4, 8)
MAX_GROUP = 8
ROW_SHIFT = 8  # bits under the row: one per query of a group of up to 8
MAX_ROWS = 1 << (31 - ROW_SHIFT)  # rows the int32 packing holds (8.4M tokens of latent)
MAX_PROGRAM_ROWS = 64  # (query, head) rows per program: an fp32 [64, 512] accumulator is half the register file
ENV = "LONGCTX_SPARSE_GROUP"  # "1", "2", "4", "8" or "auto": overrides the choice (benchmarks, comparisons)

# ns per (program, slot) on the H200 by program rows M, and the union's construction per (query, slot)
COST_FWD = {16: 0.267, 32: 0.45, 64: 0.690}
COST_BWD = {16: 1.330, 32: 1.60, 64: 2.505}
COST_BUILD = 0.15
MARGIN = 0.9  # leave G = 1 only for a predicted gain of at least 10%
SAMPLE_WINDOWS = 128
_INT32_MAX = 2**31 - 1


@dataclass
class Union:
    """The union of each group's selections (module docstring): packed int32 [B, NG, U_pad], length int32
    [B, NG]; G queries per group; S queries in all (the last group may be partial)."""

    G: int
    S: int
    packed: torch.Tensor
    length: torch.Tensor

    @property
    def groups(self) -> int:
        return self.packed.shape[1]


def program_rows(M: int) -> int:
    """Rows of one program for M (query, head) rows: a power of two in [16, 64]."""
    return min(MAX_PROGRAM_ROWS, max(16, 1 << max(0, M - 1).bit_length()))


def _group_keys(x: torch.Tensor, G: int, S_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, G, K] (the G queries of R groups) -> (sorted int32 keys row * G + g [R, G K], their validity)."""
    R, _, K = x.shape
    g = torch.arange(G, device=x.device, dtype=torch.int64).view(1, G, 1)
    ok = (x >= 0) & (x < S_kv)
    key = torch.where(ok, x.long() * G + g, _INT32_MAX).to(torch.int32).view(R, G * K)
    key = key.sort(dim=1).values
    return key, key != _INT32_MAX


def _union_of_groups(x: torch.Tensor, G: int, S_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, G, K] indices of R groups of G queries -> (packed int32 [R, G K], length int64 [R]).

    After one sort by (row, query), equal keys are one query's repeats of a row: the m-th of them is
    occurrence m. A row takes as many slots as its most repeated occurrence count over the group
    (one, without repeats), so slot = (the row's first slot) + occurrence."""
    R, _, K = x.shape
    W = G * K
    key, ok = _group_keys(x, G, S_kv)
    key = key.long()
    row, gq = key // G, key % G
    pos = torch.arange(W, device=x.device).expand(R, W)
    new_key = torch.ones_like(ok)
    new_key[:, 1:] = key[:, 1:] != key[:, :-1]
    occ = pos - torch.where(new_key, pos, 0).cummax(dim=1).values
    new_row = torch.ones_like(ok)
    new_row[:, 1:] = row[:, 1:] != row[:, :-1]
    rid = new_row.long().cumsum(1) - 1  # which distinct row (the invalid tail is one more "row")
    mult = torch.zeros(R, W, dtype=torch.int64, device=x.device)
    mult.scatter_reduce_(1, rid, torch.where(ok, occ + 1, 0), "amax")
    first = mult.cumsum(1) - mult
    slot = torch.where(ok, first.gather(1, rid) + occ, W)  # W: a dump column for the invalid tail
    bits = torch.zeros(R, W + 1, dtype=torch.int64, device=x.device)
    bits.scatter_add_(1, slot, torch.where(ok, 1 << gq, 0))  # each (slot, query) once: the sum is an or
    rows = torch.zeros(R, W + 1, dtype=torch.int64, device=x.device)
    rows.scatter_(1, slot, torch.where(ok, row, 0))  # every writer of a slot writes its one row
    packed = torch.where(bits > 0, (rows << ROW_SHIFT) | bits, -1)[:, :W].to(torch.int32)
    length = torch.where(ok, slot + 1, 0).amax(1)
    return packed, length


def _grouped(idx: torch.Tensor, G: int) -> torch.Tensor:
    """idx [B, S, K] -> [B, NG, G, K], the last group padded with queries that select nothing."""
    B, S, K = idx.shape
    NG = -(-S // G)
    if NG * G != S:
        idx = torch.cat([idx, idx.new_full((B, NG * G - S, K), -1)], 1)
    return idx.view(B, NG, G, K)


# ------------------------------------------------------------------- the merge build (ascending selections)
_SENTINEL = (MAX_ROWS - 1) << ROW_SHIFT  # a key above every row the merge build takes, its bits 0


def _merge_lists(x: torch.Tensor, S_kv: int, Gp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, G, K] -> (keys int32 [Gp, R, K], bad: a device bool). List g of group r holds query g's
    in-range rows as keys (row << 8) | (1 << g) in its order, moved to the front (a stable compaction: the
    -1 slots may sit anywhere), then _SENTINEL; lists g >= G are empty (G padded to a power of two).
    bad: some list is not strictly ascending (a repeat, or an unsorted list)."""
    R, G, K = x.shape
    xt = x.transpose(0, 1)  # [G, R, K]: list g of every group, so the merge tree's halves are contiguous
    ok = xt >= 0
    ok &= xt < S_kv
    bit = (1 << torch.arange(G, device=x.device, dtype=torch.int32)).view(G, 1, 1)
    key = torch.where(ok, (xt.to(torch.int32) << ROW_SHIFT) | bit, _SENTINEL)
    # the compaction: an in-range slot goes to (in-range slots before it), an unused one to n + (unused
    # slots before it), n the list's in-range slots
    cv = ok.cumsum(-1, dtype=torch.int32)
    n = cv[..., -1:].clone()
    cv -= 1
    unused = n + torch.arange(-1, K - 1, device=x.device, dtype=torch.int32)
    unused -= cv
    keys = torch.empty(Gp, R, K, device=x.device, dtype=torch.int32)
    keys[:G].scatter_(2, torch.where(ok, cv, unused).long(), key)
    if Gp > G:
        keys[G:] = _SENTINEL
    # strictly ascending in-range rows <=> the only non-increasing neighbours are pairs of sentinels,
    # K - 1 - n of them a list (a count, not a mask of the violations)
    ties = torch.count_nonzero(keys[:G, :, 1:] <= keys[:G, :, :-1])
    return keys, ties != (K - 1 - n).clamp(min=0).sum()


def _merge(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two batches of ascending key lists [h, R, L] -> their merges [h, R, 2L]: a_i goes to i + #(b < a_i),
    b_j to j + #(a <= b_j), a permutation of 0 .. 2L-1 (the sentinels of both included), so nothing is
    filled. A row two lists share becomes two neighbouring keys (its bits differ); `_dedup` joins them."""
    h, R, L = a.shape
    ar = torch.arange(L, device=a.device)
    out = torch.empty(h, R, 2 * L, device=a.device, dtype=a.dtype)
    out.scatter_(2, torch.searchsorted(b, a, side="left").add_(ar), a)
    out.scatter_(2, torch.searchsorted(a, b, side="right").add_(ar), b)
    return out


def _dedup(m: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """m [R, W]: merged keys, ascending, sentinels last -> `out` [R, W] (zeros) holds each distinct row once,
    its bits or-ed (the bits of one row's keys are disjoint: a sum is an or), in the first `length` slots;
    what lies past `length` is not -1 yet. Returns length, int32 [R]."""
    R, W = m.shape
    new = torch.empty(R, W, device=m.device, dtype=torch.bool)
    new[:, 0] = False
    torch.ge(m[:, 1:] ^ m[:, :-1], 1 << ROW_SHIFT, out=new[:, 1:])  # the row changes (keys are >= 0)
    slot = new.cumsum(1, dtype=torch.int32)
    new[:, 0] = True
    out.scatter_add_(1, slot.long(), torch.where(new, m, m & 255))  # the first key of a row, the others' bits
    return slot[:, -1] + (m[:, -1] != _SENTINEL)  # the sentinels' slot (if any) is the length


def _union_by_merge(grouped: torch.Tensor, G: int, S_kv: int, max_elements: int):
    """The union of `grouped` [R, G, K] by merging each query's ascending list (the module docstring's merge
    build) -> (packed int32 [R, width], length int32 [R]), or None when some query's in-range rows are not
    strictly ascending (then `_union_by_sort` builds it). One host sync: the widest group and the check."""
    R, _, K = grouped.shape
    Gp = 1 << (G - 1).bit_length()
    W = Gp * K
    full = torch.zeros(R, W, device=grouped.device, dtype=torch.int32)
    length = torch.empty(R, device=grouped.device, dtype=torch.int32)
    bad = torch.zeros((), device=grouped.device, dtype=torch.bool)
    step = max(1, max_elements // max(1, W))
    for r0 in range(0, R, step):
        r1 = min(R, r0 + step)
        m, b = _merge_lists(grouped[r0:r1], S_kv, Gp)
        bad |= b
        while m.shape[0] > 1:
            h = m.shape[0] // 2
            m = _merge(m[:h], m[h:])
        if Gp == 1:  # one query a group: its compacted list is the union
            full[r0:r1] = m[0]
            length[r0:r1] = (m[0] != _SENTINEL).sum(1)
        else:
            length[r0:r1] = _dedup(m[0], full[r0:r1])
    top, is_bad = torch.stack([length.max(), bad.to(torch.int32)]).tolist()
    if is_bad:
        return None
    width = max(1, top)
    packed = torch.where(torch.arange(width, device=full.device) < length[:, None], full[:, :width], -1)
    return packed, length


def _union_by_sort(grouped: torch.Tensor, G: int, S_kv: int, max_elements: int):
    """The union of `grouped` [R, G, K] by one sort of each group's G K keys (`_union_of_groups`), for any
    selections -> (packed int32 [R, width], length int32 [R]). A host sync per `max_elements` keys."""
    K = grouped.shape[2]
    step = max(1, max_elements // max(1, G * K))
    parts, lengths = [], []
    for r0 in range(0, grouped.shape[0], step):
        p, n = _union_of_groups(grouped[r0 : r0 + step], G, S_kv)
        width = max(1, int(n.max()) if n.numel() else 1)
        parts.append(p[:, :width])
        lengths.append(n)
    width = max(p.shape[1] for p in parts) if parts else 1
    packed = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=-1) for p in parts], 0) if parts \
        else grouped.new_full((0, 1), -1, dtype=torch.int32)
    length = torch.cat(lengths) if lengths else grouped.new_zeros(0, dtype=torch.int64)
    return packed, length.to(torch.int32)


BUILDS = ("auto", "merge", "sort")


def build_union(idx: torch.Tensor, G: int, S_kv: int, max_elements: int = 1 << 25, method: str = "auto") -> Union:
    """The union of every group of G consecutive queries' selections (module docstring). idx [B, S, K]
    int32/int64; rows must be below MAX_ROWS. Works on `max_elements` keys at a time.

    method: "auto" merges when every query's in-range rows are strictly ascending (the indexer's output;
    checked on the device, read back with the union's width in the build's one host sync) and sorts
    otherwise; "merge" raises on selections that are not; "sort" always sorts. All give the same Union."""
    if not 1 <= G <= MAX_GROUP:
        raise ValueError(f"build_union: G={G} must be in 1..{MAX_GROUP}")
    if S_kv > MAX_ROWS:
        raise ValueError(f"build_union: S_kv={S_kv} rows exceed the packing's {MAX_ROWS}")
    if method not in BUILDS:
        raise ValueError(f"build_union: method={method!r} must be one of {BUILDS}")
    B, S, K = idx.shape
    NG = -(-S // G)
    grouped = _grouped(idx, G).reshape(-1, G, K)
    res = None
    if method != "sort" and grouped.numel():
        if S_kv < MAX_ROWS:  # the merge's sentinel is row MAX_ROWS - 1
            res = _union_by_merge(grouped, G, S_kv, max_elements)
        if res is None and method == "merge":
            raise ValueError(f"build_union: method='merge' needs S_kv < {MAX_ROWS} and every query's rows in "
                             "[0, S_kv) strictly ascending")
    packed, length = res if res is not None else _union_by_sort(grouped, G, S_kv, max_elements)
    return Union(G=G, S=S, packed=packed.view(B, NG, packed.shape[1]).contiguous(), length=length.view(B, NG))


def union_sizes(idx: torch.Tensor, S_kv: int, groups=(2, 4, 8), windows: int | None = SAMPLE_WINDOWS) -> dict:
    """U_G / k for each G: the mean union size of a group over the mean number of valid slots a query has,
    on `windows` windows of 8 consecutive queries spread evenly over each sequence (None: all of them).
    One host sync. Returns {G: ratio} (1.0 for G = 1)."""
    B, S, K = idx.shape
    span = max(groups)
    n_win = S // span
    if n_win == 0:
        return {G: 1.0 for G in (1, *groups)}
    if windows is not None and n_win > windows:
        starts = torch.linspace(0, n_win - 1, windows, device=idx.device).round().long() * span
    else:
        starts = torch.arange(n_win, device=idx.device) * span
    take = starts[:, None] + torch.arange(span, device=idx.device)
    x = idx[:, take.flatten()].reshape(-1, span, K)  # [B * windows, span, K]
    valid = ((x >= 0) & (x < S_kv)).sum()
    stats = [valid]
    for G in groups:
        _, n = _union_of_groups(x.reshape(-1, G, K), G, S_kv)
        stats.append(n.sum() * G)  # union slots of the window's groups, per query: sum(U) x G / (queries)
    vals = torch.stack([s.to(torch.float64) for s in stats]).tolist()
    k = max(vals[0], 1.0)
    return {1: 1.0, **{G: v / k for G, v in zip(groups, vals[1:])}}


def predicted_ns_per_query(G: int, H: int, ratio: float, k: float = 2051.0) -> float:
    """The cost model (module docstring): ns per query of fwd + bwd at G queries per group, U_G / k = ratio."""
    M = G * H
    rows = program_rows(M)
    progs = math.ceil(M / MAX_PROGRAM_ROWS) if M > MAX_PROGRAM_ROWS else 1
    c = _interp(COST_FWD, rows) + _interp(COST_BWD, rows)
    if G == 1:
        return progs * k * c
    return progs * ratio * k / G * c + COST_BUILD * k


def _interp(table: dict, M: int) -> float:
    return table[min(table, key=lambda m: abs(m - M))]


def choose_group(H: int, ratios: dict) -> int:
    """The G with the least predicted time, G = 1 unless another is predicted >= 10% faster."""
    base = predicted_ns_per_query(1, H, 1.0)
    best, best_t = 1, base * MARGIN
    for G, r in sorted(ratios.items()):
        if G > 1:
            t = predicted_ns_per_query(G, H, r)
            if t < best_t:
                best, best_t = G, t
    return best


def resolve_group(idx: torch.Tensor, H: int, S_kv: int, group: int | str | None = None) -> int:
    """G for one call: `group` if given (an int or "auto": the cost model on the measured union sizes),
    else $LONGCTX_SPARSE_GROUP, else 1: where the model picks G = 4 (trained-like selections) it is 6-13%
    faster on the H200 (docs/design/sparse_attention.md), which does not pay for "auto"'s host sync per
    call for the union sample. Shapes the union cannot take get 1."""
    if group is None:
        group = os.environ.get(ENV, "1")
    if isinstance(group, str) and group != "auto":
        group = int(group)
    if group != "auto":
        if group not in GROUPS:
            raise ValueError(f"sparse attention group G={group} must be one of {GROUPS} or 'auto'")
        return group
    if S_kv > MAX_ROWS or idx.shape[1] < 2 * MAX_GROUP or H > MAX_PROGRAM_ROWS // 2:
        return 1
    return choose_group(H, union_sizes(idx, S_kv, groups=tuple(G for G in GROUPS[1:] if G * H <= 128)))


# ------------------------------------------------------------------------------------------ the torch twin
def _members(packed: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """packed [..., U] -> (rows clamped to >= 0, valid [..., U], member [..., G, U])."""
    valid = packed >= 0
    rows = torch.where(valid, packed >> ROW_SHIFT, 0).long()
    g = torch.arange(G, device=packed.device)
    member = (((packed & 255)[..., None, :] >> g[:, None]) & 1).bool() & valid[..., None, :]
    return rows, valid, member


def _group_view(x: torch.Tensor, G: int) -> torch.Tensor:
    """[B, S, ...] -> [B, NG, G, ...], zero-padded."""
    B, S = x.shape[:2]
    NG = -(-S // G)
    if NG * G != S:
        x = torch.cat([x, x.new_zeros((B, NG * G - S, *x.shape[2:]))], 1)
    return x.view(B, NG, G, *x.shape[2:])


def union_attention_torch(q: torch.Tensor, kv: torch.Tensor, u: Union, scale: float, chunk: int = 64):
    """The union formulation in torch: (o [B, S, H, D] in q's dtype, lse [B, S, H] fp32/fp64), from the union
    rows of each group with the non-member pairs at -inf. The twin of `triton.union_attention_fwd`."""
    B, S, H, D = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    G = u.G
    qg = _group_view(q, G)  # [B, NG, G, H, D]
    o = torch.empty(qg.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(qg.shape[:-1], dtype=acc, device=q.device)
    with torch.autocast(q.device.type, enabled=False):
        for n0 in range(0, u.groups, chunk):
            sl = slice(n0, n0 + chunk)
            rows, _, member = _members(u.packed[:, sl], G)  # rows [B, n, U], member [B, n, G, U]
            sel = torch.gather(kv.to(acc), 1, rows.reshape(B, -1, 1).expand(-1, -1, D)).view(*rows.shape, D)
            logits = torch.einsum("bngHd,bnud->bngHu", qg[:, sl].to(acc), sel) * scale
            logits = logits.masked_fill(~member[:, :, :, None, :], float("-inf"))
            ls = torch.logsumexp(logits, -1)
            p = torch.nan_to_num(torch.exp(logits - ls.clamp(min=torch.finfo(acc).min)[..., None]), nan=0.0)
            o[:, sl] = torch.einsum("bngHu,bnud->bngHd", p, sel).to(q.dtype)
            lse[:, sl] = ls
    return o.view(B, -1, H, D)[:, :S], lse.view(B, -1, H)[:, :S]


def union_attention_bwd_torch(q, kv, u: Union, o, lse, do, scale: float, chunk: int = 64):
    """The union formulation's backward in torch (the twin of `triton.union_attention_bwd`): (dq like q,
    dkv like kv), with each union row's dKV summed over the group's G x H rows before one add per row."""
    B, S, H, D = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    G = u.G
    with torch.autocast(q.device.type, enabled=False):
        qg, dog = _group_view(q.to(acc), G), _group_view(do.to(acc), G)
        dt = _group_view((do.to(acc) * o.to(acc)).sum(-1), G)  # [B, NG, G, H]
        lg = _group_view(lse.to(acc), G)
        dq = torch.empty(qg.shape, dtype=acc, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        kva = kv.to(acc)
        for n0 in range(0, u.groups, chunk):
            sl = slice(n0, n0 + chunk)
            rows, valid, member = _members(u.packed[:, sl], G)
            sel = torch.gather(kva, 1, rows.reshape(B, -1, 1).expand(-1, -1, D)).view(*rows.shape, D)
            qi, doi = qg[:, sl], dog[:, sl]
            logits = torch.einsum("bngHd,bnud->bngHu", qi, sel) * scale
            p = torch.exp(logits - lg[:, sl, :, :, None]).masked_fill(~member[:, :, :, None, :], 0.0)
            p = torch.nan_to_num(p, nan=0.0)
            ds = p * (torch.einsum("bngHd,bnud->bngHu", doi, sel) - dt[:, sl, :, :, None])
            dq[:, sl] = torch.einsum("bngHu,bnud->bngHd", ds, sel) * scale
            dsel = torch.einsum("bngHu,bngHd->bnud", p, doi) + torch.einsum("bngHu,bngHd->bnud", ds, qi) * scale
            dsel = dsel.masked_fill(~valid[..., None], 0.0)
            for b in range(B):
                dkv[b].index_add_(0, rows[b].reshape(-1), dsel[b].reshape(-1, D))
    return dq.view(B, -1, H, D)[:, :S].to(q.dtype), dkv.to(kv.dtype)
