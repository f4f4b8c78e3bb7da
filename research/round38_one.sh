#!/usr/bin/env bash
# The GPU call for v37's candidates (issues 41, 37, 38), bounded to LIMIT seconds (default 430;
# 590 for a whole call), on the candidate build staged in .dev/gpu (git am
# research/patches/v37-*.patch && bash scripts/gpu-build.sh), lab-v32's CLI in
# .dev/gpu-old/dsv4-lab and the candidate's wheel in .whl. In the order the verdicts need:
# racecheck over the shared attention cases (2/5 of LIMIT at most), the attention's Rust GPU
# tests, one round of `dsv4 bench sparse-attention --no-sweep` of lab-v32 and of the
# candidate (BENCH_ARGS=--fwd-only: the forward rows alone), the host-time breakdown through
# torch, test_gpu_indices.py and test_gpu_graphs.py, then the other sanitizers and `dsv4
# check` (scripts/gpu-test.sh without the plain test runs) with what is left.
#   run: LIMIT=430 bash research/round38_one.sh   carry: .dev/gpu .dev/gpu-old .whl
set -uo pipefail
out=${OUT:-.dev/out}; mkdir -p "$out"
limit=${LIMIT:-430}
export DSV4_CACHE_DIR=/tmp/dsv4-cache DSV4_GOLDEN_DIR=$PWD/.dev/gpu/golden
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
t0=$SECONDS
left() { echo $((limit - (SECONDS - t0) - ${1:-0})); }
san=/usr/local/cuda/bin/compute-sanitizer
(export DSV4_SHARED_DIR=$PWD/.dev/gpu
 timeout $((limit * 2 / 5)) $san --tool racecheck --error-exitcode 1 --print-limit 20 .dev/gpu/tests/gpu_cases --include-ignored --test-threads=1 small_sparse_attention_cases > "$out/racecheck.txt" 2>&1
 echo "racecheck rc=$? ($((SECONDS - t0)) s)"; grep -E "Race reported|RACECHECK SUMMARY|test result" "$out/racecheck.txt" | head -12
 for t in gpu_sparse_attention gpu_cases; do
   l=$(left 150); [ "$l" -gt 60 ] && l=60; [ "$l" -gt 10 ] || break
   timeout "$l" .dev/gpu/tests/$t --include-ignored --test-threads=1 > "$out/test_$t.txt" 2>&1
   echo "test $t rc=$? ($((SECONDS - t0)) s): $(grep -E '^test result' "$out/test_$t.txt")"; grep -E "FAILED|panicked" "$out/test_$t.txt" | head -5
 done)
bench() {
  local v=$1 bin=.dev/gpu/dsv4
  [ "$v" = lab ] && bin=.dev/gpu-old/dsv4-lab
  local l=$(left 40); [ "$l" -gt 75 ] && l=75; [ "$l" -gt 15 ] || return
  timeout "$l" $bin bench sparse-attention --no-sweep ${BENCH_ARGS:-} --iters 20 --cooldown-ms 200 > "$out/bench_$v.txt" 2>&1
  echo "--- bench $v rc=$? ($((SECONDS - t0)) s)"; grep -E "sparse_attention" "$out/bench_$v.txt" | cut -c1-120
}
bench lab; bench candidate
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$out/pip.txt" 2>&1 || cat "$out/pip.txt"
export PYTHONPATH=/tmp/site:python/tests DSV4_SHARED_DIR=$PWD/.dev/gpu PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
[ "$(left 50)" -gt 0 ] && { timeout 50 python3 research/host_profile.py --s 4096 > "$out/host_profile.txt" 2>&1; head -14 "$out/host_profile.txt"; echo "host profile done ($((SECONDS - t0)) s)"; }
for f in test_gpu_indices test_gpu_graphs; do
  l=$(left 5); [ "$l" -gt 20 ] || break
  timeout "$l" python3 -m pytest -q -rs python/tests/$f.py -p no:cacheprovider > "$out/pytest_$f.txt" 2>&1
  echo "pytest $f ($((SECONDS - t0)) s): $(tail -1 "$out/pytest_$f.txt")"; grep -E "^FAILED|^E " "$out/pytest_$f.txt" | cut -c1-200 | head -8
done
l=$(left 5)
if [ "$l" -gt 60 ]; then
  DSV4_GPU_TESTS=0 timeout "$l" bash scripts/gpu-test.sh > /dev/null 2>&1; echo "sanitizers + check rc=$? ($((SECONDS - t0)) s)"
  grep -E "^=== .*(ok|FAILED)|ERROR SUMMARY: [1-9]|checks:|gpu-test:" "$out/gpu-test.log" | head -20
fi
echo "done ($((SECONDS - t0)) s)"
