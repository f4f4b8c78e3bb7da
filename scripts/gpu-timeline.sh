#!/usr/bin/env bash
# Every kernel launch of one `dsv4 bench` command, in order, with its duration (ncu
# gpu__time_duration at ncu's locked clocks, ~1.3x the bench's times for compute-bound
# kernels) and DRAM bytes read / written; run on the GPU machine (carry `.dev/gpu`, staged
# by scripts/gpu-build.sh):
#   bash scripts/gpu-timeline.sh "<dsv4 bench args>" [kernel name regex] [DSV4_EXTRA_DEFINES value]
# e.g. where the deterministic backward's time goes beside the atomic one's:
#   bash scripts/gpu-timeline.sh "sparse-attention --no-sweep --bwd-only --s 4096 --iters 1 --cooldown-ms 0" \
#     "sparse_attn_bwd_sm90|inv_|f32_to_bf16|dsinks"
# The bench's warm-up launches are listed too (3 before each timed row): read the last ones.
# TIMELINE_RAW=<file> keeps ncu's csv; NCU_EXTRA adds ncu options (e.g. "--clock-control none
# --cache-control none": the card's own clocks, caches not flushed between kernels).
# (First run on the H200 in v26: docs/perf/LOG.md v26, calls 1-2.)
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n 2,10p "$0"; exit 2; }
bench=$1 kernel=${2:-.}
ncu=${NCU:-/usr/local/cuda/bin/ncu}
export DSV4_GOLDEN_DIR=$PWD/.dev/gpu/golden DSV4_SHARED_DIR=$PWD/.dev/gpu/no-shared
export DSV4_CACHE_DIR=$PWD/.dev/gpu/kernel-cache-timeline DSV4_EXTRA_DEFINES=${3:-}
# shellcheck disable=SC2086
timeout 300 "$ncu" ${NCU_EXTRA:-} --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum -k "regex:$kernel" \
  .dev/gpu/dsv4 bench $bench 2>/dev/null | tee "${TIMELINE_RAW:-/dev/null}" | python3 -c '
import csv, sys
rows = [r for r in csv.reader(l for l in sys.stdin if l.startswith("\"")) if len(r) > 14]
by = {}
for r in rows[1:]:
    key = (int(r[0]), r[4], r[7], r[8])  # launch id, kernel, block, grid
    scale = {"ns": 1.0, "nsecond": 1.0, "usecond": 1e3, "msecond": 1e6}.get(r[13], 1.0) if "duration" in r[12] else 1.0
    by.setdefault(key, {})[r[12]] = float(r[14].replace(",", "")) * scale
print("%5s  %9s  %9s  %9s  kernel grid block" % ("id", "us", "read MB", "write MB"))
for (i, name, block, grid), m in sorted(by.items()):
    us = float(m.get("gpu__time_duration.sum", 0)) / 1e3
    rd = float(m.get("dram__bytes_read.sum", 0)) / 1e6
    wr = float(m.get("dram__bytes_write.sum", 0)) / 1e6
    print(f"{i:>5}  {us:>9.1f}  {rd:>9.1f}  {wr:>9.1f}  {name} {grid} {block}")
'
