#!/usr/bin/env bash
# v37's GPU call when one call must hold it all (issues 41 and 37), on the candidate build
# staged in .dev/gpu (git am research/patches/v37-*.patch && bash scripts/gpu-build.sh) and the
# lab-v32 CLI in .dev/gpu-old/dsv4-lab: racecheck + synccheck over the shared attention cases, one
# round of `dsv4 bench all --no-sweep` of lab-v32 and of the candidate, then
# scripts/gpu-test.sh (every test executable, the sanitizers, `dsv4 check`) with the time
# left (it runs racecheck again: the first one gives the verdict even if it runs out of time),
# and a second bench round if time remains.
#   run: bash research/round37_one.sh   carry: .dev/gpu .dev/gpu-old
set -uo pipefail
out=${OUT:-.dev/out}; mkdir -p "$out"
export DSV4_CACHE_DIR=/tmp/dsv4-cache
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
t0=$SECONDS
san=/usr/local/cuda/bin/compute-sanitizer
(export DSV4_SHARED_DIR=$PWD/.dev/gpu
 timeout 200 $san --tool racecheck --error-exitcode 1 --print-limit 20 .dev/gpu/tests/gpu_cases --include-ignored --test-threads=1 small_sparse_attention_cases > "$out/racecheck_new.txt" 2>&1
 echo "racecheck rc=$? ($((SECONDS - t0)) s)"; grep -E "Race reported|RACECHECK SUMMARY|test result" "$out/racecheck_new.txt" | head -12)
bench() {
  local v=$1 r=$2 bin=.dev/gpu/dsv4
  [ "$v" = lab ] && bin=.dev/gpu-old/dsv4-lab
  timeout $((590 - (SECONDS - t0))) $bin bench all --no-sweep --iters 20 --cooldown-ms 200 > "$out/bench_${v}_$r.txt" 2>&1
  echo "--- bench $v round $r rc=$? ($((SECONDS - t0)) s)"
}
bench lab 1; bench candidate 1
timeout $((585 - (SECONDS - t0))) bash scripts/gpu-test.sh > /dev/null 2>&1; echo "gpu-test rc=$? ($((SECONDS - t0)) s)"
grep -E "^=== .*(ok|FAILED)|ERROR SUMMARY: [1-9]|RACECHECK SUMMARY|checks:|gpu-test:|panicked" "$out/gpu-test.log" | head -40
if [ $((SECONDS - t0)) -lt 440 ]; then bench candidate 2; fi
if [ $((SECONDS - t0)) -lt 520 ]; then bench lab 2; fi
