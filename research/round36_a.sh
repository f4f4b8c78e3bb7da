#!/usr/bin/env bash
# v36's first GPU call: the forward's sink = -inf fix through torch (test_heads_without_a_sink
# and the hunt's repro_sinks_neginf), then scripts/gpu-test.sh whole: every Rust GPU test,
# memcheck, initcheck, racecheck, synccheck and `dsv4 check --backend cuda`.
set -uo pipefail
out=${OUT:-.dev/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$out/pip.txt" 2>&1 || cat "$out/pip.txt"
export PYTHONPATH=/tmp/site:python/tests DSV4_SHARED_DIR=$PWD/.dev/gpu PYTHONUNBUFFERED=1 DSV4_CACHE_DIR=/tmp/dsv4-cache PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
t0=$SECONDS
timeout 60 python3 -m pytest -q -rs python/tests/test_gpu_indices.py -k "heads_without_a_sink" > "$out/pytest_sink.txt" 2>&1
echo "pytest sink: $(tail -1 "$out/pytest_sink.txt") ($((SECONDS - t0)) s)"; grep -E "^FAILED|^E " "$out/pytest_sink.txt" | head -8
for c in repro_sinks_neginf repro_plan_deterministic nemo_init_padmask; do
  timeout 60 python3 research/issue41_hunt.py $c 2>&1 | grep -E "^$c|^  |Error" | cut -c1-300
done
echo "hunt done ($((SECONDS - t0)) s)"
timeout $((570 - (SECONDS - t0))) bash scripts/gpu-test.sh > /dev/null 2>&1; echo "gpu-test rc=$? ($((SECONDS - t0)) s)"
grep -E "^=== .*(ok|FAILED)|^test result|ERROR SUMMARY|checks:|gpu-test:|panicked" "$out/gpu-test.log" | head -60
