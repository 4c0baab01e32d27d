"""Benchmark: what each memory switch buys, measured on full training steps of h200-ref on one GPU.

    python bench/memory.py --out bench/out/memory [--quick] [--seqlens 8192,32768] [--configs all_on,recompute_off]
                           [--parts runs,baseline,offload,host] [--resume]
    python bench/memory.py --cpu-smoke --out DIR      # every code path at tiny sizes on the CPU (a CI test)

Model h200-ref (fp32 master weights, bf16 autocast, every kernel auto unless --kernel says), batch 1, random tokens. One
step = forward + backward + AdamW step + router-balance update + the policy's end_step. For every
length in 8k, 32k, 128k, 256k, 512k, 1M: "all_on" (the plan `auto_plan` resolves for this GPU, i.e.
what the trainer runs) and each switch turned off in turn. An OOM is recorded as "oom" and the
longer lengths of that config are skipped ("skipped_after_oom": memory only grows with S); a CUDA error
(a kernel fault, which leaves the context unusable) is recorded as "cuda_error" and ends the invocation; a
switch that changes nothing at some length (offload when the plan offloads nothing, ...) is
"same_as_all_on". Per run: peak allocated and reserved, step time, tokens/s, MFU, host RSS, and
the estimate (`longctx estimate`) of the same plan. Then: the baseline's longest context (doubling
from 4k), pinned vs pageable offload at 256k (whole steps, and the raw copy bandwidth), and host
memory over 20 steps with offload (no growth: the offloader reuses one step's pinned buffers).

Model flops per step (MFU = flops / step time / 778 TFLOP/s, the H200's measured bf16 matmul rate):
  matmuls  6 x S x (parameters that multiply every token: the blocks with k of E routed experts and
           the shared one, mHC projections, router, LM head); the indexer's projections 2x (no backward)
  indexer  2 x H_I x D_I x S x S/P per full DSA layer (every pool is scored, then masked), forward only
  sparse   2 x K x H x (L + L) x S per DSA layer forward (K = index width, L = kv_lora), x3.5 fwd+bwd
  KDA      ~(10 C d + 6 d^2) x S per head forward (chunk C, head dim d: intra-chunk products, the
           state read, update and output), x3 fwd+bwd
The recompute's second forward is not counted: MFU counts the model's work, not the plan's.

--cpu-smoke runs the same code at preset tiny, S = 256 and 1024, with `LiveBytes` (a dispatch
mode counting live tensors) standing in for the CUDA allocator's peak and a small fake capacity,
so that OOMs happen and are handled. OUT/memory.json (the GPU, versions, command, date and commit,
then the runs) is rewritten after every measurement (a run cut short keeps what it has; --resume
continues it); OUT/memory.png is drawn at the end. bench/results/memory.json holds the runs the
README's results table reads, each with the command, date and commit of the invocation that made it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import env_record  # noqa: E402  (bench/timing.py)

from longctx.config import preset
from longctx.errors import ConfigError
from longctx.layers.moe import MoE
from longctx.memory import allocator
from longctx.memory import model_bytes as est
from longctx.memory import planner
from longctx.memory.host_buffers import host_rss_bytes
from longctx.measure import peak as peak_mod
from longctx.measure.meter import LiveBytes
from longctx.memory.plan import MemoryPlan, apply_plan
from longctx.model import LongCtxModel
from longctx.config.kernels import KernelConfig
from longctx.kernels import apply_kernels

GIB = 2**30
PEAK_FLOPS = 778e12
K = 1024
FULL_LENS = [8 * K, 32 * K, 128 * K, 256 * K, 512 * K, 1024 * K]
QUICK_LENS = [8 * K, 32 * K, 128 * K]
SMOKE_LENS = [256, 1024]
SMOKE_CAPACITY = 24 * 2**20  # bytes: the fake GPU of the CPU smoke run

# name -> how it changes the resolved all-on plan ("each switch off in turn")
CONFIGS = {
    "all_on": lambda p: p,
    "sparse_kernel_off": lambda p: dataclasses.replace(p, sparse_kernel=False),
    "chunked_indexer_off": lambda p: dataclasses.replace(p, chunked_indexer=False),
    "recompute_off": lambda p: dataclasses.replace(p, recompute="off", offload="off"),
    # recompute = N (the later blocks keep their activations) -> every block recomputed
    "partial_recompute_off": lambda p: dataclasses.replace(p, recompute="on") if p.recompute.isdigit() else p,
    "offload_off": lambda p: dataclasses.replace(p, offload="off"),
    "pin_memory_off": lambda p: dataclasses.replace(p, pin_memory=False),
    "keep_pinned_off": lambda p: dataclasses.replace(p, keep_pinned=False),
    "reuse_selection_off": lambda p: dataclasses.replace(p, reuse_selection=False),
    "router_release_off": lambda p: dataclasses.replace(p, router_release=False),
    "mhc_cast_recompute_off": lambda p: dataclasses.replace(p, mhc_cast_recompute=False),
    "moe_bf16_combine_off": lambda p: dataclasses.replace(p, moe_bf16_combine=False),
    "moe_chunk_off": lambda p: dataclasses.replace(p, moe_chunk=0),
    "mhc_chunk_off": lambda p: dataclasses.replace(p, mhc_chunk=0),
    "loss_chunk_off": lambda p: dataclasses.replace(p, loss_chunk=0),
    "seq_chunk_off": lambda p: dataclasses.replace(p, seq_chunk="off"),
    "seq_skip_last_off": lambda p: dataclasses.replace(p, seq_skip_last=False),
    "reuse_attention_off": lambda p: dataclasses.replace(p, reuse_attention=False),
    # not a switch: the auto plan's sequence chunk halved (twice the chunks), to time the chunk size
    "seq_chunk_half": lambda p: (dataclasses.replace(p, seq_chunk=str(p.seq_chunk_tokens() // 2))
                                 if p.seq_chunk_tokens() else p),
}
QUICK_CONFIGS = ["all_on", "sparse_kernel_off", "chunked_indexer_off", "recompute_off", "loss_chunk_off"]


def effective(plan: MemoryPlan) -> dict:
    """The plan with settings that cannot matter normalised away (to spot a no-op switch)."""
    d = plan.to_dict()
    blocks = plan.offload_blocks()
    d["offload"] = str(blocks)
    if not blocks:
        d["pin_memory"] = d["keep_pinned"] = None
    if plan.recompute != "on" and not blocks:
        d["reuse_selection"] = None
    if plan.recompute != "on" and not plan.seq_chunk_tokens():
        d["reuse_attention"] = None  # only a recompute can reuse the attention output
    if not plan.chunked_indexer:
        d["indexer_chunk"] = None
    if not plan.seq_chunk_tokens():
        d["seq_chunk"] = "off"
        d["seq_skip_last"] = None
    if not plan.mhc_cast_recompute:  # auto's mHC is then the torch path, which has no liger calls to chunk
        d["mhc_chunk"] = None
    return d


# ----------------------------------------------------------------------------- the device

COPY_OPS = ("aten::copy_", "aten::_to_copy")
# the elementwise ops behind the profile's anonymous rows (bf16 adds, multiplies, wheres)
ELEMENTWISE_OPS = ("aten::add", "aten::add_", "aten::mul", "aten::mul_", "aten::sub", "aten::div", "aten::where",
                   "aten::clamp", "aten::neg", "aten::exp", "aten::sigmoid", "aten::silu", "aten::fill_", "aten::zero_")


def _ops_by_line(events, names: tuple, title: str, limit: int = 40, name_each: bool = False) -> str:
    """The GPU time of the ops in `names` by the innermost longctx (or bench) Python frame above them and
    the op that asked for them (autocast's casts sit under aten::linear, say): which lines the profile's
    anonymous rows come from. Ops in the backward have no Python frames; they are named by their autograd
    node. An op called by another op of `names` (copy_ under _to_copy) is counted once, under its caller.
    `name_each`: rows name the op itself as well (for a family of different ops)."""
    by_line: dict[tuple, list] = {}
    for ev in events:
        if ev.name not in names:
            continue
        p = ev.cpu_parent
        if p is not None and p.name in names:
            continue  # counted once, under its caller
        op, where = None, None
        while p is not None and where is None:
            n = p.name
            if "longctx/" in n or "bench/" in n or "Backward" in n:
                where = n
            elif op is None and n.startswith("aten::") and n not in ("aten::to",) + tuple(names):
                op = n
            p = p.cpu_parent
        t = getattr(ev, "device_time_total", None)
        t = ev.cuda_time_total if t is None else t
        label = ev.name + (f" (in {op})" if op else "") if name_each else op or ""
        row = by_line.setdefault((where or "?", label), [0.0, 0, set()])
        row[0] += t
        row[1] += 1
        if ev.input_shapes and len(row[2]) < 2:
            row[2].add(str(ev.input_shapes[0]))
    rows = sorted(by_line.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))
    total = sum(r[0] for _, r in rows)
    out = [f"{title} by line (GPU ms, calls, the op that asked, some input shapes); total {total / 1e3:.1f} ms"]
    for (where, op), (t, n, shapes) in rows[:limit]:
        out.append(f"{t / 1e3:9.1f} ms {n:6d}  {where}  {op}  {' '.join(sorted(shapes))}")
    return "\n".join(out)


def _copies_by_line(events, limit: int = 40) -> str:
    """aten::copy_ / aten::_to_copy (casts, layout copies) by line (`_ops_by_line`)."""
    return _ops_by_line(events, COPY_OPS, "copies and casts", limit)


def _elementwise_by_line(events, limit: int = 40) -> str:
    """The elementwise ops (ELEMENTWISE_OPS) by line, each row naming the op where no caller op asked."""
    return _ops_by_line(events, ELEMENTWISE_OPS, "elementwise ops", limit, name_each=True)


class Device:
    """CUDA: the caching allocator's peaks. CPU smoke: `LiveBytes` plus what existed before the step."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.dev = torch.device("cpu" if smoke else "cuda")
        if smoke:
            self.name, self.capacity = "cpu (smoke: fake capacity)", SMOKE_CAPACITY
            self.gpu_key = "smoke"
            est.GPUS["smoke"] = {"memory": SMOKE_CAPACITY, "host": 24 * GIB}
        else:
            props = torch.cuda.get_device_properties(self.dev)
            self.name, self.capacity = props.name, props.total_memory
            self.gpu_key = "h200" if "H200" in props.name else "this"
            if self.gpu_key == "this":
                est.GPUS["this"] = {"memory": props.total_memory, "host": est.GPUS["h200"]["host"]}
        self.static = 0  # bytes alive before each step (smoke): parameters, optimizer state
        self._live = None

    def counters(self) -> tuple[int, int]:
        """(allocated, max allocated) bytes of the current step so far (smoke: LiveBytes + static)."""
        if self.smoke:
            live = self._live
            return (self.static + live.current, self.static + live.peak) if live is not None else (self.static, self.static)
        return torch.cuda.memory_allocated(self.dev), torch.cuda.max_memory_allocated(self.dev)

    @contextlib.contextmanager
    def step(self):
        if self.smoke:
            self._live = LiveBytes(limit=self.capacity - self.static)
            with self._live:
                yield
        else:
            torch.cuda.reset_peak_memory_stats(self.dev)
            yield
            torch.cuda.synchronize(self.dev)

    def reset_interval(self) -> None:
        """Restart the peak counter (the --peak timeline's per-interval maxima)."""
        if self.smoke:
            if self._live is not None:
                self._live.peak = self._live.current
        else:
            torch.cuda.reset_peak_memory_stats(self.dev)

    def peaks(self) -> tuple[float, float]:
        """(peak allocated, peak reserved) of the last step, GiB."""
        if self.smoke:
            b = (self.static + self._live.peak) / GIB
            return b, b
        return torch.cuda.max_memory_allocated(self.dev) / GIB, torch.cuda.max_memory_reserved(self.dev) / GIB

    def free(self, collect: bool = False):
        """Give cached blocks back; `collect`: first break the reference cycles an OOM can leave."""
        if collect or not self.smoke:  # (a full gc costs ~0.4 s in a process that imported dynamo)
            gc.collect()
        if not self.smoke:
            torch.cuda.empty_cache()


def host_rss_gib() -> float:
    return host_rss_bytes() / GIB


def pinned_host_gib() -> dict | None:
    """torch's pinned host allocator's blocks: owned (active + cached) and active, GiB. The offloader's and the
    chunked step's buffers are page-locked outside it (longctx/memory/host_buffers.py): their bytes are the
    runs' kept_pinned_gib and show in the RSS."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    try:
        s = stats()
    except RuntimeError:
        return None
    get = lambda k: s[k] / GIB if k in s else None
    return {"owned": get("allocated_bytes.current"), "active": get("active_bytes.current")}


# ----------------------------------------------------------------------------- flops
def model_flops(model: LongCtxModel, S: int) -> dict:
    """Model flops of one training step at S tokens (see the module docstring)."""
    cfg = model.cfg
    E, k = cfg.n_routed_experts, cfg.experts_per_token
    per_token, indexer_proj = 0.0, 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or (name.startswith("embed.") and not cfg.tie_word_embeddings):
            continue
        if ".indexer." in name:
            indexer_proj += p.numel()
        elif name.endswith(("experts.gate_up", "experts.down")):
            per_token += p.numel() * k / E
        else:
            per_token += p.numel()
    kinds, idx = cfg.layer_kinds(), cfg.indexer_kinds()
    n_dsa = kinds.count("D")
    n_full = sum(1 for a, b in zip(kinds, idx) if a == "D" and b == "f")
    C, d = cfg.kda_chunk_size, cfg.kda_head_dim
    out = {
        "matmuls": 6.0 * per_token * S + 2.0 * indexer_proj * S,
        "indexer": n_full * 2.0 * cfg.index_heads * cfg.index_head_dim * S * (S // cfg.index_pool),
        "sparse_attention": n_dsa * 3.5 * 2.0 * cfg.index_width() * cfg.attn_heads * 2 * cfg.kv_lora_rank * S,
        "kda": kinds.count("K") * 3.0 * (10 * C * d + 6 * d * d) * cfg.kda_heads * S,
    }
    out["total"] = sum(out.values())
    return out


# ----------------------------------------------------------------------------- one step
class Bench:
    def __init__(self, args):
        self.args = args
        self.cuda_alloc = allocator.configure(getattr(args, "cuda_alloc", allocator.DEFAULT))  # before CUDA starts
        self.dev = Device(args.cpu_smoke)
        # smoke: tiny with fewer, larger steps inside (3 Sinkhorn rounds, KDA chunks of 64): LiveBytes
        # pays per op
        self.cfg = (preset("tiny").replace(hc_sinkhorn_iters=3, kda_chunk_size=64) if args.cpu_smoke
                    else preset("h200-ref"))
        self.dtype = torch.bfloat16  # autocast dtype (on the CPU too: the smoke runs the GPU's code path)
        self.act_bytes = 4 if self.dtype == torch.float32 else 2
        torch.manual_seed(0)
        with torch.device(self.dev.dev):
            self.model = LongCtxModel(self.cfg)
        # the kernel settings every run uses (every op auto unless --kernel names one)
        self.kernels = KernelConfig.from_dict(getattr(args, "kernels", None) or {})
        apply_kernels(self.model, self.kernels)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, weight_decay=0.0,
                                     fused=self.dev.dev.type == "cuda")
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / "memory.json"
        self.res = self._load() if args.resume else {}
        self.res.update(self._header())
        # every run and section carries the invocation that measured it (a --resume file mixes invocations)
        self.stamp = {k: self.res[k] for k in ("gpu", "command", "date", "commit", "torch", "triton")}
        self.res.setdefault("invocations", []).append({k: self.res[k] for k in ("command", "date", "commit")})
        self.res.setdefault("runs", [])

    # -------------------------------------------------------------- bookkeeping
    def _load(self) -> dict:
        if self.path.exists():
            return json.loads(self.path.read_text())
        return {}

    def _header(self) -> dict:
        versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
        for mod in ("triton", "fla"):
            try:
                versions[mod] = __import__(mod).__version__
            except Exception:  # noqa: BLE001 - absent or broken: recorded as such
                versions[mod] = None
        n = self.model.num_parameters()
        env = {**env_record(self.dev.name), "command": " ".join(["python", "bench/memory.py", *self.args.argv])}
        return {**env, "device": self.dev.dev.type, "capacity_gib": self.dev.capacity / GIB, "versions": versions,
                "preset": "tiny" if self.args.cpu_smoke else "h200-ref", "params": n,
                "autocast": str(self.dtype).replace("torch.", ""), "peak_tflops": PEAK_FLOPS / 1e12,
                "kernels": self.kernels.to_dict(), "cuda_alloc": self.cuda_alloc,
                "model": self.cfg.to_dict()}

    def save(self):
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.res, indent=1))
        tmp.replace(self.path)

    def log(self, msg: str):
        if not self.args.quiet:
            print(msg, flush=True)

    # -------------------------------------------------------------- measuring
    def batch(self, S: int):
        g = torch.Generator(device="cpu").manual_seed(S)
        ids = torch.randint(0, self.cfg.vocab_size, (1, S + 1), generator=g)
        return ids[:, :-1].to(self.dev.dev), ids[:, 1:].to(self.dev.dev)

    def _one_step(self, policy, ids, labels) -> float:
        chunked = getattr(policy, "forward_backward", None)  # a sequence-chunked plan runs its own backward
        with torch.autocast(self.dev.dev.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            out = chunked(self.model, ids, labels) if chunked else self.model(ids, labels=labels, return_logits=False)
        if not chunked:
            out.loss.backward()
        loss = out.loss.detach()
        del out
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.model.apply_balance_updates()
        self.model.clear_aux()
        if policy is not None:
            policy.end_step()
        return loss

    def _cleanup(self, policy):
        self.opt.zero_grad(set_to_none=True)
        self.model.clear_aux()
        for m in self.model.modules():
            if isinstance(m, MoE):
                m._reset_pending()
                m.router_state = None
        if policy is not None:  # close() ends the step too and gives back kept host buffers
            (policy.close if hasattr(policy, "close") else policy.end_step)()
        self.model.block_fn = None
        self.dev.free(collect=True)

    def measure(self, plan: MemoryPlan, S: int, reps: int, after_step=None, on_progress=None) -> dict:
        """`reps` full steps under `plan` (one policy, as in training; `after_step()` runs after each);
        {'status': 'ok', ...}, {'status': 'oom', 'error': ...} or {'status': 'cuda_error', 'error': ...} (a kernel
        fault; the context is unusable after it). `on_progress(line)`: also called with
        each chunk's line of a sequence-chunked step (the --peak timeline marks the chunks with it)."""
        policy = apply_plan(self.model, plan)
        if hasattr(policy, "progress"):  # the sequence-chunked step: a line per chunk, timed
            t_start = time.perf_counter()

            def progress(m):
                if on_progress is not None:
                    on_progress(m)
                self.log(f"  [{S:,} {time.perf_counter() - t_start:7.1f} s] {m}")
            policy.progress = progress
        if self.dev.smoke and getattr(policy, "offloader", None) is not None:
            policy.offloader.force, policy.offloader.min_bytes = True, 0  # move (copy) even CPU tensors
        ids, labels = self.batch(S)
        self.dev.free()
        self.dev.static = self._static_bytes()
        times, pa, pr, err, loss = [], 0.0, 0.0, None, None
        try:
            for _ in range(reps):
                with self.dev.step():
                    t0 = time.perf_counter()
                    loss = self._one_step(policy, ids, labels)
                times.append(time.perf_counter() - t0)
                a, r = self.dev.peaks()
                pa, pr = max(pa, a), max(pr, r)
                if after_step is not None:
                    after_step()
        except torch.OutOfMemoryError as e:
            err = str(e).strip().splitlines()[0][:300]
        except torch.AcceleratorError as e:  # a kernel fault (an illegal memory access, say)
            msg = str(e).strip().splitlines()[0][:300]
            if "out of memory" not in msg.lower():
                return {"status": "cuda_error", "error": msg, "host_rss_gib": host_rss_gib()}
            err = msg
        except RuntimeError as e:  # pinned host memory and some kernels report OOM as a plain RuntimeError
            if "out of memory" not in str(e).lower():
                raise
            err = str(e).strip().splitlines()[0][:300]
        if err is not None:  # outside the except: its traceback no longer pins the step's tensors
            self._cleanup(policy)
            return {"status": "oom", "error": err, "host_rss_gib": host_rss_gib()}
        step_s = times[-1]
        flops = model_flops(self.model, S)
        r = {"status": "ok", "peak_allocated_gib": pa, "peak_reserved_gib": pr, "step_s": step_s,
             "step_s_all": times, "tokens_per_s": S / step_s, "mfu": flops["total"] / step_s / PEAK_FLOPS,
             "model_tflop": {k: v / 1e12 for k, v in flops.items()}, "host_rss_gib": host_rss_gib(),
             "loss": float(loss), "impl": self.model.impl_report()}
        if getattr(policy, "offloader", None) is not None:
            r["offloaded_gib"] = policy.offloader.bytes_offloaded / GIB / max(1, reps)
            r["kept_pinned_gib"] = policy.offloader.kept_bytes / GIB
            policy.close()
        self.model.block_fn = None
        return r

    def _static_bytes(self) -> int:
        if not self.dev.smoke:
            return 0
        seen, total = set(), 0
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        tensors += [t for st in self.opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total

    def estimate(self, plan: MemoryPlan, S: int) -> dict:
        e = est.estimate(self.cfg, S, plan, gpu=self.dev.gpu_key, act_bytes=self.act_bytes, kernels=self.kernels)
        return {"estimate_gib": e["gpu_bytes"] / GIB, "estimate_host_gib": e["host_bytes"] / GIB,
                "estimate_fits": e["fits"]}

    def all_on(self, S: int) -> MemoryPlan:
        """The automatic plan at S, from the defaults with --plan's settings fixed (as a training config's
        `memory` table fixes them)."""
        return planner.auto_plan(self.cfg, S, self.args.fixed_plan, 1, self.dev.gpu_key, self.act_bytes, self.kernels)[0]

    def reps(self, S: int) -> int:
        if S >= 512 * K:
            return self.args.long_reps
        return 1 if self.args.quick else self.args.reps

    # -------------------------------------------------------------- the parts
    def warmup(self, S: int):
        """One untimed step: creates the optimizer state, compiles and tunes the kernels."""
        r = self.measure(self.all_on(S), S, 1)
        self.log(f"warm-up at {S}: {r['status']}")

    def profile(self, S: int):
        """One warm all-on step at S under torch.profiler: OUT/profile_<S>.txt, kernels by GPU time."""
        policy = apply_plan(self.model, self.all_on(S))
        ids, labels = self.batch(S)
        self._one_step(policy, ids, labels)  # warm: this length's compiles and autotuning
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts, record_shapes=True, with_stack=self.args.profile_stacks) as prof:
            t0 = time.perf_counter()
            self._one_step(policy, ids, labels)
            torch.cuda.synchronize()
            step_s = time.perf_counter() - t0
        tables = []
        # by operator (every row: a per-kernel table sums groups of small kernels too), then by operator
        # and input shapes (the shapes say which layer an op belongs to)
        for title, ka, rows in (("by operator", prof.key_averages(), -1),
                                ("by operator and input shapes", prof.key_averages(group_by_input_shape=True), 60)):
            for key in ("self_device_time_total", "self_cuda_time_total"):
                try:
                    tables.append(f"{title}\n{ka.table(sort_by=key, row_limit=rows, max_name_column_width=90)}")
                    break
                except Exception:  # noqa: BLE001 - the key's name changed across torch versions
                    continue
        if self.args.profile_stacks:
            tables.append(_copies_by_line(prof.events()))
            tables.append(_elementwise_by_line(prof.events()))
        path = self.out / f"profile_{S}.txt"
        body = "\n\n".join(tables)
        path.write_text(f"{self.res['command']}\nstep {step_s:.3f} s under the profiler at S={S}\n\n{body}\n")
        self.log(f"profile at {S}: step {step_s:.2f} s, wrote {path}")
        self._cleanup(policy)

    def peak(self, S: int, name: str):
        """One warm step of config `name` at S with the peak timeline (longctx/measure/peak.py): between
        which two marks (module forward, recompute, backward start/end) the peak was reached, and what
        was allocated there (OUT/peak_<S>_<name>.txt, and the JSON). With --peak-trace, the allocator's
        event history as well: what was alive at the peak, by the line of longctx that allocated it."""
        base = self.all_on(S)
        plan = (dataclasses.replace(base, recompute="on", offload=str(self.cfg.num_layers)) if name == "offload_all"
                else CONFIGS[name](base))
        if not self.args.peak_cold:
            self.measure(plan, S, 1)  # warm: compiled, optimizer state, kept buffers exist
        # every mark restarts the allocator's peak counter: each interval, and so each phase, has its own
        with peak_mod.timeline(self.model, read=self.dev.counters, reset=self.dev.reset_interval) as marks:
            r = self.measure(plan, S, 1, on_progress=marks.mark)
        marks.mark("after the step (loss, optimizer)")  # the interval past the last block
        if r["status"] != "ok":
            self.log(f"peak at {S} ({name}): {r['status']}")
            return
        # measure() read the counter of the last interval only: the step's peak is the running max
        r["peak_allocated_gib"] = marks[-1][2] / GIB
        e_full = est.estimate(self.cfg, S, plan, gpu=self.dev.gpu_key, act_bytes=self.act_bytes, kernels=self.kernels)
        est_gib = e_full["gpu_bytes"] / GIB
        head = (f"{self.res['command']}\n{name} at {S}: measured peak {r['peak_allocated_gib']:.2f} GiB, "
                f"estimate {est_gib:.2f} GiB\n")
        where = peak_mod.locate_peak(marks)
        phases = {k: v / GIB for k, v in peak_mod.phase_peaks(marks, self.cfg.layer_kinds()).items()}
        est_phases = {k: v / GIB for k, v in e_full["phases_gpu_bytes"].items()}
        text = head + peak_mod.format_timeline(marks) + "\n\n" + format_phases(phases, est_phases) + "\n"
        entry = {"peak_allocated_gib": r["peak_allocated_gib"], "estimate_gib": est_gib, "plan": plan.to_dict(),
                 "impl": r.get("impl"),
                 "peak_between": [where["after"], where["by"]],
                 "allocated_between_gib": [None if where["allocated_after"] is None else where["allocated_after"] / GIB,
                                           where["allocated_by"] / GIB if where["allocated_by"] is not None else None],
                 "phases_gib": phases,
                 "marks": [(mk[0], *(b / GIB for b in mk[1:])) for mk in marks]}
        if self.args.peak_trace and not self.dev.smoke:
            with peak_mod.record(self.dev.dev) as rec:
                r = self.measure(plan, S, 1)
            if r["status"] == "ok":
                got = peak_mod.alive_at_peak(rec["events"], rec["before"])
                text += "\n" + peak_mod.format_peak(got) + "\n"
                entry.update(replayed_peak_gib=got["peak_bytes"] / GIB, before_gib=got["untracked_bytes"] / GIB,
                             by_site_gib=[(w, b / GIB, n) for w, b, n in got["by_site"]])
        path = self.out / f"peak_{S}_{name}.txt"
        path.write_text(text)
        self.res.setdefault("peaks", {})[f"{S}:{name}"] = entry
        self.save()
        self.log(f"peak at {S} ({name}): {r['peak_allocated_gib']:.2f} GiB between '{where['after']}' and "
                 f"'{where['by']}', wrote {path}")

    def runs(self, lens, configs):
        done = {(r["config"], r["seq_len"]) for r in self.res["runs"]}
        oom_at = {}
        for r in self.res["runs"]:
            if r["status"] == "oom":
                oom_at[r["config"]] = min(oom_at.get(r["config"], 1 << 62), r["seq_len"])
        for S in lens:
            base = self.all_on(S)
            for name in configs:
                if (name, S) in done:
                    continue
                plan = CONFIGS[name](base)
                rec = {"config": name, "seq_len": S, **self.stamp, "plan": plan.to_dict(), **self.estimate(plan, S)}
                if name != "all_on" and effective(plan) == effective(base):
                    rec["status"] = "same_as_all_on"
                elif name in oom_at and S > oom_at[name]:
                    rec["status"] = "skipped_after_oom"
                else:
                    rec.update(self.measure(plan, S, self.reps(S)))
                    if rec["status"] == "oom":
                        oom_at[name] = min(oom_at.get(name, S), S)
                self.res["runs"].append(rec)
                self.save()
                self.log(_line(rec))
                if rec["status"] == "cuda_error":  # the CUDA context is unusable from here: stop, the run recorded
                    raise SystemExit(f"{name} at {S:,} tokens: {rec['error']} (recorded in {self.path}; stopping)")

    def baseline_max(self, start: int, cap: int):
        if self.args.resume and "baseline_max_context" in self.res:
            return
        plan = MemoryPlan.baseline()
        attempts, best, S = [], None, start
        while S <= cap:
            r = {"seq_len": S, **self.estimate(plan, S), **self.measure(plan, S, 1)}
            attempts.append(r)
            self.log("baseline " + _line({"config": "baseline", **r}))
            if r["status"] != "ok":
                break
            best, S = S, 2 * S
        pred = estimated_max_context(self.cfg, plan, start, 64 * cap, self.dev.gpu_key, self.act_bytes)
        self.res["baseline_max_context"] = {**self.stamp, "max_ok": best, "estimate_max": pred, "attempts": attempts}
        self.save()

    OFFLOAD_MODES = {"pinned": (True, False), "pinned_kept": (True, True), "pageable": (False, False), "no_offload": None}

    def offload_pinned_vs_pageable(self, S: int, modes=tuple(OFFLOAD_MODES)):
        """Offload's cost: every block's input offloaded (pinned and released each step, pinned and kept,
        pageable) against no offload, at S; in the order of `modes`, saved after each."""
        if self.args.resume and "offload_pinned_vs_pageable" in self.res:
            return
        base = dataclasses.replace(self.all_on(S), recompute="on", offload=str(self.cfg.num_layers))
        out = {**self.stamp, "seq_len": S, "offload_blocks": self.cfg.num_layers, "host_buffers": "exact-size page-locked"}
        self.res["offload_pinned_vs_pageable"] = out
        for name in modes:
            if self.OFFLOAD_MODES[name] is None:
                plan = dataclasses.replace(base, offload="off")
            else:
                pin, keep = self.OFFLOAD_MODES[name]
                plan = dataclasses.replace(base, pin_memory=pin, keep_pinned=keep)
            out[name] = {**self.estimate(plan, S), **self.measure(plan, S, self.reps(S))}
            self.log(f"offload {name}: " + _line({"config": name, "seq_len": S, **out[name]}))
            self.save()
        ok = {k: v["step_s"] for k, v in out.items() if isinstance(v, dict) and v.get("status") == "ok"}
        if "no_offload" in ok:
            out["step_over_no_offload"] = {k: t / ok["no_offload"] for k, t in ok.items() if k != "no_offload"}
        if "pinned" in ok and "pageable" in ok:
            out["pageable_over_pinned_step"] = ok["pageable"] / ok["pinned"]
        out["copy_bandwidth"] = self._copy_bandwidth(S)
        self.save()

    def _copy_bandwidth(self, S: int) -> dict | None:
        """GB/s of one block input (the mHC state, bf16) GPU->host and back, pinned vs pageable."""
        if self.dev.smoke:
            return None
        n = S * self.cfg.hc_streams * self.cfg.hidden_size
        x = torch.randn(n, device=self.dev.dev).to(torch.bfloat16)
        out = {"bytes": x.numel() * 2}
        for name, pin in (("pinned", True), ("pageable", False)):
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=pin)
            d2h, h2d = [], []
            for _ in range(5):
                t0 = time.perf_counter()
                host.copy_(x, non_blocking=pin)
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                x.copy_(host, non_blocking=pin)
                torch.cuda.synchronize()
                d2h.append(t1 - t0)
                h2d.append(time.perf_counter() - t1)
            out[name] = {"d2h_gb_s": out["bytes"] / statistics.median(d2h) / 1e9,
                         "h2d_gb_s": out["bytes"] / statistics.median(h2d) / 1e9}
            del host
        del x
        self.dev.free()
        return out

    def host_memory(self, S: int, steps: int):
        if self.args.resume and "host_memory_with_offload" in self.res:
            return
        plan = dataclasses.replace(self.all_on(S), recompute="on", offload=str(self.cfg.num_layers))
        rss, pinned = [], []
        r = self.measure(plan, S, steps, after_step=lambda: (rss.append(host_rss_gib()), pinned.append(pinned_host_gib())))
        self.res["host_memory_with_offload"] = {**self.stamp,
            "seq_len": S, "host_buffers": "exact-size page-locked", "steps": len(rss), "status": r["status"], "rss_gib": rss, "pinned_gib": pinned,
            "step_s": r.get("step_s_all"), "plan": plan.to_dict(), "offloaded_gib_per_step": r.get("offloaded_gib"),
            "rss_growth_gib": (rss[-1] - rss[0]) if rss else None}
        self.save()
        self.log(f"host memory over {len(rss)} steps at {S}: RSS {rss[0] if rss else 0:.2f} -> "
                 f"{rss[-1] if rss else 0:.2f} GiB")


