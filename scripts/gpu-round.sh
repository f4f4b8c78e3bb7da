#!/usr/bin/env bash
# One call on the GPU machine (run from the repository root there) that does everything
# a lease allows in one go, staged here beforehand by:
#   bash scripts/gpu-build.sh && bash scripts/py-gpu-wheel.sh
#   cp .dev/wheels/*.whl <nemo_automodel-0.7.0 wheel> .whl/     (both git-ignored)
# and carried as `.dev/gpu` and `.whl`. Steps (each logged under $OUT):
#   1. scripts/gpu-test.sh       Rust GPU tests, golden through cuda, memcheck, dsv4 check
#   2. dsv4 bench all --json     timings
#   3. pytest                    the Python package on CUDA: GPU tests, seeds parity
#                                (nemo-automodel's own torch references), torch.compile,
#                                CUDA graphs, the reproducers, the NeMo integration
#   4. python -m dsv4_kernels.bench   the torch-API timings and NeMo's layer
# Env: DSV4_SANITIZER=0 skips memcheck; DSV4_STEPS="test bench py" picks steps.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-.dev/out}
mkdir -p "$out"
steps=${DSV4_STEPS:-test bench py pybench}
status=0

if [[ " $steps " == *" test "* ]]; then
  timeout "${DSV4_TEST_TIMEOUT:-360}" bash scripts/gpu-test.sh > /dev/null 2>&1 || status=1
  grep -E "^=== |^test result|golden:|FAIL|panicked|checks:|gpu-test:" "$out/gpu-test.log" | grep -v "^=== .*: \.dev" | head -60
fi
if [[ " $steps " == *" bench "* ]]; then
  timeout "${DSV4_BENCH_TIMEOUT:-200}" .dev/gpu/dsv4 bench all --iters 20 > "$out/bench.txt" 2>&1 || { echo "bench failed"; status=1; }
  .dev/gpu/dsv4 info > "$out/info.txt" 2>&1
  cat "$out/bench.txt" | cut -c1-150 | tail -45
fi
if [[ " $steps " == *" py "* ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$out/pip.txt" 2>&1 || { echo "pip install failed"; cat "$out/pip.txt"; }
  export PYTHONPATH=/tmp/site:python/tests DSV4_SHARED_DIR=$PWD/.dev/gpu PYTHONUNBUFFERED=1
  timeout "${DSV4_PY_TIMEOUT:-300}" python3 -m pytest -v -rs -s python/tests > "$out/pytest.txt" 2>&1 || status=1
  grep -E "passed|failed|FAILED|Error|sparse_attention S=|indexer|sinkhorn m=" "$out/pytest.txt" | grep -v PASSED | tail -30; grep -c PASSED "$out/pytest.txt"
fi
if [[ " $steps " == *" pybench "* ]]; then
  # Timings through the torch API (sustained, host per call, cool), then NeMo's layer.
  [ -d /tmp/site/dsv4_kernels ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
  export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
  timeout "${DSV4_PYBENCH_TIMEOUT:-240}" python3 -m dsv4_kernels.bench --json "$out/pybench.json" > "$out/pybench.txt" 2>&1 || status=1
  timeout 120 python3 -m dsv4_kernels.bench nemo-layer --s 4096 --json "$out/pybench-nemo.json" >> "$out/pybench.txt" 2>&1 || status=1
  cut -c1-150 "$out/pybench.txt" | tail -40
fi
echo "gpu-round: exit $status"
exit $status
