#!/usr/bin/env bash
# Nsight Compute profile of one kernel, run on the GPU machine (carry `.dev/gpu`, staged by
# scripts/gpu-build.sh):
#   bash scripts/gpu-profile.sh <kernel name regex> "<dsv4 bench args>" [DSV4_EXTRA_DEFINES value]
# e.g.
#   bash scripts/gpu-profile.sh sparse_attn_fwd_sm90 "sparse-attention --fwd-only --iters 1"
#   bash scripts/gpu-profile.sh sparse_attn_bwd_sm90 "sparse-attention --iters 1"
# profiles the first launch of the kernel (--set full, source counters) and writes under
# $OUT (default .dev/out): <name>.ncu-rep, <name>-details.txt (every section) and
# <name>-source.csv (per-SASS-instruction metrics, warp stall samples included); prints
# the headline numbers and the 30 instructions with the most stall samples.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n 2,11p "$0"; exit 2; }
kernel=$1 bench=$2
out=${OUT:-.dev/out}
mkdir -p "$out"
name=$(echo "$kernel" | tr -c 'A-Za-z0-9_\n' '_')
ncu=${NCU:-/usr/local/cuda/bin/ncu}
export DSV4_GOLDEN_DIR=$PWD/.dev/gpu/golden DSV4_SHARED_DIR=$PWD/.dev/gpu/no-shared
export DSV4_CACHE_DIR=$PWD/.dev/gpu/kernel-cache-profile DSV4_EXTRA_DEFINES=${3:-}
# shellcheck disable=SC2086
timeout 420 "$ncu" --set full --import-source yes -k "regex:$kernel" -c 1 -f -o "$out/$name" \
  .dev/gpu/dsv4 bench $bench > "$out/$name-ncu.log" 2>&1 || { echo "ncu failed:"; tail -20 "$out/$name-ncu.log"; exit 1; }
"$ncu" -i "$out/$name.ncu-rep" --page details > "$out/$name-details.txt" 2>&1
"$ncu" -i "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/$name-source.csv" 2>&1
grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|L1/TEX Cache Throughput|Executed Ipc Active|Registers Per Thread|Achieved Occupancy|Issue Slots Busy|No Eligible|One or More Eligible" "$out/$name-details.txt" | head -20
python3 - "$out/$name-source.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
head = next((i for i, r in enumerate(rows) if any("Source" == c or "Address" in c for c in r)), None)
if head is None:
    print("no per-instruction table in the source page; first lines:")
    print("\n".join(",".join(r)[:160] for r in rows[:8]))
    sys.exit(0)
cols = rows[head]
def col(*keys):
    for k in keys:
        for i, c in enumerate(cols):
            if k.lower() in c.lower():
                return i
    return None
src = col("Source")
samp = col("Warp Stall Sampling (All", "stall_sampling", "Sampling (All")
if samp is None:
    print("columns:", cols)
    sys.exit(0)
def num(v):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0
body = [r for r in rows[head + 1:] if len(r) == len(cols)]
total = sum(num(r[samp]) for r in body) or 1.0
print(f"{len(body)} SASS instructions, {total:.0f} stall samples; the 30 with most:")
for r in sorted(body, key=lambda r: -num(r[samp]))[:30]:
    print(f"{100 * num(r[samp]) / total:6.2f} %  {r[src][:110]}")
PY
