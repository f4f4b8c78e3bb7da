#!/usr/bin/env bash
# Run ON the GPU machine, from the repository root, what scripts/gpu-build.sh staged in
# .dev/gpu/: every test executable (GPU tests included), compute-sanitizer memcheck over
# the small-shape tests (`small_*`), then `dsv4 check --backend cuda`. Exits non-zero on
# any failure (memcheck and initcheck over the small tests, racecheck and synccheck over the
# attention's). Log: ${OUT:-.dev}/gpu-test.log. DSV4_SANITIZER=0 leaves memcheck out (for a
# quick iteration; a full run keeps it); DSV4_GPU_TESTS=0 leaves the plain test runs out (the
# sanitizers and check alone, when one device call cannot hold both).
set -uo pipefail
cd "$(dirname "$0")/.."
dir=.dev/gpu
log=${OUT:-.dev}/gpu-test.log
mkdir -p "$(dirname "$log")"
exec > >(tee "$log") 2>&1

[ -d "$dir/tests" ] || { echo "no $dir/tests: run scripts/gpu-build.sh first (and carry .dev/gpu)"; exit 2; }
export DSV4_GOLDEN_DIR=$dir/golden
# Only the staged golden files (not a shared/ checkout that may sit beside the repo too).
export DSV4_SHARED_DIR=$dir/no-shared
export RUST_BACKTRACE=1

# NVRTC: a CUDA toolkit when present, else the staged pip libraries.
if [ -z "${DSV4_NVRTC_LIB:-}" ] && ! ls "${CUDA_HOME:-/usr/local/cuda}"/lib64/libnvrtc.so* >/dev/null 2>&1 && [ -f "$dir/nvrtc.tar.xz" ]; then
  mkdir -p "$dir/nvrtc" && tar -C "$dir/nvrtc" -xJf "$dir/nvrtc.tar.xz"
  export DSV4_NVRTC_LIB=$PWD/$dir/nvrtc/lib/libnvrtc.so.13 DSV4_CUDA_INCLUDE=$PWD/$dir/nvrtc/include
  echo "using the staged NVRTC: $DSV4_NVRTC_LIB"
fi
export DSV4_CACHE_DIR=${DSV4_CACHE_DIR:-$PWD/$dir/kernel-cache}

failed=()
run() {
  local label=$1
  shift
  echo
  echo "=== $label: $*"
  local t0=$SECONDS
  if "$@"; then
    echo "=== $label: ok ($((SECONDS - t0)) s)"
  else
    echo "=== $label: FAILED (exit $?, $((SECONDS - t0)) s)"
    failed+=("$label")
  fi
}

nvidia-smi || echo "(nvidia-smi not available)"

if [ "${DSV4_GPU_TESTS:-1}" = 0 ]; then
  echo "test executables: not run this time (DSV4_GPU_TESTS=0)"
else
  for t in "$dir"/tests/*; do
    run "test $(basename "$t")" "$t" --include-ignored --test-threads=1 --nocapture
  done
fi

sanitizer=/usr/local/cuda/bin/compute-sanitizer
if [ "${DSV4_SANITIZER:-1}" = 0 ]; then
  echo "compute-sanitizer: not run this time (DSV4_SANITIZER=0)"
elif [ -x "$sanitizer" ]; then
  for t in "$dir"/tests/gpu_*; do
    [ -e "$t" ] || continue
    # memcheck slows kernels 10-100x: only the small-shape tests, where a binary has any.
    "$t" --list --include-ignored 2>/dev/null | grep -q '^small_' || { echo "memcheck $(basename "$t"): no small_* tests"; continue; }
    run "memcheck $(basename "$t")" "$sanitizer" --tool memcheck --error-exitcode 1 --print-limit 20 "$t" --include-ignored --test-threads=1 small_
  done
  # Reads of device memory nothing wrote (a launch reading per-row work lists past the
  # part that was written, an output row left unwritten and read back): initcheck on the
  # same small tests.
  for t in "$dir"/tests/gpu_*; do
    [ -e "$t" ] || continue
    "$t" --list --include-ignored 2>/dev/null | grep -q '^small_' || continue
    run "initcheck $(basename "$t")" "$sanitizer" --tool initcheck --error-exitcode 1 --print-limit 20 "$t" --include-ignored --test-threads=1 small_
  done
  # Shared-memory races and barrier misuse in the attention kernels (many warps, one
  # CTA-wide shared layout per tile): racecheck and synccheck on the shared attention cases.
  for tool in racecheck synccheck; do
    run "$tool gpu_cases (attention)" timeout 240 "$sanitizer" --tool $tool --error-exitcode 1 --print-limit 20 "$dir/tests/gpu_cases" --include-ignored --test-threads=1 small_sparse_attention_cases
  done
  # The Hopper kernels' named barriers (two consumer warpgroups, 256 threads) and
  # mbarrier handshakes: synccheck on their tests.
  run "synccheck gpu_sparse_attention (hopper)" timeout 240 "$sanitizer" --tool synccheck --error-exitcode 1 --print-limit 20 "$dir/tests/gpu_sparse_attention" --include-ignored --test-threads=1 small_hopper_
  run "synccheck gpu_indexer (hopper backward)" timeout 240 "$sanitizer" --tool synccheck --error-exitcode 1 --print-limit 20 "$dir/tests/gpu_indexer" --include-ignored --test-threads=1 small_hopper_backward
else
  echo "compute-sanitizer not found at $sanitizer"
  failed+=("compute-sanitizer missing")
fi

if [ -x "$dir/dsv4" ]; then
  run "dsv4 check" "$dir/dsv4" check --backend cuda
fi

echo
if [ ${#failed[@]} -eq 0 ]; then
  echo "gpu-test: all passed"
else
  echo "gpu-test: ${#failed[@]} failed:"
  printf '  %s\n' "${failed[@]}"
  exit 1
fi
