#!/usr/bin/env bash
# v32 call 2: `dsv4 bench` of the attention (no sweep), Sinkhorn and qnorm_rope for the closing
# notes (full output, nothing cut), then every GPU test executable (plain runs). Ran as
# `BUDGET=560 bash .dev/gpu/call2.sh` after scripts/gpu-build.sh, carrying .dev/gpu (the
# prelude's lines were inline then).
set -uo pipefail
source scripts/gpu-variant-env.sh
dir=.dev/gpu
export DSV4_CACHE_DIR=/tmp/kc-default
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
