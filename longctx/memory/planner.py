"""The automatic memory plan: which of recompute, offload and sequence chunks a step needs, picked by
asking the byte model (`longctx.memory.model_bytes.estimate`) of each candidate, cheapest first; and
the report `longctx estimate` prints.

`plan_for_stage` is what the trainer calls for each curriculum stage.
"""

from __future__ import annotations

import dataclasses

import torch

from ..devices import resolve_dtype
from ..errors import ConfigError
from ..ops import int32_rows
from .model_bytes import ALLOCATOR_SLACK, GIB, GPU_FIT, _stream_width, device_gpu_key, estimate
from .plan import MemoryPlan


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


def whole_sequence_warning(cfg: ModelConfig, tokens: int, plan: MemoryPlan) -> str | None:
    """What to tell a user whose plan runs a whole-sequence step past `whole_sequence_max` (a forced
    seq_chunk=off), or None."""
    limit = whole_sequence_max(cfg)
    if plan.seq_chunk_tokens() or tokens <= limit:
        return None
    return (f"a whole-sequence step of {tokens:,} tokens holds activations of {tokens * widest_activation(cfg) / 1e9:.1f} G "
            f"elements, past 2^31, and no whole-sequence step that large has been shown to run correctly on the H200; "
            f"memory.seq_chunk=auto chunks every sequence above {limit:,} tokens.")


