"""The automatic memory plan: which of recompute, offload and sequence chunks a step needs, picked by
asking the byte model (`longctx.memory.model_bytes.estimate`) of each candidate, cheapest first; and
the report `longctx estimate` prints.

`plan_for_stage` is what the trainer calls for each curriculum stage. Over several GPUs
(`model_bytes.Cluster`) with context parallelism the candidates are the whole-sequence ones (the
sequence-chunked step runs over data-parallel ranks only), and `parallel.cp = "auto"` takes the
smallest CP with a plan that fits (`pick_cp`): context parallelism halves the sequences trained at once and pays for its exchanges, so it is the
last resort, after recompute and offload (seed 000). `fit_cluster` searches the smallest cluster for a
model and length, as `longctx estimate --fit` prints it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ..devices import resolve_dtype
from ..errors import ConfigError
from ..ops import int32_rows
from ..ops import INT32_ELEMENTS
from .model_bytes import ALLOCATOR_SLACK, GIB, GPU_FIT, Cluster, _stream_width, device_gpu_key, estimate
from .plan import MemoryPlan

if TYPE_CHECKING:
    from ..config import ModelConfig


# The longest chunk the automatic plan takes. Past 128k tokens a chunk's time per token is flat: the 1M step
# of h200-ref takes 55.8 s with chunks of 262,144 and 56.5 s with 131,072, peaks 115.0 vs 74.8 GiB on the
# H200 (`bench/memory.py --configs seq_chunk_half`). Longer chunks would buy ~1% for 40 GiB of headroom.
AUTO_CHUNK_MAX = 131072


# Kernels that address a tensor's elements with int32 offsets read and write out of bounds past 2^31
# elements (liger's mHC kernels do, so longctx/ops/mhc/liger.py splits their launches). A whole-sequence
# step of h200-ref at 262,144 tokens (2^31 elements exactly) runs on the H200; no larger one has been shown
# to run correctly there (at 524,288 tokens its widest tensors hold 4.3 G elements). So the automatic plan
# takes a whole-sequence step only while every activation tensor stays within 2^31 elements; past that the
# sequence-chunked step, whose kernels see one chunk, runs (1,048,576 tokens in chunks of 131,072).


def widest_activation(cfg: ModelConfig) -> int:
    """Elements per token of the step's widest whole-sequence activation: the residual state (streams x
    hidden), KDA's conv input (3 x heads x head dim), a dense MLP's [gate | up] (2 x intermediate), a DSA
    layer's absorbed queries and output (heads x kv_lora)."""
    widths = [_stream_width(cfg) * cfg.hidden_size]
    kinds, mlps = cfg.layer_kinds(), cfg.mlp_kinds()
    if "K" in kinds:
        widths.append(3 * cfg.kda_heads * cfg.kda_head_dim)
    if "d" in mlps:
        widths.append(2 * cfg.intermediate_size)
    if "D" in kinds:
        widths.append(cfg.attn_heads * cfg.kv_lora_rank)
    return max(widths)


def whole_sequence_max(cfg: ModelConfig) -> int:
    """The most tokens per GPU a whole-sequence step takes under the automatic plan (every activation within
    2^31 elements, `ops.int32_rows`): 262,144 for h200-ref, the longest whole-sequence step shown to run
    correctly on the H200. `bench/memory.py --plan seq_chunk=off --seqlens 524288` is the run that would
    lift it."""
    return int32_rows(widest_activation(cfg))


