#!/usr/bin/env bash
# v31 call 3: racecheck's hazards on the Hopper backward, in full, with the column-halves ring (default) and the blocks ring.
set -uo pipefail
cd "$(dirname "$0")/../.."  # run as .dev/gpu/callN.sh (copied there after scripts/gpu-build.sh)
source scripts/gpu-variant-env.sh
S=/usr/local/cuda/bin/compute-sanitizer; T=.dev/gpu/tests/gpu_sparse_attention
t0=$SECONDS
for v in "SA90_BWD_COL_HALVES=1" "SA90_BWD_COL_HALVES=0"; do
  f=$out/race-$(echo $v | tr '=' '_').txt
  run "$v" timeout 150 $S --tool racecheck --racecheck-report analysis --print-limit 200 $T --include-ignored --test-threads=1 small_hopper_backward > $f 2>&1
  echo "== $v: rc=$? t=$((SECONDS - t0))"; grep -E "SUMMARY|test result" $f
  grep -E "^========= +(Error|Warning|Race)|at .*\.cu(h)?:[0-9]+|Write Thread|Read Thread|Current Value" $f | sed -E 's/ +/ /g' | sort | uniq -c | sort -rn | head -40
  cp -r $DSV4_CACHE_DIR $out/cache-$(echo $v | tr '=' '_') 2>/dev/null
done
run "SA90_BWD_COL_HALVES=1" timeout 150 $S --tool racecheck --print-limit 200 $T --include-ignored --test-threads=1 small_hopper_forward_d512 > $out/race-fwd.txt 2>&1; grep -E "SUMMARY|test result" $out/race-fwd.txt
echo "total $((SECONDS - t0)) s"
