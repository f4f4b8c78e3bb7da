#!/usr/bin/env bash
# v37's second GPU call (not run: no device that session; after round37_a.sh): the Python
# suite on CUDA (every file, NeMo 0.7.0 installed), the host-time breakdown
# (research/host_profile.py), the torch-API bench at S=4096 and 16384, NeMo's layer.
set -uo pipefail
out=${OUT:-.dev/out}; mkdir -p "$out"
[ -d /tmp/site/dsv4_kernels ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$out/pip.txt" 2>&1
export PYTHONPATH=/tmp/site:python/tests DSV4_SHARED_DIR=$PWD/.dev/gpu PYTHONUNBUFFERED=1 DSV4_CACHE_DIR=/tmp/dsv4-cache PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
timeout 240 python3 -m pytest -q -rs python/tests -p no:cacheprovider > "$out/pytest.txt" 2>&1
echo "pytest ($((SECONDS - t0)) s): $(tail -1 "$out/pytest.txt")"; grep -E "^FAILED|^ERROR|^SKIPPED" "$out/pytest.txt" | cut -c1-220 | head -20
timeout 60 python3 research/host_profile.py --s 4096 > "$out/host_profile.txt" 2>&1; head -14 "$out/host_profile.txt"; grep -A22 "tottime" "$out/host_profile.txt" | cut -c1-140
echo "host profile done ($((SECONDS - t0)) s)"
timeout $((420 - (SECONDS - t0))) python3 -m dsv4_kernels.bench attention indexer sinkhorn qnorm_rope builder --s 4096 16384 --iters 50 --cooldown-ms 100 --json "$out/pybench.json" > "$out/pybench.txt" 2>&1
cut -c1-150 "$out/pybench.txt" | grep -v "^$"
echo "pybench done ($((SECONDS - t0)) s)"
timeout $((540 - (SECONDS - t0))) python3 -m dsv4_kernels.bench nemo-layer --s 4096 --iters 10 --cooldown-ms 100 --json "$out/nemo.json" > "$out/nemo.txt" 2>&1
cut -c1-150 "$out/nemo.txt" | grep -v "^$" | tail -14
echo "done ($((SECONDS - t0)) s)"
