#!/usr/bin/env bash
# v31 call 2: main with the column-halves ring by default: every GPU test, racecheck on the
# Hopper backward, golden, check, `dsv4 bench` of every operation; then consumer 0's dKV
# chunk count (atomic / deterministic) and the atomic kv evict_last policy re-swept over the halves ring.
set -uo pipefail
cd "$(dirname "$0")/../.."  # run as .dev/gpu/call2.sh (copied there after scripts/gpu-build.sh)
source scripts/gpu-variant-env.sh  # $out, the log, the golden files, run()
N=.dev/gpu/dsv4; S=/usr/local/cuda/bin/compute-sanitizer
t0=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
for t in gpu_sparse_attention gpu_golden gpu_indexer gpu_small_ops dsv4_cuda params_layout; do
  run "DSV4_MBAR_TIMEOUT_POLLS=10000000" timeout 150 .dev/gpu/tests/$t --include-ignored --test-threads=1 2>&1 | grep -E "test result|panicked|FAILED|failed" | sed "s/^/$t: /" | head -5
done
run "" timeout 60 $N check 2>&1 | tail -1
echo "tests took $((SECONDS - t0)) s"
run "" timeout 120 $S --tool racecheck --error-exitcode 1 --print-limit 10 .dev/gpu/tests/gpu_sparse_attention --include-ignored --test-threads=1 small_hopper_backward 2>&1 | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result|panicked" | sed 's/^/racecheck: /'
echo "t=$((SECONDS - t0))"
run "" $N bench sparse-attention --no-sweep --iters 20 2>&1 | grep -E "^sparse_attention"
for op in indexer sinkhorn qnorm-rope; do run "" $N bench $op --iters 20 2>&1 | grep -vE "^\s*$|^#" | tail -8; done
echo "t=$((SECONDS - t0))"
B="bench sparse-attention --no-sweep --iters 20 --bwd-only"
for r in 1 2; do
  for c in 2 1 3; do run "SA90_BWD_C0_CHUNKS=$c" $N $B --atomic-only --s 16384 2>&1 | grep "bwd atomic" | sed "s/^/r$r atomic c0=$c /"; done
  run "SA90_BWD_KV_EVICT_LAST=1" $N $B --atomic-only --s 16384 2>&1 | grep "bwd atomic" | sed "s/^/r$r atomic evict_last /"
  echo "t=$((SECONDS - t0))"
done
for r in 1 2; do
  for c in 2 1 3; do run "SA90_BWD_DET_C0_CHUNKS=$c" $N $B --s 16384 2>&1 | grep "bwd deterministic" | sed "s/^/r$r det c0=$c /"; done
  echo "t=$((SECONDS - t0))"
done
for c in 2 1 3; do run "SA90_BWD_C0_CHUNKS=$c,SA90_BWD_DET_C0_CHUNKS=$c" $N $B --s 4096 2>&1 | grep "sparse_attention bwd" | sed "s/^/S4096 c0=$c /"; done
echo "total $((SECONDS - t0)) s"
