#!/usr/bin/env bash
# Build the Python package dsv4_kernels (PyO3 + maturin) into a venv and run its tests.
#
#   bash scripts/py-test.sh            # numpy-only tests (+ torch tests if the venv has torch)
#
# Env: DSV4_PY_VENV (default .dev/py-venv), PYTHON (default python3), CARGO_TARGET_DIR
# (default target/), DSV4_SHARED_DIR / DSV4_GOLDEN_DIR (golden files, see python/tests).
# Exits non-zero on any failure, including a run that collected no test.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${DSV4_PY_VENV:-$repo/.dev/py-venv}
python=${PYTHON:-python3}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$repo/target}

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
export PATH="$venv/bin:$PATH"  # the maturin build backend runs `maturin` by name
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install "maturin>=1.5,<2" numpy pytest ml_dtypes
# The PEP 517 path a user takes (`pip install .`), without re-downloading maturin.
pip install --no-build-isolation --force-reinstall --no-deps "$repo"

cd "$repo"
set +e
"$venv/bin/python" -m pytest python/tests -q -rs -p no:cacheprovider
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "py-test: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
