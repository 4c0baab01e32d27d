#!/usr/bin/env bash
# The GPU runs behind bench/results/*.json and the GPU tests, as run on the lent H200 (one call per part).
#   bash bench/run_h200.sh kernels   # every GPU test (the 128k end-to-end check included), then the KDA benchmark
#   (bench/indexer.py, bench/fused_loss.py --modes amp and bench/mhc.py ran the same way: bench/results/*.json)
#   bash bench/run_h200.sh memory    # 8k warm-up, the 1M step, a profiled 128k step, the 8k..128k ablation
#   bash bench/run_h200.sh step1m    # 8k warm-up, the 1M step, a profiled 128k step, baseline max, host memory
#   NO_PACK=1 bash bench/run_h200.sh extras  # offload cost + pinned vs pageable, liger mHC, 128k/256k switches
#   bash bench/run_h200.sh tests offload     # parts run in order in one call: tests, e2e, sparse, kda, mhc, indexer, variants, hostbuf, offload, liger, peak, host, switches
# The files each call brings back go to bench/results/memory_runs/ (numbered in call order), then
#   python bench/memory.py --report bench/results/memory_runs/*.json --out bench/results
# Wheels (fla-core, liger-kernel) travel in .whl/ (../shared/gpu/fetch-wheels.sh); results go to $OUT.
# Each part stays under the device tool's 600 s per call, with its own timeouts inside so that the
# logs and JSON written so far come back.
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# Compiled kernels and autotuning results (fla's KDA kernels autotune; a cold machine spends ~250 s
# compiling before its first step) persist in .triton-cache. The end of each call packs it into
# $OUT/triton-cache.tgz.part-* (the device tool returns files of at most 16 MiB); here,
#   cat DIR/triton-cache.tgz.part-* > .triton-cache.tgz
# and name .triton-cache.tgz in the next call's carry to start warm.
export TRITON_CACHE_DIR=$PWD/.triton-cache TRITON_CACHE_AUTOTUNING=1
[ -f .triton-cache.tgz ] && tar xzf .triton-cache.tgz && echo "triton cache: $(du -sh .triton-cache | cut -f1) carried"
pack_cache() { tar czf - .triton-cache 2>/dev/null | split -b 15m - "$OUT/triton-cache.tgz.part-"; ls "$OUT" | grep -c part-; }
[ -z "${NO_PACK:-}" ] && trap pack_cache EXIT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# Parts run in the order given, sharing the call's CALL_S (575) seconds: `left N` is N seconds or what is left, the less.
CALL_S=${CALL_S:-575}
left() { local r=$((CALL_S - SECONDS)); [ -n "${1:-}" ] && [ "$1" -lt "$r" ] && r=$1; echo $((r > 1 ? r : 1)); }
[ $# -eq 0 ] && set -- usage
[ "$1" = kernels ] && set -- tests e2e kda
[ "$1" = extras ] && set -- offload liger switches
for part in "$@"; do
echo "$(date +%T) part $part"
case "$part" in
tests)
  # the GPU test files (all but the 128k end-to-end check, or those named in GPU_TESTS, in that order),
  # (GPU_TESTS_K: a pytest -k expression), each under its own timeout (TEST_S, 200 s; 420 for the chunked step) so that one slow file does not hide the others, logged whole (a tail
  # through the tool's 12k-character window loses the failures), with each test's duration
  for f in ${GPU_TESTS:-fused_loss indexer kda mhc mhc_project norms swiglu sequence_chunks sparse_attention test_logic int32 host_buffers}; do
    echo "=== tests/test_gpu_$f.py" >> "$OUT/gpu_tests.log"
    # the chunked-step test compiles fla's fp32 kernels for its shapes: > 225 s on a machine started for it (calls 33, 37)
    t=${TEST_S:-200}; [ "$f" = sequence_chunks ] && [ -z "${TEST_S:-}" ] && t=420
    timeout $(left $t) python -m pytest -q -rfE --tb=short -s --durations=0 -o faulthandler_timeout=240 ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} "tests/test_gpu_$f.py" >> "$OUT/gpu_tests.log" 2>&1
    echo "=== tests/test_gpu_$f.py: exit $?" | tee -a "$OUT/gpu_tests.log"
  done
  grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu_tests.log" | tail -15
  ;;
