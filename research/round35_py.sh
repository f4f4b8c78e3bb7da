#!/usr/bin/env bash
# v35's Python call on the GPU machine (after research/issue41_gpu.sh installed the wheels
# into /tmp/site on the same warm machine): the Python suite on CUDA, the torch-API bench
# at S=4096 and NeMo's layer.
set -uo pipefail
out=${OUT:-.dev/out}; mkdir -p "$out"
[ -d /tmp/site/dsv4_kernels ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:python/tests DSV4_SHARED_DIR=$PWD/.dev/gpu PYTHONUNBUFFERED=1 DSV4_CACHE_DIR=/tmp/dsv4-cache
timeout ${PY_TIMEOUT:-270} python3 -m pytest -q -rs python/tests -k "not shared_reproducer and not empty_rows" > "$out/pytest.txt" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$out/pytest.txt" | tail -15
timeout 150 python3 -m dsv4_kernels.bench attention indexer sinkhorn qnorm_rope builder --s 4096 --iters 50 --cooldown-ms 100 --json "$out/pybench.json" > "$out/pybench.txt" 2>&1
cut -c1-150 "$out/pybench.txt"
timeout 150 python3 -m dsv4_kernels.bench nemo-layer --s 4096 --iters 10 --cooldown-ms 100 --json "$out/nemo.json" > "$out/nemo.txt" 2>&1
grep -E "nemo-layer|peak|kernels:|Error" "$out/nemo.txt" | cut -c1-150
