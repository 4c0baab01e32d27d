#!/usr/bin/env bash
# The GPU tests and the benchmarks on one lent H200, in parts that each fit the device tool's 600 s per
# command (dev/README.md says how to call it). Parts run in the order given, in one process tree:
#   bash dev/run_h200.sh tests e2e           # the GPU test files below, then the 128k end-to-end check
#   bash dev/run_h200.sh sparse indexer kda  # kernel benchmarks: bench/<name>.py --out $OUT
#   bash dev/run_h200.sh step1m              # 8k warm-up, one 1M-token step, baseline's longest context, host memory
# Parts: tests e2e sparse atomics indexer kda mhc mhc_enter router fused_loss hostbuf fp32_parity memory step1m offload rl installed profile peak host
# switches variants trees sft, and kernels (= tests e2e kda) and extras (= offload switches). Results go to $OUT (the device
# tool's, else bench/out/h200); each benchmark writes its JSON there (bench/results/<name>.json is the
# tracked copy the README's table reads: copy a run's JSON over it, then `python bench/make_table.py --write`).
# Wheels (fla-core, liger-kernel) travel in .whl/ (../shared/gpu/fetch-wheels.sh fetches them).
# Each part has its own timeout inside the call's CALL_S seconds, so the logs and JSON written so far come back.
set -u

# The GPU test files, run by the `tests` part in this order (GPU_TESTS="FILE ..." to pick; a bare name
# such as `mhc` means tests/ops/test_mhc_gpu.py); E2E_TEST is the `e2e` part's, left out of `tests` (~250 s).
GPU_TEST_FILES="tests/ops/test_loss_gpu.py tests/ops/test_indexer_gpu.py tests/ops/test_kda_gpu.py tests/ops/test_mhc_gpu.py
  tests/ops/test_mhc_projection_gpu.py tests/ops/test_rms_norm_gpu.py tests/ops/test_swiglu_gpu.py tests/ops/test_router_gpu.py tests/memory/test_sequence_chunks_gpu.py
  tests/ops/test_sparse_attention_gpu.py tests/ops/test_sparse_attention_flashmla_gpu.py tests/test_step_drift_gpu.py tests/ops/test_int32_gpu.py tests/memory/test_host_buffers_gpu.py
  tests/test_hf_fp32_gpu.py"
E2E_TEST=tests/test_end_to_end_gpu.py

OUT=${OUT:-bench/out/h200}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# Compiled kernels and autotuning results persist in .triton-cache (fla's KDA kernels autotune; a cold
# machine compiles for ~250 s before its first 128k step). The end of each call packs it into
# $OUT/triton-cache.tgz.part-* (the device tool returns files of at most 16 MiB); back here,
#   cat DIR/triton-cache.tgz.part-* > .triton-cache.tgz
# and name .triton-cache.tgz in the next call's carry to start warm. NO_PACK=1 skips the packing.
export TRITON_CACHE_DIR=$PWD/.triton-cache TRITON_CACHE_AUTOTUNING=1
[ -f .triton-cache.tgz ] && tar xzf .triton-cache.tgz && echo "triton cache: $(du -sh .triton-cache | cut -f1) carried"
pack_cache() { tar czf - .triton-cache 2>/dev/null | split -b 15m - "$OUT/triton-cache.tgz.part-"; ls "$OUT" | grep -c part-; }
[ -z "${NO_PACK:-}" ] && trap pack_cache EXIT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "commit: ${LONGCTX_COMMIT:-unknown (set LONGCTX_COMMIT to record it in the JSON)}"
# Parts share the call's CALL_S (575) seconds: `left N` is N seconds or what is left, the less.
CALL_S=${CALL_S:-575}
left() { local r=$((CALL_S - SECONDS)); [ -n "${1:-}" ] && [ "$1" -lt "$r" ] && r=$1; echo $((r > 1 ? r : 1)); }
[ $# -eq 0 ] && set -- usage
[ "$1" = kernels ] && set -- tests e2e kda
[ "$1" = extras ] && set -- offload switches
for part in "$@"; do
echo "$(date +%T) part $part"
case "$part" in
tests)
  # each file under its own timeout (TEST_S, 200 s; 420 for the chunked step, which compiles fla's fp32
  # kernels for its shapes on a cold machine, and for the indexer's, whose exact-input cases compile every
  # selection's kernels for seven configs) so that one slow file does not hide the others; GPU_TESTS_K:
  # a pytest -k expression; logged whole, with each test's duration (a tail loses the failures)
  for f in ${GPU_TESTS:-$GPU_TEST_FILES}; do
    case "$f" in */*) ;; *) f=$(ls tests/test_${f}_gpu.py tests/*/test_${f}_gpu.py 2>/dev/null | head -1) ;; esac
    echo "=== $f" >> "$OUT/gpu_tests.log"
    t=${TEST_S:-200}; case "$f" in *sequence_chunks*|*indexer_gpu*) [ -z "${TEST_S:-}" ] && t=420 ;; esac
    timeout $(left $t) python -m pytest -q -rfE --tb=short -s --durations=0 -o faulthandler_timeout=240 ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} "$f" >> "$OUT/gpu_tests.log" 2>&1
    echo "=== $f: exit $?" | tee -a "$OUT/gpu_tests.log"
  done
  grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu_tests.log" | tail -15
  ;;
