#!/usr/bin/env bash
# The project's test command (what CI runs): Rust tests of every crate (the CUDA crate's
# NVRTC compile test included; GPU-only tests are run by scripts/gpu-test.sh on a GPU
# machine), clippy, and the Python package's tests.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== golden vectors through the reference (one line per golden file)"
cargo test --locked -p dsv4-core --test golden -- --nocapture 2>&1
echo "== cargo test (Rust crates)"
cargo test --locked 2>&1
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings 2>&1
if [ -x scripts/py-test.sh ]; then
  echo "== python package"
  bash scripts/py-test.sh
fi
