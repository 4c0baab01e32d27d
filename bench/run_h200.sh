#!/usr/bin/env bash
# The GPU runs behind bench/results/*.json and the GPU tests, as run on the lent H200 (one call per part).
#   bash bench/run_h200.sh kernels   # GPU tests of every fast path, then the indexer and KDA benchmarks
#   (bench/fused_loss.py --modes amp and bench/mhc.py ran the same way: bench/results/{fused_loss,mhc}.json)
#   bash bench/run_h200.sh memory    # bench/memory.py: the ablation runs 8k..1M
#   bash bench/run_h200.sh step1m    # one 1M-token step (all switches on), logged chunk by chunk
#   bash bench/run_h200.sh extras    # baseline max context, pinned vs pageable, host memory, 128k end to end
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
case "${1:-}" in
kernels)
  # every log goes to $OUT whole (a tail through the tool's 12k-character window loses the failures)
  timeout 300 python -m pytest -q -rfE --tb=short -s tests/test_gpu_sequence_chunks.py tests/test_gpu_indexer.py \
      tests/test_gpu_sparse_attention.py tests/test_gpu_fused_loss.py tests/test_gpu_mhc.py > "$OUT/gpu_tests.log" 2>&1
  grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu_tests.log" | tail -12
  timeout 150 python bench/indexer.py --out "$OUT" > "$OUT/indexer.log" 2>&1; tail -3 "$OUT/indexer.log"
  timeout 200 python bench/kda.py --out "$OUT" > "$OUT/kda.log" 2>&1; tail -3 "$OUT/kda.log"
  ;;
memory)
  # warm-up at 8k (compiles, optimizer state), one 1M step in steady state, a profiled 128k step,
  # then the ablation (each switch off in turn) at 8k, 32k, 128k while time is left
  timeout $((470 - SECONDS)) python bench/memory.py --out "$OUT" --parts runs --configs all_on --seqlens 1048576 \
      --profile 131072 > "$OUT/memory_1m.log" 2>&1; tail -6 "$OUT/memory_1m.log"
  timeout $((570 - SECONDS)) python bench/memory.py --out "$OUT" --parts runs --resume --reps 1 \
      --seqlens 8192,32768,131072 > "$OUT/memory_ablation.log" 2>&1; tail -30 "$OUT/memory_ablation.log"
  ;;
step1m)
  # warm-up at 8k (compiles, optimizer state), one 1M step in steady state (a line per chunk, with the
  # peak so far), a profiled 128k step, the baseline's longest context, host memory over 20 steps
  timeout $((575 - SECONDS)) python bench/memory.py --out "$OUT" --parts runs,baseline,host --configs all_on \
      --seqlens 1048576 --profile 131072 --host-seqlen 65536 > "$OUT/memory_1m.log" 2>&1; tail -40 "$OUT/memory_1m.log"
  ;;
extras)
  [ -f bench/results/memory.json ] && cp bench/results/memory.json "$OUT/"
  timeout 330 python bench/memory.py --out "$OUT" --resume --parts baseline,offload,host --seqlens 8192 \
      --host-seqlen 65536 --offload-seqlen 262144 2>&1 | tail -30
  timeout 200 python -m pytest -q -s tests/test_gpu_end_to_end.py 2>&1 | tail -8
  ;;
*) echo "usage: bench/run_h200.sh kernels|memory|extras"; exit 2 ;;
esac
