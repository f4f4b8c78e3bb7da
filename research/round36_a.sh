#!/usr/bin/env bash
# v36's first GPU call: the forward's sink = -inf fix through torch (test_heads_without_a_sink),
# the reproducer under memcheck and initcheck, then scripts/gpu-test.sh whole: every Rust GPU test,
# memcheck, initcheck, racecheck, synccheck and `dsv4 check --backend cuda`.
set -uo pipefail
out=${OUT:-.dev/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$out/pip.txt" 2>&1 || cat "$out/pip.txt"
export PYTHONPATH=/tmp/site:python/tests DSV4_SHARED_DIR=$PWD/.dev/gpu PYTHONUNBUFFERED=1 DSV4_CACHE_DIR=/tmp/dsv4-cache PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
t0=$SECONDS
timeout 60 python3 -m pytest -q -rs python/tests/test_gpu_indices.py -k "heads_without_a_sink" > "$out/pytest_sink.txt" 2>&1
echo "pytest sink: $(tail -1 "$out/pytest_sink.txt") ($((SECONDS - t0)) s)"; grep -E "^FAILED|^E " "$out/pytest_sink.txt" | head -8
san=/usr/local/cuda/bin/compute-sanitizer
# The reproducer at its full shape under memcheck (torch's caching off: an access next to a
# tensor is outside any allocation) and initcheck (reads of memory nothing wrote).
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 90 $san --tool memcheck --print-limit 10 python3 research/issue41_hunt.py repro_atomic > "$out/memcheck_repro.txt" 2>&1
echo "memcheck repro rc=$?: $(grep -E 'ERROR SUMMARY|: ok' "$out/memcheck_repro.txt" | cut -c1-200 | tr '\n' ' ')"
timeout 90 $san --tool initcheck --print-limit 10 python3 research/issue41_hunt.py repro_deterministic > "$out/initcheck_repro.txt" 2>&1
echo "initcheck repro rc=$?: $(grep -E 'ERROR SUMMARY|: ok' "$out/initcheck_repro.txt" | cut -c1-200 | tr '\n' ' ')"
grep -m3 -A6 "Uninitialized\|Invalid" "$out/initcheck_repro.txt" "$out/memcheck_repro.txt" | head -24
echo "repro sanitizers done ($((SECONDS - t0)) s)"
timeout $((540 - (SECONDS - t0))) bash scripts/gpu-test.sh > /dev/null 2>&1; echo "gpu-test rc=$? ($((SECONDS - t0)) s)"
grep -E "^=== .*(ok|FAILED)|^test result|ERROR SUMMARY|checks:|gpu-test:|panicked" "$out/gpu-test.log" | head -60
