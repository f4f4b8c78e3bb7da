#!/usr/bin/env bash
# The second v35 call: the reproducer tests and issue 41's hunt after the plan-stream fix.
set -uo pipefail
out=${OUT:-.dev/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$out/pip.txt" 2>&1 || cat "$out/pip.txt"
export PYTHONPATH=/tmp/site:python/tests DSV4_SHARED_DIR=$PWD/.dev/gpu PYTHONUNBUFFERED=1 DSV4_CACHE_DIR=/tmp/dsv4-cache PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 70 python3 -m pytest -q -rs python/tests/test_gpu_indices.py -k "empty_rows or shared_reproducer" > "$out/pytest_indices.txt" 2>&1
echo "pytest indices: $(tail -1 "$out/pytest_indices.txt")"; grep -E "^FAILED|^E " "$out/pytest_indices.txt" | head -8
timeout 110 python3 research/issue41_hunt.py all 2>&1 | cut -c1-420 | tee "$out/hunt.txt"