e2e)
  # the 128k training-forward vs decode-path check (about 250 s)
  timeout $(left) python -m pytest -q -rfE --tb=short -s "$E2E_TEST" > "$OUT/gpu_e2e.log" 2>&1
  tail -5 "$OUT/gpu_e2e.log"
  ;;
sparse)
  # DSA sparse attention vs dense SDPA, forward and backward (SPARSE_ARGS, e.g. "--seqlens 32768,131072 --sweep")
  timeout $(left) python bench/sparse_attention.py --out "$OUT" ${SPARSE_ARGS:-} > "$OUT/sparse_attention.log" 2>&1
  tail -12 "$OUT/sparse_attention.log"
  ;;
indexer)
  # the indexer's Triton path and the torch twins at 32k and 128k, and the probe of the Triton path's parts
  # (INDEXER_ARGS; "" for 8k..1M, --sweep for the score kernel's tile configs)
  timeout $(left) python bench/indexer.py --out "$OUT" ${INDEXER_ARGS---quick --probe} > "$OUT/indexer.log" 2>&1; tail -4 "$OUT/indexer.log"
  ;;
atomics)
  # the sparse backward's dKV atomics alone, its other work alone, and the two side by side (bench/sparse_atomics.py)
  timeout $(left 240) python bench/sparse_atomics.py --out "$OUT" > "$OUT/sparse_atomics.log" 2>&1; tail -4 "$OUT/sparse_atomics.log"
  ;;
kda)
  timeout $(left) python bench/kda.py --out "$OUT" > "$OUT/kda.log" 2>&1; tail -5 "$OUT/kda.log"
  ;;
mhc)
  # the mHC connection (torch vs liger), then its coefficient projection (liger's kernels vs ours): one mhc.json
  timeout $(left) python bench/mhc.py --out "$OUT" > "$OUT/mhc.log" 2>&1
  timeout $(left) python bench/mhc.py --out "$OUT" --project >> "$OUT/mhc.log" 2>&1; tail -5 "$OUT/mhc.log"
  ;;
mhc_enter)
  # the fused entering connection against the separate Functions at 128k (bench/mhc.py --impls)
  timeout $(left 240) python bench/mhc.py --out "$OUT" --tokens 131072 --impls liger,liger_separate > "$OUT/mhc_enter.log" 2>&1
  tail -5 "$OUT/mhc_enter.log"
  ;;
router)
  # the MoE router's logits: the fp32 twin against the split-weight bf16 matmuls (bench/router.py)
  timeout $(left 120) python bench/router.py --out "$OUT" > "$OUT/router.log" 2>&1; tail -3 "$OUT/router.log"
  ;;
fused_loss)
  timeout $(left) python bench/fused_loss.py --out "$OUT" --modes amp > "$OUT/fused_loss.log" 2>&1; tail -5 "$OUT/fused_loss.log"
  ;;
hostbuf)
  # host buffers for offload: torch's pinned allocator vs exact-size registered vs pageable
  timeout $(left 120) python bench/host_buffers.py --out "$OUT" > "$OUT/host_buffers.log" 2>&1; tail -7 "$OUT/host_buffers.log"
  ;;
