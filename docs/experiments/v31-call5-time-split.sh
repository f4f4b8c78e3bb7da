#!/usr/bin/env bash
# v31 call 5: where the atomic backward's time goes with the halves ring (v26's split again):
# DIAG 4 (flush memory off at run time), 7 (no flush), 8 (plain stores), 2 (no products), 1 (no copies).
set -uo pipefail
cd "$(dirname "$0")/../.."  # run as .dev/gpu/callN.sh (copied there after scripts/gpu-build.sh)
source scripts/gpu-variant-env.sh
N=.dev/gpu/dsv4; B="bench sparse-attention --no-sweep --iters 20 --bwd-only --atomic-only"
t0=$SECONDS
for r in 1 2; do
  for d in 0 4 7 8; do run "DSV4_SA90_BWD_DIAG=$d" timeout 40 $N $B --s 16384 2>&1 | grep "bwd atomic" | sed "s/^/r$r diag=$d /"; done
  echo "t=$((SECONDS - t0))"
done
for d in 2 1; do run "DSV4_SA90_BWD_DIAG=$d" timeout 40 $N $B --s 16384 2>&1 | grep "bwd atomic" | sed "s/^/diag=$d /"; done
for d in 0 4 7; do run "DSV4_SA90_BWD_DIAG=$d" timeout 30 $N $B --s 4096 2>&1 | grep "bwd atomic" | sed "s/^/S4096 diag=$d /"; done
echo "total $((SECONDS - t0)) s"
