#!/usr/bin/env bash
# v32 call 1: the full sanitizer pass, one small_* test at a time under memcheck (a deadline
# keeps the call inside its limit; SKIP_DONE lists the ones a previous call finished), then
# racecheck / synccheck, dsv4 check and the indexer bench. Ran as `BUDGET=550 bash
# .dev/gpu/call1.sh` after scripts/gpu-build.sh, carrying .dev/gpu (the prelude's lines were
# inline then).
set -uo pipefail
source scripts/gpu-variant-env.sh
dir=.dev/gpu
export DSV4_CACHE_DIR=/tmp/kc-default
san=/usr/local/cuda/bin/compute-sanitizer
deadline=$((SECONDS + ${BUDGET:-540}))
left(){ echo $((deadline - SECONDS)); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
"$san" --version | tail -1
echo "== warm the kernel cache: dsv4 check --backend cuda"
t0=$SECONDS; $dir/dsv4 check --backend cuda 2>&1 | tail -4; echo "check rc ${PIPESTATUS[0]} ($((SECONDS-t0)) s)"
fails=()
for bin in ${BINS:-gpu_indexer gpu_sparse_attention gpu_small_ops gpu_golden}; do
  for t in $($dir/tests/$bin --list --include-ignored 2>/dev/null | sed -n 's/^\(small_[a-z0-9_]*\): test$/\1/p'); do
    case " ${SKIP_DONE:-} " in *" $bin:$t "*) continue;; esac
    l=$(left); if [ "$l" -lt 40 ]; then echo "DEADLINE: not run memcheck $bin:$t"; continue; fi
    t0=$SECONDS
    timeout $((l-20)) "$san" --tool memcheck --error-exitcode 1 --print-limit 20 $dir/tests/$bin --include-ignored --test-threads=1 --exact "$t" > /tmp/mc.log 2>&1; rc=$?
    summary=$(grep -E "ERROR SUMMARY|test result" /tmp/mc.log | tr '\n' ' ')
    echo "memcheck $bin:$t rc=$rc $((SECONDS-t0)) s :: $summary"
    [ $rc = 0 ] || { fails+=("memcheck $bin:$t"); grep -E "Invalid|at 0x|by thread|Address|failed|panicked" /tmp/mc.log | head -30; }
  done
done
if [ "${EXTRA:-1}" = 1 ]; then
  for spec in "racecheck gpu_sparse_attention small_forward_backward_match_reference" "synccheck gpu_sparse_attention small_forward_backward_match_reference" "synccheck gpu_sparse_attention small_hopper_" "synccheck gpu_indexer small_hopper_backward" "racecheck gpu_indexer small_hopper_backward_masks_and_duplicates"; do
    set -- $spec; l=$(left); if [ "$l" -lt 40 ]; then echo "DEADLINE: not run $spec"; continue; fi
    t0=$SECONDS
    timeout $((l-20)) "$san" --tool $1 --error-exitcode 1 --print-limit 20 $dir/tests/$2 --include-ignored --test-threads=1 $3 > /tmp/sc.log 2>&1; rc=$?
    echo "$spec rc=$rc $((SECONDS-t0)) s :: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result" /tmp/sc.log | tr '\n' ' ')"
    [ $rc = 0 ] || { fails+=("$spec"); grep -E "hazard|Error|at 0x|panicked" /tmp/sc.log | sort | uniq -c | sort -rn | head -20; }
  done
fi
if [ "${BENCH:-1}" = 1 ] && [ "$(left)" -gt 60 ]; then
  echo "== dsv4 bench indexer --iters 20"; $dir/dsv4 bench indexer --iters 20 2>&1 | grep -v '^\s*$'
fi
echo "failures: ${#fails[@]}"; printf '  %s\n' "${fails[@]}"
echo "left at end: $(left) s"
