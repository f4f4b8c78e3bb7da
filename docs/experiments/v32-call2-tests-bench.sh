#!/usr/bin/env bash
# v32 call 2: every GPU test executable (plain runs) on the final main, then the benches of
# every operation for the closing notes (full output, nothing cut).
set -uo pipefail
out=${OUT:-.dev/out}; mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1
dir=.dev/gpu
export DSV4_GOLDEN_DIR=$PWD/$dir/golden DSV4_SHARED_DIR=$PWD/$dir/no-shared DSV4_CACHE_DIR=/tmp/kc-default
deadline=$((SECONDS + ${BUDGET:-560}))
left(){ echo $((deadline - SECONDS)); }
nvidia-smi --query-gpu=name,driver_version --format=csv
for b in ${BENCHES:-sparse-attention sinkhorn qnorm-rope}; do
  l=$(left); [ "$l" -gt 60 ] || { echo "DEADLINE: bench $b not run"; continue; }
  extra=""; [ $b = sparse-attention ] && extra="--no-sweep"
  echo "== dsv4 bench $b $extra --iters 20"; t0=$SECONDS
  timeout $((l-30)) $dir/dsv4 bench $b $extra --iters 20 2>&1 | grep -v '^\s*$'; echo "($((SECONDS-t0)) s)"
done
for t in $dir/tests/*; do
  n=$(basename $t); [ $n = nvrtc_compile ] && continue
  l=$(left); [ "$l" -gt 40 ] || { echo "DEADLINE: $n not run"; continue; }
  t0=$SECONDS
  timeout $((l-20)) $t --include-ignored --test-threads=1 > /tmp/t.log 2>&1; rc=$?
  echo "test $n rc=$rc $((SECONDS-t0)) s :: $(grep -E '^test result' /tmp/t.log | tr '\n' ' ')"
  [ $rc = 0 ] || grep -E "FAILED|panicked|failed" /tmp/t.log | head -20
done
echo "left at end: $(left) s"