def estimated_max_context(cfg, plan: MemoryPlan, start: int, cap: int, gpu: str, act_bytes: int) -> int | None:
    """The longest of start, 2 start, 4 start, ... <= cap that the estimate says fits (None: not even start)."""
    pred, S = None, start
    while S <= cap and est.estimate(cfg, S, plan, 1, gpu, act_bytes)["fits"]:
        pred, S = S, 2 * S
    return pred


def estimate_phase(measured: str) -> str:
    """The estimate's name (longctx/memory/model_bytes.py, phases_gpu_bytes) of a measured phase
    (longctx/measure/peak.py, phase_peaks): chunk N/N is the backward sweep's first ('last chunk'), the
    others 'earlier chunks'; the forward and the loss is the estimate's end of the forward."""
    name = measured
    if name.startswith("chunk "):
        c, _, name = name[len("chunk "):].partition(": ")
        i, n = c.split("/")
        prefix = "last chunk: " if i == n else "earlier chunks: "
    else:
        prefix = ""
    if name == "the forward and the loss":
        name = "the end of the forward (loss)"
    return prefix + name


def by_estimate_phase(measured: dict) -> dict:
    """Measured phase peaks under the estimate's phase names (the largest chunk for 'earlier chunks')."""
    out: dict = {}
    for k, v in measured.items():
        e = estimate_phase(k)
        out[e] = max(out.get(e, 0), v)
    return out