e2e)
  # the 128k training-forward vs decode-path check (about 250 s)
  timeout $(left) python -m pytest -q -rfE --tb=short -s tests/test_gpu_end_to_end.py > "$OUT/gpu_e2e.log" 2>&1
  tail -5 "$OUT/gpu_e2e.log"
  ;;
indexer)
  # the indexer paths at 32k and 128k (fused, two-phase with topk and with the radix k-th) and the
  # two-phase probe; INDEXER_ARGS="--quick --sweep --probe" adds the fused kernel's config sweep (call 11 ran it)
  timeout $(left) python bench/indexer.py --out "$OUT" ${INDEXER_ARGS:---quick --probe} > "$OUT/indexer.log" 2>&1; tail -4 "$OUT/indexer.log"
  ;;
variants)
  # 128k steps with opt-in kernels beside all_on (the defaults) in the same call (VARIANTS: ';'-separated
  # memory.py options, "all_on" for none). Call 12 ran "--indexer-kernel fused --kda-conv torch" (then the
  # defaults), two_phase, fla conv and both; call 15 the radix k-th select; next: the grouped k-th select
  IFS=';' read -ra vs <<< "${VARIANTS:-all_on;--indexer-kernel two_phase_grouped}"
  for v in "${vs[@]}"; do
    d=$(echo $v | tr -d ' -' | tr '_' '-'); o=$v; [ "$v" = all_on ] && o=
    echo "$(date +%T) variant $v"
    timeout $(left) python bench/memory.py --out "$OUT/$d" $o --parts runs --configs all_on --seqlens 131072 \
        > "$OUT/memory_$d.log" 2>&1; tail -2 "$OUT/memory_$d.log"
    rm -f "$OUT/$d/memory.png"  # the device tool returns a limited number of files: keep the JSON (call 12 lost two)
  done
  ;;
sparse)
  # DSA sparse attention vs dense SDPA, forward and backward, and the tile sweep
  # (SPARSE_ARGS, e.g. "--seqlens 32768,131072 --dense-max-seqlen 32768 --sweep --sweep-only 16:bwd")
  timeout $(left) python bench/sparse_attention.py --out "$OUT" ${SPARSE_ARGS:-} > "$OUT/sparse_attention.log" 2>&1
  tail -12 "$OUT/sparse_attention.log"
  ;;
kda)
  timeout $(left) python bench/kda.py --out "$OUT" > "$OUT/kda.log" 2>&1; tail -5 "$OUT/kda.log"
  ;;
mhc)
  # mHC: MHC_ARGS for bench/mhc.py (default --project: the coefficient projection, liger's kernels vs ours)
  timeout $(left) python bench/mhc.py --out "$OUT" ${MHC_ARGS:---project} > "$OUT/mhc.log" 2>&1; tail -5 "$OUT/mhc.log"
  ;;
hostbuf)
  # host buffers for offload: torch's pinned allocator vs exact-size registered vs pageable (call 52)
  timeout $(left 120) python bench/host_buffers.py --out "$OUT" > "$OUT/host_buffers.log" 2>&1; tail -7 "$OUT/host_buffers.log"
  ;;
memory)
  # warm-up at 8k (compiles, optimizer state), one 1M step in steady state, a profiled 128k step,
  # then the ablation (each switch off in turn) at 8k, 32k, 128k while time is left
  timeout $(left 440) python bench/memory.py --out "$OUT" --parts runs --configs all_on --seqlens 1048576 \
      --profile 131072 > "$OUT/memory_1m.log" 2>&1; tail -6 "$OUT/memory_1m.log"
  timeout $(left) python bench/memory.py --out "$OUT" --parts runs --resume --reps 1 \
      --seqlens 8192,32768,131072 > "$OUT/memory_ablation.log" 2>&1; tail -30 "$OUT/memory_ablation.log"
  ;;