def plan_choices(cfg: ModelConfig, S: int, plan: MemoryPlan, cp: int = 1) -> list[MemoryPlan]:
    """The candidates `auto_plan` tries, cheapest first: no recompute, recompute, recompute + offload of 1, 2, ...
    blocks, then the sequence in chunks (the largest power-of-two chunk up to AUTO_CHUNK_MAX first, recompute
    on inside a chunk). With seq_chunk "auto", sequences past `whole_sequence_max` go to chunks directly.
    `reuse_attention` (when on) is a speed-for-memory trade (0.21 s for 4 GiB at 128k, H200): it is kept
    while offloading blocks can make room (offload measured free of step time at 256k), given up before
    the sequence is chunked, and within a chunk length given up before the chunk is halved."""
    choices = []
    S_local = -(-S // cp)
    limit = whole_sequence_max(cfg)
    rc = ["off", "on"] if plan.recompute == "auto" else [plan.recompute]
    whole = "off" if plan.seq_chunk == "auto" else plan.seq_chunk
    if plan.seq_chunk == "auto" and S_local > limit:
        rc = []  # no whole-sequence choice
    for r in rc:
        offs = (["0"] + [str(i) for i in range(1, cfg.num_layers + 1)]) if plan.offload == "auto" else [plan.offload]
        for o in offs:
            if r == "off" and o not in ("0", "off"):
                continue
            if whole != "off" and o not in ("0", "off"):
                continue
            choices.append(dataclasses.replace(plan, recompute=r, offload=o, seq_chunk=whole))
    if plan.seq_chunk == "auto":
        c = min(AUTO_CHUNK_MAX, 1 << max(0, (S_local - 1).bit_length() - 1))  # largest power of two below S_local
        c = min(c, 1 << max(0, limit.bit_length() - 1))
        while c >= 1024:
            choices.append(dataclasses.replace(plan, recompute="on" if plan.recompute == "auto" else plan.recompute,
                                               offload="0", seq_chunk=str(c)))
            c //= 2
    if plan.reuse_attention:
        kept = lambda c: c.recompute == "on" or c.seq_chunk_tokens() > 0  # noqa: E731  (where the switch acts)
        drop = lambda c: dataclasses.replace(c, reuse_attention=False)  # noqa: E731
        blockwise = [c for c in choices if not c.seq_chunk_tokens()]
        chunked = [c for c in choices if c.seq_chunk_tokens()]
        choices = (blockwise + [drop(c) for c in blockwise if kept(c)]
                   + [v for c in chunked for v in (c, drop(c))])
    return choices


def auto_plan(cfg: ModelConfig, S: int, plan: MemoryPlan, cp: int = 1, gpu: str = "h200",
              act_bytes: int = 2, kernels=None) -> tuple[MemoryPlan, dict]:
    """Resolve recompute/offload/seq_chunk "auto": the first of `plan_choices` whose estimate fits (else the
    last, with its estimate saying it does not). `kernels`: the kernel settings (a KernelConfig; None =
    every op auto), which `estimate` asks `longctx.kernels.planned` about."""
    last = None
    for c in plan_choices(cfg, S, plan, cp):
        e = estimate(cfg, S, c, cp, gpu, act_bytes, kernels)
        last = (c, e)
        if e["fits"]:
            return c, e
    if last is None:
        raise ConfigError(f"no memory plan to try for {S:,} tokens: the widest activation ({widest_activation(cfg):,} "
                          f"elements a token) leaves no chunk of >= 1024 tokens within 2^31 elements; set memory.seq_chunk.")
    return last


def resolve_auto(plan: MemoryPlan, cfg: ModelConfig, tokens: int, device,
                 act_bytes: int = 2, kernels=None) -> tuple[MemoryPlan, dict | None]:
    """Resolve "auto" switches for this device; returns (plan, its estimate or None)."""
    if "auto" not in (plan.recompute, plan.offload, plan.seq_chunk):
        return plan, None
    return auto_plan(cfg, tokens, plan, 1, device_gpu_key(device), act_bytes, kernels)


def format_report(e: dict, phases: bool = False) -> str:
    g = lambda b: f"{b / GIB:9.2f}"  # noqa: E731
    lines = [f"estimate: {e['seq_len']:,} tokens/sequence, CP {e['cp']}, {e['gpu']}, {e['params'] / 1e9:.3f}B parameters",
             f"plan: recompute={e['plan']['recompute']} offload={e['plan']['offload']} seq_chunk={e['plan']['seq_chunk']} "
             f"sparse_kernel={e['plan']['sparse_kernel']} chunked_indexer={e['plan']['chunked_indexer']}"]
    c = int(e["plan"]["seq_chunk"]) if str(e["plan"]["seq_chunk"]).isdigit() else 0
    S_local = -(-e["seq_len"] // e["cp"])
    if 0 < c < S_local:
        lines.append(f"sequence-chunked step: {-(-S_local // c)} chunks of {c:,} tokens, carries between them "
                     f"(longctx/memory/sequence_chunks.py); 'one chunk' rows are per chunk")
    lines += ["", f"{'component':<40}{'GiB':>9}"]
    for title, part in (("static", e["static"]), ("kept for backward (GPU)", e["kept_gpu"]),
                        ("kept for backward (host, offloaded)", e["kept_host"]), ("working set at the peak (and what is freed by then)", e["working"])):
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
    lines.append(f"{'host (offloaded inputs)':<40}{g(e['host_bytes'])}  of {e['host_capacity'] / GIB:.1f}")
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


def plan_for_stage(cfg, stage, device, stage_index: int = 0) -> MemoryPlan:
    """The plan for one curriculum stage: config `memory`, then the stage's `memory`, then the
    estimator resolves "auto" (recompute and offload only when the stage would not fit)."""
    plan = MemoryPlan.from_dict(cfg.memory)
    if stage.memory:
        plan = MemoryPlan.from_dict(stage.memory, base=plan)
    act_bytes = resolve_dtype(cfg.dtype, torch.device(device)).itemsize  # activations in the autocast dtype
    resolved, est = resolve_auto(plan, cfg.model, stage.seq_len * stage.batch_size, device, act_bytes, cfg.kernels)
    if est is not None and not est["fits"]:
        raise ConfigError(
            f"stages.{stage_index}.seq_len ({stage.seq_len:,} x batch {stage.batch_size}) does not fit on this device even with "
            f"recompute, offload and sequence chunks (estimated {est['gpu_reserved_bytes'] / 2**30:.0f} GiB reserved of {est['gpu_capacity'] / 2**30:.0f}); "
            "lower the sequence length or batch size (see `longctx estimate`)."
        )
    return resolved
