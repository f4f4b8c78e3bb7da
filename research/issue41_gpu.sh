#!/usr/bin/env bash
# Issue 41 on the GPU machine, one call: the crash hunt (research/issue41_hunt.py), the
# reproducer under compute-sanitizer (memcheck with torch's caching allocator off, so an
# out-of-bounds access next to a tensor is seen; initcheck), and the reproducer tests.
# Needs .whl/ (the dsv4_kernels wheel, nemo_automodel 0.7.0) and .dev/gpu/repro carried.
set -uo pipefail
out=${OUT:-.dev/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$out/pip.txt" 2>&1 || cat "$out/pip.txt"
export PYTHONPATH=/tmp/site:python/tests DSV4_SHARED_DIR=$PWD/.dev/gpu PYTHONUNBUFFERED=1 DSV4_CACHE_DIR=/tmp/dsv4-cache
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
timeout ${HUNT_TIMEOUT:-170} python3 research/issue41_hunt.py all 2>&1 | tee "$out/hunt.txt"
san=/usr/local/cuda/bin/compute-sanitizer
for c in ${MEMCHECK_CASES:-repro_atomic}; do
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 100 $san --tool memcheck --print-limit 10 python3 research/issue41_hunt.py $c > "$out/memcheck_$c.txt" 2>&1
  echo "memcheck $c rc=$?: $(grep -E 'ERROR SUMMARY|: ok' "$out/memcheck_$c.txt" | tr '\n' ' ' | cut -c1-300)"
done
timeout 100 $san --tool initcheck --print-limit 10 python3 research/issue41_hunt.py repro_atomic > "$out/initcheck.txt" 2>&1
echo "initcheck rc=$?: $(grep -E 'ERROR SUMMARY|: ok' "$out/initcheck.txt" | tr '\n' ' ' | cut -c1-300)"
grep -m5 -B2 -A8 "Uninitialized\|Invalid" "$out/initcheck.txt" "$out"/memcheck_*.txt | head -60
timeout ${PYTEST_TIMEOUT:-110} python3 -m pytest -q -x -rs python/tests/test_gpu_indices.py -k "empty_rows or shared_reproducer" > "$out/pytest_indices.txt" 2>&1
echo "pytest test_gpu_indices: $(tail -1 "$out/pytest_indices.txt")"; grep -E "^FAILED|Error" "$out/pytest_indices.txt" | head -10