fp32_parity)
  # longctx's plain-torch path against transformers' glm5_next, both in fp32 (FP32_ARGS for bench/fp32_parity.py)
  timeout $(left) python bench/fp32_parity.py --out "$OUT" ${FP32_ARGS:-} > "$OUT/fp32_parity.log" 2>&1; tail -8 "$OUT/fp32_parity.log"
  ;;
memory)
  # warm-up at 8k (compiles, optimizer state), one 1M step, a profiled 128k step, then the ablation (each
  # switch off in turn) at 8k, 32k, 128k while time is left
  timeout $(left 440) python bench/memory.py --out "$OUT" --parts runs --configs all_on --seqlens 1048576 \
      --profile 131072 > "$OUT/memory_1m.log" 2>&1; tail -6 "$OUT/memory_1m.log"
  timeout $(left) python bench/memory.py --out "$OUT" --parts runs --resume --reps 1 \
      --seqlens 8192,32768,131072 > "$OUT/memory_ablation.log" 2>&1; tail -30 "$OUT/memory_ablation.log"
  ;;
step1m)
  # warm-up at 8k, the 1M step (a line per chunk, with the peak so far), the baseline's longest context,
  # host memory over 20 steps at 64k (STEP1M_PARTS, STEP1M_CONFIGS, STEP1M_ARGS for more memory.py options,
  # e.g. "--long-reps 2" to time a warm second step)
  timeout $(left) python bench/memory.py --out "$OUT" --parts ${STEP1M_PARTS:-runs,baseline,host} ${STEP1M_ARGS:-} \
      --configs ${STEP1M_CONFIGS:-all_on} --seqlens 1048576 --host-seqlen 65536 > "$OUT/memory_1m.log" 2>&1
  tail -40 "$OUT/memory_1m.log"
  ;;
offload)
  # offload's cost at 256k: no offload, pinned kept by the offloader (the default), pinned handed back
  # every step, pageable (the modes that matter first: a cold machine may get through one or two)
  timeout $(left ${OFFLOAD_S:-240}) python bench/memory.py --out "$OUT" --parts offload --seqlens 262144 --offload-seqlen 262144 \
      --offload-modes ${OFFLOAD_MODES:-no_offload,pinned_kept,pinned,pageable} \
      > "$OUT/memory_offload.log" 2>&1; tail -8 "$OUT/memory_offload.log"
  ;;
rl)
  # RL steps of h200-ref on 128k-token trajectories: the time split and the rollout-vs-trainer gap, bf16 and fp32
  # (RL_S seconds at most, RL_ARGS for bench/rl_step.py)
  timeout $(left ${RL_S:-600}) python bench/rl_step.py --out "$OUT/rl" ${RL_ARGS:-} > "$OUT/rl_step.log" 2>&1; tail -12 "$OUT/rl_step.log"
  rm -rf "$OUT/rl/run"  # the run folder (checkpoint, plots): the device tool returns at most 8 files
  ;;
installed)
  # installed DSA kernels (FlashMLA's sparse prefill as sgl-flash-mla packages it, cuDNN frontend's if importable)
  # beside ours at our shapes (INSTALLED_ARGS, default --quick); needs .whl/ with sgl_flash_mla in the carry
  timeout $(left) python bench/installed_kernels.py --out "$OUT" ${INSTALLED_ARGS---quick} > "$OUT/installed_kernels.log" 2>&1
  tail -12 "$OUT/installed_kernels.log"
  ;;
profile)
  # one warm all-on step under torch.profiler at PROFILE_S (128k) tokens, kernels by GPU time, copies and
  # elementwise ops by the line that asked for them
  timeout $(left) python bench/memory.py --out "$OUT/profile" --parts none --profile ${PROFILE_S:-131072} --profile-stacks \
      > "$OUT/memory_profile.log" 2>&1; tail -4 "$OUT/memory_profile.log"
  rm -f "$OUT/profile/memory.png"
  ;;
peak)
  # each phase's own peak beside the estimate's, and between which marks the step's peak falls, for each
  # S[:CONFIG] of PEAKS; a 1M step runs cold (--peak-cold); PEAK_ARGS=--peak-trace adds the allocator's
  # history (what is alive at the peak, by allocating line)
  for pk in ${PEAKS:-262144:offload_all 262144}; do
    cold=; [ "${pk%%:*}" -ge 1048576 ] && cold=--peak-cold
    timeout $(left) python bench/memory.py --out "$OUT/peak" --resume --parts none $cold ${PEAK_ARGS:-} --peak $pk >> "$OUT/memory_peak.log" 2>&1
    tail -3 "$OUT/memory_peak.log"
  done
  rm -f "$OUT/peak/memory.png"  # the device tool returns at most 8 files
  ;;