def widest_elements(cfg: ModelConfig, S: int, cluster: Cluster) -> int:
    """Elements of the widest activation tensor on one rank of `cluster` for S tokens per sequence: this
    rank's S/cp tokens of `widest_activation`, or what its CP mode gathers over the whole sequence (KDA
    hidden_gather: the hidden state [S, hidden] and its heads' conv input [S, 3 H/cp K]; qkv_a2a: the
    received [S, H/cp, 4K+1]; DSA: the gathered rows [S, kv_lora + 2 index_head_dim])."""
    cp = cluster.cp
    T = -(-S // cp)
    out = [T * widest_activation(cfg)]
    kinds = cfg.layer_kinds()
    if cp > 1 and "K" in kinds:
        Hl, K = cfg.kda_heads // cp, cfg.kda_head_dim
        out += {"hidden_gather": [S * cfg.hidden_size, S * 3 * Hl * K], "qkv_a2a": [S * Hl * (4 * K + 1)]}.get(cluster.kda_cp, [])
    if cp > 1 and "D" in kinds:
        out.append(S * (cfg.kv_lora_rank + 2 * cfg.index_head_dim))
    return max(out)


def whole_sequence_warning(cfg: ModelConfig, tokens: int, plan: MemoryPlan) -> str | None:
    """What to tell a user whose plan runs a whole-sequence step past `whole_sequence_max` (a forced
    seq_chunk=off), or None."""
    limit = whole_sequence_max(cfg)
    if plan.seq_chunk_tokens() or tokens <= limit:
        return None
    return (f"a whole-sequence step of {tokens:,} tokens holds activations of {tokens * widest_activation(cfg) / 1e9:.1f} G "
            f"elements, past 2^31, and no whole-sequence step that large has been shown to run correctly on the H200; "
            f"memory.seq_chunk=auto chunks every sequence above {limit:,} tokens.")


def plan_choices(cfg: ModelConfig, S: int, plan: MemoryPlan, cp: int = 1, cluster: Cluster | None = None) -> list[MemoryPlan]:
    """The candidates `auto_plan` tries, cheapest first: no recompute, recompute of the first 1, 2, ... L - 1
    blocks (the later ones keep their activations), recompute of every block, that + offload of 1, 2, ... blocks,
    then the sequence in chunks (the largest power-of-two chunk up to AUTO_CHUNK_MAX first; inside a chunk
    every block but the last recomputed, then every block: a chunked step is there for length, and the memory
    more kept blocks would take is what the next length needs). The last block is the one kept for free: its
    backward runs right after the forward, so a recompute of it redoes what was just computed, and the peak
    (that block's backward) holds its activations either way. With seq_chunk "auto", sequences past
    `whole_sequence_max` go to chunks directly.
    `reuse_attention` (when on) is a speed-for-memory trade (0.21 s for 4 GiB at 128k, H200): it is kept
    while offloading blocks can make room (offload measured free of step time at 256k), given up before
    the sequence is chunked, and within a chunk length given up before the chunk is halved.
    Over several GPUs with context parallelism (`cluster`, whose cp replaces `cp`) no chunk lengths, and no
    whole-sequence choice either where a rank's widest tensor passes 2^31 elements (`widest_elements`);
    over data-parallel ranks alone (cp 1) the same choices as on one GPU."""
    choices = []
    multi = cluster is not None and cluster.gpus > 1
    if cluster is not None:
        cp = cluster.cp
    S_local = -(-S // cp)
    limit = whole_sequence_max(cfg)
    L = cfg.num_layers
    # cheapest first: no recompute, the first 1, 2, ... blocks recomputed (the later keep their activations), all
    partial = [str(n) for n in range(1, L)]
    rc = ["off", *partial, "on"] if plan.recompute == "auto" else [plan.recompute]
    whole = "off" if plan.seq_chunk == "auto" else plan.seq_chunk
    cp_multi = multi and cp > 1  # context parallel: the whole-sequence step only (no chunks over cp ranks)
    if plan.seq_chunk == "auto" and (widest_elements(cfg, S, cluster) > INT32_ELEMENTS if cp_multi else S_local > limit):
        rc = []  # no whole-sequence choice
    for r in rc:
        offs = (["0"] + [str(i) for i in range(1, cfg.num_layers + 1)]) if plan.offload == "auto" else [plan.offload]
        for o in offs:
            if r == "off" and o not in ("0", "off"):
                continue
            if r.isdigit() and o not in ("0", "off") and (plan.recompute == "auto" or int(o) > int(r)):
                continue  # offload comes after recompute of every block; it moves recomputed blocks' inputs only
            if whole != "off" and o not in ("0", "off"):
                continue
            choices.append(dataclasses.replace(plan, recompute=r, offload=o, seq_chunk=whole))
    if plan.seq_chunk == "auto" and not cp_multi:
        c = min(AUTO_CHUNK_MAX, 1 << max(0, (S_local - 1).bit_length() - 1))  # largest power of two below S_local
        c = min(c, 1 << max(0, limit.bit_length() - 1))
        while c >= 1024:
            for r in ([*partial[-1:], "on"] if plan.recompute == "auto" else [plan.recompute]):
                choices.append(dataclasses.replace(plan, recompute=r, offload="0", seq_chunk=str(c)))
            c //= 2
    if plan.reuse_attention:
        # where the switch acts. Under recompute = N a kept block is given up before the kept attention output,
        # which buys more time per byte (a sparse forward for the output alone, against a block's whole
        # activations for its forward; memory_model.md)
        kept = lambda c: (c.recompute in ("on", *partial[-1:])  # noqa: E731
                          or (c.recompute.isdigit() and plan.recompute != "auto"))
        drop = lambda c: dataclasses.replace(c, reuse_attention=False)  # noqa: E731
        blockwise = [c for c in choices if not c.seq_chunk_tokens()]
        chunked = [c for c in choices if c.seq_chunk_tokens()]
        choices = (blockwise + [drop(c) for c in blockwise if kept(c)]
                   + [v for c in chunked for v in ((c, drop(c)) if kept(c) else (c,))])
    return choices


def auto_plan(cfg: ModelConfig, S: int, plan: MemoryPlan, cp: int = 1, gpu: str = "h200",
              act_bytes: int = 2, kernels=None, cluster: Cluster | None = None) -> tuple[MemoryPlan, dict]:
    """Resolve recompute/offload/seq_chunk "auto": the first of `plan_choices` whose estimate fits (else the
    last, with its estimate saying it does not). `kernels`: the kernel settings (a KernelConfig; None =
    every op auto), which `estimate` asks `longctx.kernels.planned` about. `cluster`: the per-GPU
    estimate of a step over several GPUs (its cp replaces `cp`)."""
    last = None
    if (cluster is not None and cluster.gpus > 1 and cluster.cp > 1 and plan.seq_chunk == "auto"
            and widest_elements(cfg, S, cluster) > INT32_ELEMENTS):
        raise ConfigError(f"{S:,} tokens a sequence over {cluster.describe()} leave a tensor of "
                          f"{widest_elements(cfg, S, cluster) / 1e9:.2f} G elements on each rank, past 2^31 (and the "
                          "sequence-chunked step runs over data-parallel ranks only); use a larger cp"
                          + (" or parallel.kda_cp = chunk_state." if "K" in cfg.layer_kinds() and cluster.cp > 1
                             and cluster.kda_cp != "chunk_state" else "."))
    # Keeping blocks only adds bytes: a partial recompute fits only where recomputing every block does, so
    # the partial choices are skipped, unestimated, wherever that one does not fit (`longctx estimate --fit`
    # asks this of many clusters).
    all_fit: dict = {}
    for c in plan_choices(cfg, S, plan, cp, cluster):
        if plan.recompute == "auto" and c.recompute.isdigit():
            every = dataclasses.replace(c, recompute="on")
            key = tuple(every.to_dict().items())
            if key not in all_fit:
                all_fit[key] = estimate(cfg, S, every, cp, gpu, act_bytes, kernels, cluster=cluster)["fits"]
            if not all_fit[key]:
                continue
        e = estimate(cfg, S, c, cp, gpu, act_bytes, kernels, cluster=cluster)
        last = (c, e)
        if e["fits"]:
            return c, e
    if last is None:
        raise ConfigError(f"no memory plan to try for {S:,} tokens: the widest activation ({widest_activation(cfg):,} "
                          f"elements a token) leaves no chunk of >= 1024 tokens within 2^31 elements; set memory.seq_chunk.")
    return last


def cp_candidates(cfg: ModelConfig, S: int, gpus: int, kda_cp: str = "hidden_gather", dp: int | None = None) -> list[int]:
    """The CP degrees a step of S tokens a sequence can take on `gpus` ranks, smallest first: the divisors
    of gpus (only gpus // dp when parallel.dp is set) that split S into the 2 cp equal zigzag chunks and,
    in the head-split KDA modes, divide the KDA heads."""
    head_split = kda_cp in ("hidden_gather", "qkv_a2a") and "K" in cfg.layer_kinds()
    return [cp for cp in range(1, gpus + 1)
            if gpus % cp == 0 and (dp is None or dp * cp == gpus)
            and (cp == 1 or (S % (2 * cp) == 0 and not (head_split and cfg.kda_heads % cp)))]


def pick_cp(cfg: ModelConfig, S: int, plan: MemoryPlan, gpus: int, ep: int = 1, kda_cp: str = "hidden_gather",
            dp: int | None = None, gpu: str = "h200", act_bytes: int = 2, kernels=None,
            **cluster_settings) -> tuple[Cluster, MemoryPlan, dict]:
    """`parallel.cp = "auto"`: the smallest of `cp_candidates` with a memory plan that fits (`auto_plan`),
    as (cluster, plan, estimate); when none fits, the largest tried, its estimate saying so.
    `cluster_settings`: the rest of the Cluster (param_bytes, opt_offload, host)."""
    last, why = None, None
    for cp in cp_candidates(cfg, S, gpus, kda_cp, dp):
        cl = Cluster(gpus=gpus, cp=cp, ep=ep, kda_cp=kda_cp, **cluster_settings)
        try:
            p, e = auto_plan(cfg, S, plan, cp, gpu, act_bytes, kernels, cluster=cl)
        except ConfigError as err:  # past the int32 bound at this cp: a larger one may pass
            why = err
            continue
        last = (cl, p, e)
        if e["fits"]:
            return last
    if last is None:
        raise why or ConfigError(f"no parallel.cp divides the {gpus} GPUs, splits {S:,} tokens into 2 x cp equal chunks "
                                 f"and (parallel.kda_cp = {kda_cp}) divides model.kda_heads = {cfg.kda_heads}; "
                                 "choose another number of GPUs or sequence length.")
    return last


FIT_SIZES = tuple(8 * 2**i for i in range(10))  # 8, 16, ..., 4096 GPUs


def expert_parallel_choices(cfg: ModelConfig, gpus: int) -> list[int]:
    """EP degrees a cluster can take: dividing both the GPUs and the routed experts, largest first (the
    fewest expert bytes per rank); 1 for a model without MoE layers."""
    if "m" not in cfg.mlp_kinds():
        return [1]
    return [e for e in range(gpus, 0, -1) if gpus % e == 0 and cfg.n_routed_experts % e == 0]


def fit_on(cfg: ModelConfig, S: int, plan: MemoryPlan, gpus: int, gpu: str = "h200", act_bytes: int = 2, kernels=None,
           param_bytes: int = 4, host: float | None = None, ep: int | None = None, kda_cp: str | None = None) -> dict:
    """How a step of S tokens a sequence fits on `gpus` GPUs: the AdamW moments on the GPU first, then on
    the host; the largest EP (or `ep`); the KDA modes in the order of their bytes sent (hidden_gather,
    qkv_a2a, chunk_state; or `kda_cp`), each with its smallest CP that fits (`pick_cp`). Returns
    {"gpus", "fits", "cluster", "plan", "estimate", "why"}: the first fitting choice, else the one with the
    smallest GPU peak (or, where every choice passes the int32 bound, None and why)."""
    from ..config.parallel import KDA_CP_MODES

    eps = [ep] if ep else expert_parallel_choices(cfg, gpus)[:1]
    if gpus % eps[0] or ("m" in cfg.mlp_kinds() and cfg.n_routed_experts % eps[0]):
        return {"gpus": gpus, "fits": False, "cluster": None, "plan": None, "estimate": None,
                "why": f"ep {eps[0]} does not divide {gpus} GPUs and {cfg.n_routed_experts} experts"}
    best, why = None, None
    for off in (False, True):
        for mode in ([kda_cp] if kda_cp else KDA_CP_MODES):
            try:
                cl, p, e = pick_cp(cfg, S, plan, gpus, eps[0], mode, None, gpu, act_bytes, kernels,
                                   param_bytes=param_bytes, opt_offload=off, host=host)
            except ConfigError as err:
                why = why or str(err)
                continue
            if e["fits"]:
                return {"gpus": gpus, "fits": True, "cluster": cl, "plan": p, "estimate": e, "why": None}
            if best is None or e["gpu_bytes"] < best[2]["gpu_bytes"]:
                best = (cl, p, e)
    cl, p, e = best or (None, None, None)
    return {"gpus": gpus, "fits": False, "cluster": cl, "plan": p, "estimate": e, "why": None if best else why}


def fit_cluster(cfg: ModelConfig, S: int, plan: MemoryPlan, gpu: str = "h200", act_bytes: int = 2, kernels=None,
                sizes=FIT_SIZES, **settings) -> dict:
    """The smallest of `sizes` on which a step of S tokens a sequence fits (`fit_on` for each, in order):
    {"gpus": that size or None, "found": its `fit_on` row or None, "tried": every row}."""
    tried = []
    for G in sizes:
        tried.append(fit_on(cfg, S, plan, G, gpu, act_bytes, kernels, **settings))
        if tried[-1]["fits"]:
            return {"gpus": G, "found": tried[-1], "tried": tried}
    return {"gpus": None, "found": None, "tried": tried}


def dominant_term(e: dict) -> tuple[str, int]:
    """The largest term of an estimate's peak: a static entry, the activations kept for backward (all
    layers together) or one entry of the working set."""
    terms = {k: v for k, v in e["static"].items()}
    terms["activations kept for backward"] = sum(e["kept_gpu"].values())
    terms.update({k: v for k, v in e["working"].items() if v > 0})
    name = max(terms, key=terms.get)
    return name, int(terms[name])


def resolve_auto(plan: MemoryPlan, cfg: ModelConfig, tokens: int, device,
                 act_bytes: int = 2, kernels=None) -> tuple[MemoryPlan, dict | None]:
    """Resolve "auto" switches for this device; returns (plan, its estimate or None)."""
    if "auto" not in (plan.recompute, plan.offload, plan.seq_chunk):
        return plan, None
    return auto_plan(cfg, tokens, plan, 1, device_gpu_key(device), act_bytes, kernels)


def format_report(e: dict, phases: bool = False) -> str:
    g = lambda b: f"{b / GIB:9.2f}"  # noqa: E731
    lines = [f"estimate: {e['seq_len']:,} tokens/sequence, CP {e['cp']}, {e['gpu']}, {e['params'] / 1e9:.3f}B parameters"]
    if e.get("cluster") and e["cluster"]["gpus"] > 1:
        lines.append(f"per GPU of {Cluster(**e['cluster']).describe()}; FSDP shards every parameter over all "
                     f"{e['cluster']['gpus']} (1/{e['cluster']['gpus']} each)")
    rec = str(e["plan"]["recompute"])
    rec += " (the first blocks; the later ones keep their activations)" if rec.isdigit() else ""
    lines += [f"plan: recompute={rec} offload={e['plan']['offload']} seq_chunk={e['plan']['seq_chunk']} "
             f"sparse_kernel={e['plan']['sparse_kernel']} chunked_indexer={e['plan']['chunked_indexer']}"]
    c = int(e["plan"]["seq_chunk"]) if str(e["plan"]["seq_chunk"]).isdigit() else 0
    S_local = -(-e["seq_len"] // e["cp"])
    if 0 < c < S_local:
        lines.append(f"sequence-chunked step: {-(-S_local // c)} chunks of {c:,} tokens, carries between them "
                     f"(longctx/memory/sequence_chunks.py); 'one chunk' rows are per chunk")
    lines += ["", f"{'component':<40}{'GiB':>9}"]
    for title, part in (("static", e["static"]), ("kept for backward (GPU)", e["kept_gpu"]),
                        ("kept for backward (host, offloaded)", e["kept_host"]), ("host, for the optimizer step", e.get("host_static")),
                        ("working set at the peak (and what is freed by then)", e["working"])):
        if not part:
            continue
        lines.append(f"-- {title}: {sum(part.values()) / GIB:.2f} GiB")
        for k, v in part.items():
            lines.append(f"   {k:<37}{g(v)}")
    if e.get("peak_phase"):
        lines.append(f"peak during {e['peak_phase']}")
    lines.append("")
    lines.append(f"{'GPU peak, allocated':<40}{g(e['gpu_bytes'])}")
    lines.append(f"{'GPU reserved (x' + str(ALLOCATOR_SLACK) + ' allocator slack)':<40}{g(e['gpu_reserved_bytes'])}  of "
                 f"{e['gpu_capacity'] / GIB:.1f} (fits: <= {GPU_FIT:.0%})")
    host_label = "host (offloaded inputs + optimizer)" if e.get("host_static") else "host (offloaded inputs)"
    lines.append(f"{host_label:<40}{g(e['host_bytes'])}  of {e['host_capacity'] / GIB:.1f}")
    lines.append(f"verdict: {'fits' if e['fits'] else 'DOES NOT FIT'}")
    if phases and e.get("phases_gpu_bytes"):
        lines += ["", f"{'phase (GPU allocated)':<58}{'GiB':>9}"]
        top = max(e["phases_gpu_bytes"].values())
        lines += [f"{k:<58}{g(v)}{'  <- peak' if v == top else ''}" for k, v in e["phases_gpu_bytes"].items()]
    return "\n".join(lines)


def parse_switches(items, flag: str = "--set") -> dict:
    """["offload=0", "reuse_attention=false", "mhc_chunk=8192"] -> the memory settings they name (values as
    MemoryPlan.from_dict takes them; it checks names and values)."""
    forced = {}
    for s in items:
        if "=" not in s:
            raise ConfigError(f"{flag} {s!r} must look like SWITCH=VALUE, e.g. offload=0.")
        k, v = s.split("=", 1)
        is_int = v.lstrip("-").isdigit() and k not in ("offload",)
        forced[k] = {"true": True, "false": False}.get(v.lower(), int(v) if is_int else v)
    return forced


def stage_cluster(cfg, stage, world: int, cp: int | None = None) -> tuple[Cluster | None, int]:
    """(the Cluster a stage's step runs on over `world` processes, the tokens of one dp rank's rows): each
    dp rank takes batch_size / dp of the global batch's rows; one process (world 1): (None, the batch)."""
    if world <= 1:
        return None, stage.seq_len * stage.batch_size
    par = cfg.parallel
    cp = par.cp if cp is None else cp
    ep = getattr(par, "ep", None) or 1
    return Cluster(gpus=world, cp=cp, ep=ep, kda_cp=par.kda_cp), stage.seq_len * max(1, stage.batch_size // (world // cp))


def _stage_plan(cfg, stage, device, world: int, cp: int | None = None) -> tuple[MemoryPlan, dict | None]:
    plan = MemoryPlan.from_dict(cfg.memory)
    if stage.memory:
        plan = MemoryPlan.from_dict(stage.memory, base=plan)
    act_bytes = resolve_dtype(cfg.dtype, torch.device(device)).itemsize  # activations in the autocast dtype
    cluster, tokens = stage_cluster(cfg, stage, world, cp)
    if cluster is None:
        return resolve_auto(plan, cfg.model, tokens, device, act_bytes, cfg.kernels)
    gpu = device_gpu_key(device)
    if "auto" not in (plan.recompute, plan.offload, plan.seq_chunk):
        return plan, estimate(cfg.model, tokens, plan, cluster.cp, gpu, act_bytes, cfg.kernels, cluster=cluster)
    return auto_plan(cfg.model, tokens, plan, cluster.cp, gpu, act_bytes, cfg.kernels, cluster=cluster)


def stage_estimate(cfg, stage, plan: MemoryPlan, device, world: int = 1) -> dict:
    """The estimate of a stage's step under `plan` on this rank (what each step's line shows its peak beside)."""
    cluster, tokens = stage_cluster(cfg, stage, world)
    return estimate(cfg.model, tokens, plan, 1 if cluster is None else cluster.cp, device_gpu_key(device),
                    resolve_dtype(cfg.dtype, torch.device(device)).itemsize, cfg.kernels, cluster=cluster)


def resolve_parallel(cfg, world: int, device):
    """cfg.parallel with `cp = "auto"` resolved for `world` processes: the smallest cp that divides the
    world (world // parallel.dp when dp is set) and, in the head-split KDA modes, the KDA heads, splits
    every stage's rows into 2 cp zigzag chunks and its batch over the dp ranks, and gives every stage a
    memory plan that fits. The mesh is built once for the run, so one cp serves all stages."""
    import dataclasses

    par = cfg.parallel
    if par.cp != "auto":
        return par
    if world <= 1:
        return dataclasses.replace(par, cp=1)
    head_split = par.kda_cp in ("hidden_gather", "qkv_a2a") and "K" in cfg.model.layer_kinds()
    stages = cfg.stages
    cands = [cp for cp in range(1, world + 1)
             if world % cp == 0 and (par.dp is None or par.dp * cp == world)
             and all(s.batch_size % (world // cp) == 0 for s in stages)
             and (cp == 1 or (all(s.seq_len % (2 * cp) == 0 for s in stages)
                              and not (head_split and cfg.model.kda_heads % cp)))]
    why = None
    for cp in cands:
        try:
            if all(_stage_plan(cfg, s, device, world, cp)[1]["fits"] for s in stages):
                return dataclasses.replace(par, cp=cp)
        except ConfigError as err:  # past the int32 bound at this cp
            why = err
    longest = max(stages, key=lambda s: s.seq_len * s.batch_size)
    raise ConfigError(f"parallel.cp = auto: none of cp = {', '.join(map(str, cands)) or '-'} on {world} processes fits "
                      f"every stage (the longest: {longest.seq_len:,} tokens x batch {longest.batch_size})"
                      + (f" ({why})" if why else "") + "; use more GPUs or shorter stages (see `longctx estimate --gpus`).")


def plan_for_stage(cfg, stage, device, stage_index: int = 0, world: int = 1) -> MemoryPlan:
    """The plan for one curriculum stage: config `memory`, then the stage's `memory`, then the
    estimator resolves "auto" (recompute and offload only when the stage would not fit). `world`: the
    processes torchrun started; over several, the per-GPU estimate of the (dp, cp) mesh of
    `cfg.parallel` (cp resolved, `resolve_parallel`) decides, with the whole-sequence step only."""
    resolved, est = _stage_plan(cfg, stage, device, world)
    if est is not None and not est["fits"]:
        where = "this device" if world <= 1 else f"each of the {world} processes (parallel.cp = {cfg.parallel.cp})"
        raise ConfigError(
            f"stages.{stage_index}.seq_len ({stage.seq_len:,} x batch {stage.batch_size}) does not fit on {where} even with "
            f"recompute, offload{' and sequence chunks' if world <= 1 or cfg.parallel.cp == 1 else ''} (estimated {est['gpu_reserved_bytes'] / 2**30:.0f} GiB reserved of {est['gpu_capacity'] / 2**30:.0f}); "
            + ("lower the sequence length or batch size (see `longctx estimate`)." if world <= 1 else
               "raise parallel.cp (or set it to auto), use more GPUs, or lower the sequence length or batch size "
               "(see `longctx estimate --gpus`).")
        )
    return resolved
