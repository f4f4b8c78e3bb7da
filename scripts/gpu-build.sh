#!/usr/bin/env bash
# Build the GPU test executables and the CLI HERE (no GPU needed) and stage them, with the
# golden files, in .dev/gpu/ for scripts/gpu-test.sh to run on a GPU machine:
#   .dev/gpu/tests/<test name>   every test executable of dsv4-cuda (release, stripped)
#   .dev/gpu/dsv4                the CLI
#   .dev/gpu/golden/*.safetensors
#   .dev/gpu/repro/*.xz          the shared reproducers
#   .dev/gpu/nvrtc.tar.xz        only with DSV4_STAGE_NVRTC=1: libnvrtc + CUDA headers
#                                (pip wheels) for a GPU machine without a CUDA toolkit
# DSV4_TUNING=1 builds the lab variant (the `tuning` feature: DSV4_TUNE, DSV4_EXTRA_DEFINES,
# `dsv4 bench --config`), which scripts/gpu-variants.sh defines needs.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.dev/gpu
target=${CARGO_TARGET_DIR:-target}
shared=${DSV4_SHARED_DIR:-$(cd .. && pwd)/shared}

rm -rf "$out"
mkdir -p "$out/tests" "$out/golden"

echo "== cargo test --release -p dsv4-cuda --no-run"
cargo test --release -p dsv4-cuda ${DSV4_TUNING:+--features tuning} --no-run --message-format=json-render-diagnostics > "$out/build-tests.json"
# One line per test executable: "<target name> <path>".
python3 - "$out/build-tests.json" > "$out/tests.txt" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        print(m["target"]["name"], m["executable"])
PY
while read -r name exe; do
  cp "$exe" "$out/tests/$name"
  strip --strip-debug "$out/tests/$name" 2>/dev/null || true
  echo "staged test $name"
done < "$out/tests.txt"

echo "== cargo build --release -p dsv4-cli ${DSV4_TUNING:+--features tuning}"
cargo build --release -p dsv4-cli ${DSV4_TUNING:+--features tuning}
cp "$target/release/dsv4" "$out/dsv4"
strip --strip-debug "$out/dsv4" 2>/dev/null || true

cp "$shared"/golden/*.safetensors "$out/golden/"
echo "staged $(ls "$out/golden" | wc -l) golden files from $shared/golden"
# The reproducers the GPU tests replay (python/tests/test_gpu_indices.py reads
# $DSV4_SHARED_DIR/repro, which gpu-round.sh points at .dev/gpu).
if [ -d "$shared/repro" ]; then
  mkdir -p "$out/repro" && cp "$shared"/repro/*.xz "$out/repro/" 2>/dev/null || true
fi

if [ "${DSV4_STAGE_NVRTC:-0}" = 1 ]; then
  site=$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))')
  root="$site/nvidia/cu13"
  [ -f "$root/lib/libnvrtc.so.13" ] || { echo "DSV4_STAGE_NVRTC=1: $root/lib/libnvrtc.so.13 not found (pip install nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.88)"; exit 1; }
  echo "== staging NVRTC from $root (xz, takes a few minutes)"
  tar -C "$root" -cf - lib/libnvrtc.so.13 lib/libnvrtc-builtins.so.13.0 include | xz -T0 -6 > "$out/nvrtc.tar.xz"
fi
du -sh "$out" "$out"/* | sed 's/^/  /'