host)
  # host memory over 20 offloaded steps at 64k (the offloader's kept buffers must not grow)
  timeout $(left 240) python bench/memory.py --out "$OUT" --parts host --host-seqlen 65536 > "$OUT/memory_host.log" 2>&1
  tail -3 "$OUT/memory_host.log"
  ;;
trees)
  # the all-on 128k step of this tree and of another commit's (its longctx/ and bench/ under bench/out/base,
  # `git archive COMMIT longctx bench | tar x -C bench/out/base`, named in the call's carry), base first,
  # TREES_ROUNDS times in turn (default 2): before and after on one machine
  for r in $(seq ${TREES_ROUNDS:-2}); do
    for t in base cur; do
      s=bench/memory.py; [ $t = base ] && s=bench/out/base/bench/memory.py
      echo "$(date +%T) tree $t round $r"
      timeout $(left) python $s --out "$OUT/tree_${t}_$r" --parts runs --configs all_on --seqlens ${TREES_SEQLENS:-131072} \
          > "$OUT/memory_tree_${t}_$r.log" 2>&1; tail -2 "$OUT/memory_tree_${t}_$r.log"
      rm -f "$OUT/tree_${t}_$r/memory.png"
    done
  done
  ;;
switches)
  # the 128k and 256k steps with each switch off (SWITCH_SEQLENS, SWITCH_CONFIGS; SWITCH_ARGS for more
  # memory.py options, last on the line, e.g. "--plan seq_chunk=off offload=10 --long-reps 2")
  timeout $(left) python bench/memory.py --out "$OUT" --resume --parts runs --seqlens ${SWITCH_SEQLENS:-131072,262144} \
      --configs ${SWITCH_CONFIGS:-all_on,mhc_chunk_off,chunked_indexer_off,reuse_selection_off,router_release_off,mhc_cast_recompute_off,moe_bf16_combine_off,loss_chunk_off} \
      ${SWITCH_ARGS:-} > "$OUT/memory_extras.log" 2>&1; tail -16 "$OUT/memory_extras.log"
  ;;
sft)
  # the small model's SFT on the embedded retrieval task (bench/sft_retrieval.py; SFT_ARGS: its options, e.g.
  # --set stages=[...]); SIGTERM at the part's limit makes the trainer save a checkpoint before it stops
  timeout -s TERM $(left) python bench/sft_retrieval.py --out "$OUT/sft" --json "$OUT/sft_retrieval.json" ${SFT_ARGS:-} \
      > "$OUT/sft_retrieval.log" 2>&1; grep -v "^ " "$OUT/sft_retrieval.log" | grep -v "^step" | tail -12; grep "^step" "$OUT/sft_retrieval.log" | tail -4
  rm -rf "$OUT"/sft/ckpt-* "$OUT"/sft/tb  # the device tool returns at most 8 files: the JSON, log, metrics and plots
  ;;
variants)
  # 128k steps with other implementations beside the defaults in one call: VARIANTS, ';'-separated
  # memory.py options ("all_on" for none), e.g. "all_on;--kernel mhc=torch;--kernel rms_norm=torch --kernel swiglu=torch"
  IFS=';' read -ra vs <<< "${VARIANTS:-all_on}"
  for v in "${vs[@]}"; do
    d=$(echo $v | tr -d ' -' | tr '_=' '--'); o=$v; [ "$v" = all_on ] && o=
    echo "$(date +%T) variant $v"
    timeout $(left) python bench/memory.py --out "$OUT/$d" $o --parts runs --configs all_on --seqlens 131072 \
        > "$OUT/memory_$d.log" 2>&1; tail -2 "$OUT/memory_$d.log"
    rm -f "$OUT/$d/memory.png"  # the device tool returns at most 8 files: keep the JSON
  done
  ;;
*) echo "usage: dev/run_h200.sh PART... with PART in tests e2e sparse atomics indexer kda mhc fused_loss hostbuf fp32_parity memory step1m offload rl profile peak host switches variants trees sft kernels extras"; exit 2 ;;
esac
done
