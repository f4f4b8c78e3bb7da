#!/usr/bin/env bash
# v36's GPU call when a lease holds only one: issue 41's tests through torch (the whole of
# test_gpu_indices.py), the host-time breakdown (research/host_profile.py), then
# scripts/gpu-test.sh in two passes: the sanitizers and `dsv4 check` first
# (DSV4_GPU_TESTS=0), then every Rust GPU test executable with the time left.
set -uo pipefail
out=${OUT:-.dev/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$out/pip.txt" 2>&1 || cat "$out/pip.txt"
export PYTHONPATH=/tmp/site:python/tests DSV4_SHARED_DIR=$PWD/.dev/gpu PYTHONUNBUFFERED=1 DSV4_CACHE_DIR=/tmp/dsv4-cache PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
t0=$SECONDS
timeout 130 python3 -m pytest -q -rs python/tests/test_gpu_indices.py -p no:cacheprovider > "$out/pytest_indices.txt" 2>&1
echo "pytest test_gpu_indices ($((SECONDS - t0)) s): $(tail -1 "$out/pytest_indices.txt")"; grep -E "^FAILED|^E " "$out/pytest_indices.txt" | cut -c1-200 | head -8
timeout 50 python3 research/host_profile.py --s 4096 > "$out/host_profile.txt" 2>&1; head -12 "$out/host_profile.txt"; grep -A20 "tottime" "$out/host_profile.txt" | cut -c1-130
echo "host profile done ($((SECONDS - t0)) s)"
DSV4_GPU_TESTS=0 timeout $((400 - (SECONDS - t0))) bash scripts/gpu-test.sh > /dev/null 2>&1; echo "sanitizers + check rc=$? ($((SECONDS - t0)) s)"
cp "$out/gpu-test.log" "$out/gpu-test-sanitizers.log"
grep -E "^=== .*(ok|FAILED)|ERROR SUMMARY: [1-9]|checks:|gpu-test:" "$out/gpu-test-sanitizers.log" | head -30
DSV4_SANITIZER=0 timeout $((570 - (SECONDS - t0))) bash scripts/gpu-test.sh > /dev/null 2>&1; echo "tests rc=$? ($((SECONDS - t0)) s)"
grep -E "^=== .*(ok|FAILED)|^test result|checks:|gpu-test:|panicked" "$out/gpu-test.log" | head -40
