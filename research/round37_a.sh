#!/usr/bin/env bash
# v37's first GPU call (not run: no device was lent in that session). Staged here first:
#   git checkout race-parity && bash scripts/gpu-build.sh     (.dev/gpu: the forward's pair
#       maxima by iteration parity, the candidate fix of racecheck's report, issue 41)
#   .dev/gpu-old/dsv4-lab: the CLI of tag lab-v32 (git worktree + cargo build --release -p dsv4-cli)
# On the GPU: racecheck over the shared attention cases, then `dsv4 bench all --no-sweep` of
# lab-v32 and of the candidate in alternating rounds (issue 37: speed unchanged, +-3 %).
#   run: bash research/round37_a.sh   carry: .dev/gpu .dev/gpu-old
set -uo pipefail
out=${OUT:-.dev/out}; mkdir -p "$out"
export DSV4_SHARED_DIR=$PWD/.dev/gpu DSV4_CACHE_DIR=/tmp/dsv4-cache
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
t0=$SECONDS
san=/usr/local/cuda/bin/compute-sanitizer
timeout 200 $san --tool racecheck --error-exitcode 1 --print-limit 20 .dev/gpu/tests/gpu_cases --include-ignored --test-threads=1 small_sparse_attention_cases > "$out/racecheck_new.txt" 2>&1
echo "racecheck rc=$? ($((SECONDS - t0)) s)"; grep -E "Race reported|RACECHECK SUMMARY|test result" "$out/racecheck_new.txt" | head -12
timeout 120 $san --tool synccheck --error-exitcode 1 --print-limit 20 .dev/gpu/tests/gpu_sparse_attention --include-ignored --test-threads=1 small_hopper_ > "$out/synccheck_new.txt" 2>&1
echo "synccheck hopper rc=$? ($((SECONDS - t0)) s)"; grep -E "SYNCCHECK SUMMARY|ERROR SUMMARY|test result" "$out/synccheck_new.txt" | head -4
for r in 1 2; do
  for v in lab candidate; do
    bin=.dev/gpu/dsv4; [ $v = lab ] && bin=.dev/gpu-old/dsv4-lab
    [ $((SECONDS - t0)) -gt 470 ] && break 2
    timeout $((580 - (SECONDS - t0))) $bin bench all --no-sweep --iters 20 --cooldown-ms 200 > "$out/bench_${v}_$r.txt" 2>&1
    echo "--- bench $v round $r rc=$? ($((SECONDS - t0)) s)"
  done
done
