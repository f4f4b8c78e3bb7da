#!/usr/bin/env bash
# Build the dsv4_kernels wheel (abi3: CPython >= 3.10, so 3.12 too; manylinux tag from
# the glibc symbols it links) into .dev/wheels/ for a GPU machine without network:
#
#   bash scripts/py-gpu-wheel.sh
#   # there: pip install --no-deps .dev/wheels/dsv4_kernels-*.whl   (torch + numpy present)
#   #        python -m pytest python/tests/test_gpu.py -q
#
# The CUDA backend is linked (it loads the driver and NVRTC at run time).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${DSV4_PY_VENV:-$repo/.dev/py-venv}
python=${PYTHON:-python3}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$repo/target}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip --disable-pip-version-check -q install "maturin>=1.5,<2"
mkdir -p "$repo/.dev/wheels"
rm -f "$repo"/.dev/wheels/dsv4_kernels-*.whl
cd "$repo"
"$venv/bin/maturin" build --release --strip --out "$repo/.dev/wheels"
ls -l "$repo"/.dev/wheels/dsv4_kernels-*.whl
