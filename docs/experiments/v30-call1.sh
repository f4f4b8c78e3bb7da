#!/usr/bin/env bash
# v30 call 1: the backward's ring in column halves (SA90_BWD_COL_HALVES) and the atomic rows in G regions (SA90_BWD_ROW_GROUPS): tests, then timings.
set -uo pipefail
cd "$(dirname "$0")/../.."  # run as .dev/gpu/call1.sh (copied there after scripts/gpu-build.sh)
source scripts/gpu-variant-env.sh  # $out, the log, the golden files, run()
T=.dev/gpu/tests/gpu_sparse_attention; N=.dev/gpu/dsv4
t0=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
run "SA90_BWD_COL_HALVES=1,DSV4_MBAR_TIMEOUT_POLLS=10000000" timeout 100 $T --include-ignored --test-threads=1 small_hopper_backward_d512 deepseek_v4_shape small_deterministic_backward 2>&1 | grep -E "^test |test result|panicked" | head
run "SA90_BWD_ROW_GROUPS=16,DSV4_MBAR_TIMEOUT_POLLS=10000000" timeout 60 $T --include-ignored --test-threads=1 deepseek_v4_shape 2>&1 | grep -E "^test |test result|panicked" | head
echo "tests took $((SECONDS - t0)) s"
B="bench sparse-attention --no-sweep --iters 20 --bwd-only"
for r in 1 2 3; do
  run "" $N $B --s 16384 2>&1 | grep "sparse_attention bwd" | sed "s/^/r$r main   /"
  run "SA90_BWD_COL_HALVES=1" $N $B --s 16384 2>&1 | grep "sparse_attention bwd" | sed "s/^/r$r halves /"
  echo "t=$((SECONDS - t0))"
done
for g in 4 16; do
  run "SA90_BWD_ROW_GROUPS=$g" $N $B --atomic-only --s 16384 2>&1 | grep "sparse_attention bwd atomic" | sed "s/^/G=$g /"
done
run "SA90_BWD_ROW_GROUPS=4,SA90_BWD_COL_HALVES=1" $N $B --atomic-only --s 16384 2>&1 | grep "sparse_attention bwd atomic" | sed "s/^/G=4 halves /"
echo "t=$((SECONDS - t0))"
for r in 1 2; do
  run "" $N $B --s 4096 2>&1 | grep "sparse_attention bwd" | sed "s/^/S4096 r$r main   /"
  run "SA90_BWD_COL_HALVES=1" $N $B --s 4096 2>&1 | grep "sparse_attention bwd" | sed "s/^/S4096 r$r halves /"
done
echo "t=$((SECONDS - t0))"
S=/usr/local/cuda/bin/compute-sanitizer
run "" timeout 60 .dev/gpu/tests/gpu_golden --include-ignored --test-threads=1 2>&1 | grep -E "test result|panicked" | head -3
run "" timeout 40 $N check 2>&1 | tail -1
[ $((SECONDS - t0)) -lt 420 ] && run "" timeout 100 $S --tool synccheck --error-exitcode 1 --print-limit 10 $T --include-ignored --test-threads=1 small_hopper_ 2>&1 | grep -E "ERROR SUMMARY|test result|panicked" | sed 's/^/synccheck main: /'
[ $((SECONDS - t0)) -lt 480 ] && run "SA90_BWD_COL_HALVES=1" timeout 60 $S --tool synccheck --error-exitcode 1 --print-limit 10 $T --include-ignored --test-threads=1 small_hopper_backward 2>&1 | grep -E "ERROR SUMMARY|test result|panicked" | sed 's/^/synccheck halves: /'
[ $((SECONDS - t0)) -lt 500 ] && run "" timeout 70 $S --tool memcheck --error-exitcode 1 --print-limit 10 $T --include-ignored --test-threads=1 small_hopper_backward small_hopper_forward_d512 2>&1 | grep -E "ERROR SUMMARY|test result|panicked" | sed 's/^/memcheck main: /'
echo "total $((SECONDS - t0)) s"
