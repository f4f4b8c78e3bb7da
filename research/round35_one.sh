#!/usr/bin/env bash
# v35's first GPU call: issue 41's hunt and reproducer tests, then every Rust GPU test
# executable and `dsv4 check --backend cuda` (no sanitizers: research/issue41_gpu.sh and
# scripts/gpu-test.sh run those when a second call is had).
set -uo pipefail
out=${OUT:-.dev/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$out/pip.txt" 2>&1 || cat "$out/pip.txt"
export PYTHONPATH=/tmp/site:python/tests DSV4_SHARED_DIR=$PWD/.dev/gpu PYTHONUNBUFFERED=1 DSV4_CACHE_DIR=/tmp/dsv4-cache
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 100 python3 research/issue41_hunt.py all > "$out/hunt.txt" 2>&1; cut -c1-400 "$out/hunt.txt"
timeout 90 python3 -m pytest -q -rs python/tests/test_gpu_indices.py -k "empty_rows or shared_reproducer" > "$out/pytest_indices.txt" 2>&1
echo "pytest indices: $(tail -1 "$out/pytest_indices.txt")"; grep -E "^FAILED" "$out/pytest_indices.txt" | head
DSV4_SANITIZER=0 timeout 180 bash scripts/gpu-test.sh > /dev/null 2>&1; echo "gpu-test rc=$?"
grep -E "^=== .*(ok|FAILED)|^test result|checks:|gpu-test:" "$out/gpu-test.log" | head -40