step1m)
  # warm-up at 8k (compiles, optimizer state), one 1M step in steady state (a line per chunk, with the
  # peak so far), a profiled 128k step, the baseline's longest context, host memory over 20 steps
  # (STEP1M_PARTS to choose the parts, STEP1M_CONFIGS the configs, e.g. all_on,seq_skip_last_off,
  # STEP1M_ARGS for more memory.py options, e.g. "--kda-conv fla" or "--long-reps 2" for a warm step,
  # STEP1M_PROFILE= (empty) for no profile)
  timeout $(left) python bench/memory.py --out "$OUT" --parts ${STEP1M_PARTS:-runs,baseline,host} ${STEP1M_ARGS:-} --configs ${STEP1M_CONFIGS:-all_on} \
      --seqlens 1048576 ${STEP1M_PROFILE---profile 131072} --host-seqlen 65536 > "$OUT/memory_1m.log" 2>&1; tail -40 "$OUT/memory_1m.log"
  ;;
offload)
  # offload's cost at 256k: no offload, pinned kept by the offloader (the default), pinned handed back every step, pageable
  # (in that order: call 46 got through only its first mode after compiling)
  timeout $(left ${OFFLOAD_S:-240}) python bench/memory.py --out "$OUT" --parts offload --seqlens 262144 --offload-seqlen 262144 \
      --offload-modes ${OFFLOAD_MODES:-no_offload,pinned_kept,pinned,pageable} \
      > "$OUT/memory_offload.log" 2>&1; tail -8 "$OUT/memory_offload.log"
  ;;
liger)
  # a profiled 128k step with liger's mHC kernels (the torch mHC path is half of a 128k step: bench/NOTES.md)
  timeout $(left) python bench/memory.py --out "$OUT/liger" --residual-impl liger --parts runs --configs all_on \
      --seqlens 131072 --profile 131072 > "$OUT/memory_liger_mhc.log" 2>&1; tail -4 "$OUT/memory_liger_mhc.log"
  ;;
peak)
  # what is alive at the peak and each phase's own peak, by allocating line, for each S[:CONFIG] of PEAKS
  # (default: the offloaded and the all-on 256k steps); a 1M step runs cold (--peak-cold: the 8k warm-up
  # makes the optimizer state; a warm step of its own would cost 90 s); PEAK_ARGS=--peak-trace for the
  # allocator's history (what was alive at the peak, by allocating line)
  for pk in ${PEAKS:-262144:offload_all 262144}; do
    cold=; [ "${pk%%:*}" -ge 1048576 ] && cold=--peak-cold
    timeout $(left) python bench/memory.py --out "$OUT/peak" --resume --parts none $cold ${PEAK_ARGS:-} --peak $pk >> "$OUT/memory_peak.log" 2>&1
    tail -3 "$OUT/memory_peak.log"
  done
  rm -f "$OUT/peak/memory.png"  # the device tool returns at most 8 files
  ;;
host)
  # host memory over 20 offloaded steps at 64k (the offloader's kept pinned buffers must not grow)
  timeout $(left 240) python bench/memory.py --out "$OUT" --parts host --host-seqlen 65536 > "$OUT/memory_host.log" 2>&1
  tail -3 "$OUT/memory_host.log"
  ;;
switches)
  # the 128k and 256k switches (SWITCH_SEQLENS, SWITCH_CONFIGS to choose; SWITCH_ARGS for more memory.py options,
  # last on the line, e.g. "--plan seq_chunk=off offload=10" for the plan of calls 41-42's 512k step)
  timeout $(left) python bench/memory.py --out "$OUT" --resume --parts runs --seqlens ${SWITCH_SEQLENS:-131072,262144} \
      --configs ${SWITCH_CONFIGS:-all_on,mhc_chunk_off,chunked_indexer_off,reuse_selection_off,router_release_off,mhc_cast_recompute_off,moe_bf16_combine_off,loss_chunk_off} \
      ${SWITCH_ARGS:-} > "$OUT/memory_extras.log" 2>&1; tail -16 "$OUT/memory_extras.log"
  ;;
*) echo "usage: bench/run_h200.sh PART... with PART in tests e2e sparse kda mhc indexer variants kernels hostbuf memory step1m offload liger peak host switches extras"; exit 2 ;;
esac
done