def format_phases(measured: dict, estimated: dict) -> str:
    """Measured peak of each phase beside the estimate of that phase."""
    rows = []
    lines = [f"{'phase':<48}{'measured GiB':>13}{'estimate GiB':>13}{'error':>8}"]
    for e, v in by_estimate_phase(measured).items():
        x = estimated.get(e)
        rows.append(f"{e:<48}{v:13.2f}{_f(x):>13}{_err(x, v) if x is not None else '':>8}")
    return "\n".join(lines + rows)


def _line(r: dict) -> str:
    s = f"{r['config']:<24}{r['seq_len']:>9,}  {r['status']:<18}"
    if r["status"] == "ok":
        s += (f"peak {r['peak_allocated_gib']:8.2f} GiB (est {r['estimate_gib']:8.2f})  {r['step_s']:8.2f} s  "
              f"{r['tokens_per_s']:10,.0f} tok/s  MFU {100 * r['mfu']:5.1f}%")
    elif "estimate_gib" in r:
        s += f"est {r['estimate_gib']:.2f} GiB"
    return s


# ----------------------------------------------------------------------------- the figure
def figure(res: dict, path: Path):
    """Peak allocated vs S, a line per config, and the all_on runs' estimates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    cap = res["capacity_gib"]
    runs = res["runs"]
    names = [n for n in CONFIGS if any(r["config"] == n for r in runs)]
    for i, name in enumerate(names):
        rs = sorted((r for r in runs if r["config"] == name), key=lambda r: r["seq_len"])
        ok = [(r["seq_len"], r["peak_allocated_gib"]) for r in rs if r["status"] == "ok"]
        ok += [(r["seq_len"], next((q["peak_allocated_gib"] for q in runs if q["config"] == "all_on"
                                    and q["seq_len"] == r["seq_len"] and q["status"] == "ok"), None))
               for r in rs if r["status"] == "same_as_all_on"]
        ok = sorted((s, g) for s, g in ok if g is not None)
        oom = [r["seq_len"] for r in rs if r["status"] == "oom"]
        style = {"lw": 2.5, "color": "k"} if name == "all_on" else {"lw": 1, "ls": "-", "marker": "."}
        if ok:
            (line,) = ax.plot([s for s, _ in ok], [g for _, g in ok], label=name, **style)
            color = line.get_color()
        else:
            color = f"C{i % 10}"
        if oom:
            ax.scatter(oom, [cap * 1.04] * len(oom), marker="x", color=color, label=None if ok else f"{name} (oom)")
    allon = sorted((r["seq_len"], r["estimate_gib"]) for r in runs if r["config"] == "all_on")
    if allon:
        ax.plot([s for s, _ in allon], [g for _, g in allon], ls=":", color="k", lw=1, label="all_on, estimate")
    bl = res.get("baseline_max_context")
    if bl and bl["attempts"]:
        pts = [(a["seq_len"], a["peak_allocated_gib"]) for a in bl["attempts"] if a["status"] == "ok"]
        if pts:
            ax.plot([s for s, _ in pts], [g for _, g in pts], ls="--", color="gray", marker="s", ms=3,
                    label=f"baseline (max {bl['max_ok']:,})" if bl["max_ok"] else "baseline")
    ax.axhline(cap, color="r", lw=1.5, ls="--", label=f"GPU capacity {cap:.3g} GiB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens, batch 1)")
    ax.set_ylabel("peak allocated (GiB)")
    ax.set_title(f"{res['preset']} one training step on {res['gpu']} (x = out of memory)", fontsize=9)
    ax.legend(fontsize=6, ncol=2, loc="lower right")  # (upper left hid the OOM marks at 32k)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _f(x, fmt: str = ".2f") -> str:
    return "" if x is None else format(x, fmt)


def _err(est_gib, measured) -> str:
    return "" if not measured else f"{100 * (est_gib - measured) / measured:+.1f}%"


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "memory"))
    ap.add_argument("--quick", action="store_true", help="8k..128k, five configs, one step each, short host test")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU: checks the code paths")
    ap.add_argument("--seqlens", help="comma-separated lengths (default: 8k..1M; quick 8k..128k)")
    ap.add_argument("--configs", help=f"comma-separated subset of {', '.join(CONFIGS)}")
    ap.add_argument("--parts", default="runs,baseline,offload,host")
    ap.add_argument("--reps", type=int, default=2, help="steps per measurement below 512k (the last is timed)")
    ap.add_argument("--long-reps", type=int, default=1,
                    help="steps per measurement at 512k and above (the last is timed; a process's first step at a "
                         "new chunk length compiles and page-locks, ~2x slower: 2 reports a warm step)")
    ap.add_argument("--host-steps", type=int, help="steps of the host-memory test (default 20; quick 5; smoke 3)")
    ap.add_argument("--host-seqlen", type=int, help="sequence length of the host-memory test (default 256k; quick 32k)")
    ap.add_argument("--cuda-alloc", default=allocator.DEFAULT,
                    help="CUDA allocator settings ('' = torch's defaults)")
    ap.add_argument("--offload-modes", default=",".join(Bench.OFFLOAD_MODES),
                    help="which offload runs, in order: " + ",".join(Bench.OFFLOAD_MODES))
    ap.add_argument("--offload-seqlen", type=int, help="sequence length of pinned vs pageable (default 256k; quick 32k)")
    ap.add_argument("--resume", action="store_true", help="keep OUT/memory.json's results and add the missing ones")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--kernel", action="append", metavar="OP=BACKEND", dest="kernel_settings",
                    help="a kernel setting for every run, as the training config's kernels.OP (e.g. mhc=torch, "
                         "rms_norm=torch); default every op auto: its fast path on CUDA")
    ap.add_argument("--peak", metavar="S[:CONFIG]",
                    help="CUDA: after the runs, what is alive at the peak of one warm step at S tokens under CONFIG "
                         "(all_on, a switch-off config, or offload_all; default all_on)")
    ap.add_argument("--peak-cold", action="store_true",
                    help="with --peak: no warm step before the timed one at S (the 8k warm-up still runs; a 1M step costs 90 s)")
    ap.add_argument("--peak-trace", action="store_true",
                    help="with --peak: also one step under torch's allocation history (what is alive at the peak by "
                         "allocating line; it failed inside the recompute backward on the H200 with torch 2.11)")
    ap.add_argument("--profile", type=int, metavar="S", help="after the runs, profile one warm all-on step at S tokens")
    ap.add_argument("--profile-stacks", action="store_true",
                    help="with --profile: record Python stacks and add tables of the copies and casts' and the "
                         "elementwise ops' GPU time by longctx line")
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed first step (the first run then includes compilation)")
    ap.add_argument("--plan", nargs="+", default=[], metavar="SWITCH=VALUE",
                    help="memory settings fixed before the automatic plan resolves the rest, as a training config's "
                         "`memory` table, e.g. --plan seq_chunk=off offload=10 (a whole-sequence 512k step)")
    a = ap.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a.fixed_plan = MemoryPlan.from_dict(planner.parse_switches(a.plan, "--plan"))
        a.kernels = {}
        for k in a.kernel_settings or []:
            op, sep, impl = k.partition("=")
            if not sep:
                raise ConfigError(f"--kernel {k!r} is not OP=BACKEND; write it like --kernel mhc=torch.")
            a.kernels[op.strip()] = impl.strip()
        KernelConfig.from_dict(a.kernels)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not a.cpu_smoke and not torch.cuda.is_available():
        print("error: bench/memory.py needs a CUDA GPU (or --cpu-smoke).", file=sys.stderr)
        return 2
    if a.cpu_smoke:
        a.quick = False
        a.reps = 1
    lens = [int(x) for x in a.seqlens.split(",")] if a.seqlens else (
        SMOKE_LENS if a.cpu_smoke else QUICK_LENS if a.quick else FULL_LENS)
    configs = a.configs.split(",") if a.configs else (QUICK_CONFIGS if a.quick else list(CONFIGS))
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        print(f"error: --configs {','.join(bad)} unknown; choose from {', '.join(CONFIGS)}.", file=sys.stderr)
        return 2
    if "all_on" not in configs:
        configs = ["all_on", *configs]
    parts = set(a.parts.split(",")) - {"none"}
    if parts - {"runs", "baseline", "offload", "host"}:
        print(f"error: --parts {a.parts!r}: use some of runs,baseline,offload,host (or none: only --profile/--peak)",
              file=sys.stderr)
        return 2

    peak_at = None
    if a.peak:
        n, _, name = a.peak.partition(":")
        name = name or "all_on"
        if not n.isdigit() or (name not in CONFIGS and name != "offload_all"):
            print(f"error: --peak {a.peak!r}: use S[:CONFIG] with S a token count and CONFIG one of all_on, "
                  f"offload_all, {', '.join(c for c in CONFIGS if c != 'all_on')}", file=sys.stderr)
            return 2
        peak_at = (int(n), name)
    modes = tuple(a.offload_modes.split(","))
    unknown = [m for m in modes if m not in Bench.OFFLOAD_MODES]
    if unknown:
        print(f"error: --offload-modes: unknown {', '.join(unknown)}; use some of {','.join(Bench.OFFLOAD_MODES)}",
              file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    if a.cpu_smoke:
        torch.set_num_threads(1)
    try:
        b = Bench(a)
        b.log(f"{b.res['gpu']}: {b.res['preset']}, {b.res['params']['total'] / 1e6:,.1f}M parameters, "
              f"capacity {b.dev.capacity / GIB:.3g} GiB")
        if not a.no_warmup:
            b.warmup(min(lens) if a.cpu_smoke else min(min(lens), 8 * K))
        if "runs" in parts:
            b.runs(lens, configs)
        if a.profile and not a.cpu_smoke:
            b.profile(a.profile)
        if peak_at is not None:
            b.peak(*peak_at)
        if "baseline" in parts:
            b.baseline_max(256 if a.cpu_smoke else 4 * K, 4 * K if a.cpu_smoke else 2048 * K)
        if "offload" in parts:
            b.offload_pinned_vs_pageable(512 if a.cpu_smoke else a.offload_seqlen or (32 * K if a.quick else 256 * K), modes)
        if "host" in parts:
            b.host_memory(256 if a.cpu_smoke else a.host_seqlen or (32 * K if a.quick else 256 * K),
                          a.host_steps or (3 if a.cpu_smoke else 5 if a.quick else 20))
        figure(b.res, b.out / "memory.png")
        b.log(f"wrote {b.path} and {b.out / 'memory.png'}")
    finally:
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as e:  # a setting the run cannot take: one sentence, exit 2 (what was measured is saved)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
