#!/usr/bin/env bash
# Time kernel variants that live on git branches in ONE GPU call.
#
# Here (no GPU needed):
#   bash scripts/gpu-variants.sh build main exp/fwd-sm90-stagger exp/bwd-sm90-dkv-pipeline
# builds each ref in its own worktree (.dev/variants-build/src/<name>, own target dir) and
# stages its `dsv4` CLI and gpu_* test binaries in .dev/variants/<name>/ (~15 MB a ref) plus
# the golden files once. Then, with `.dev/variants` carried, on the GPU machine:
#   bash scripts/gpu-variants.sh run ["test filter"] ["bench args"]
# runs, for every staged ref, the tests named `<test binary>:<name filter>` (default
# `gpu_sparse_attention:small_hopper_ gpu_sparse_attention:deepseek
# gpu_sparse_attention:small_deterministic`; e.g. `gpu_indexer:small_` for the indexer) and
# `dsv4 bench <bench args>` (default `sparse-attention --iters 20`), one block per ref. A ref that fails a test is
# marked so; its timings are still shown (wrong kernels are sometimes fast: read both).
#
# Variants behind defines (no rebuild; the binaries staged by scripts/gpu-build.sh):
#   bash scripts/gpu-variants.sh defines "test filters" "bench args" "" "A=1" "A=2,B=1" ...
# runs, for each define set (passed as DSV4_EXTRA_DEFINES; "" = the defaults), the tests
# and `.dev/gpu/dsv4 bench <bench args>`, each set with its own kernel cache.
# DSV4_VARIANT_TIMEOUT (seconds, default 300) bounds each test binary; adding
# DSV4_MBAR_TIMEOUT_POLLS=10000000 to a define set makes a deadlocked Hopper pipeline trap
# (hopper.cuh) instead of hanging until that timeout.
set -uo pipefail
cd "$(dirname "$0")/.."
root=.dev/variants          # staged binaries: carried to the GPU machine
build=.dev/variants-build   # worktrees and target dirs: stay here
cmd=${1:-}
shift || true

name_of() { echo "$1" | tr '/:' '__'; }

# On the GPU machine everything printed also goes to one file under $OUT (the device tool
# returns only the last 12,000 characters of the output, and at most 8 files).
if [ "$cmd" != build ] && [ -n "${OUT:-}" ]; then
  exec > >(tee -a "$OUT/variants.log") 2>&1
fi

case "$cmd" in
build)
  [ $# -gt 0 ] || { echo "usage: $0 build <git ref>..."; exit 2; }
  mkdir -p "$build/src" "$root/golden"
  shared=${DSV4_SHARED_DIR:-$(cd .. && pwd)/shared}
  cp "$shared"/golden/*.safetensors "$root/golden/"
  for ref in "$@"; do
    n=$(name_of "$ref")
    wt="$build/src/$n"
    git worktree remove --force "$wt" >/dev/null 2>&1 || rm -rf "$wt"
    git worktree add --detach "$wt" "$ref" >/dev/null || { echo "cannot check out $ref"; exit 1; }
    echo "== $ref ($(git -C "$wt" log --oneline -1))"
    (
      cd "$wt"
      export CARGO_TARGET_DIR=$PWD/../../target-$n
      cargo test --release -p dsv4-cuda --no-run --message-format=json-render-diagnostics 2>/dev/null > ../../build-$n.json || exit 1
      cargo build --release -p dsv4-cli 2>&1 | tail -1
    ) || { echo "build of $ref failed"; exit 1; }
    out="$root/$n"
    rm -rf "$out"
    mkdir -p "$out/tests"
    python3 - "$build/build-$n.json" "$out/tests" <<'PY'
import json, shutil, sys
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test") and m["target"]["name"].startswith("gpu_"):
        shutil.copy(m["executable"], f"{sys.argv[2]}/{m['target']['name']}")
PY
    cp "$build/target-$n/release/dsv4" "$out/dsv4"
    strip --strip-debug "$out/dsv4" "$out"/tests/* 2>/dev/null || true
    git -C "$wt" log --oneline -1 > "$out/ref.txt"
    echo "staged $ref in $out ($(du -sh "$out" | cut -f1))"
  done
  ;;
run)
  filter=${1:-gpu_sparse_attention:small_hopper_ gpu_sparse_attention:deepseek gpu_sparse_attention:small_deterministic}
  bench=${2:-sparse-attention --iters 20}
  export DSV4_GOLDEN_DIR=$PWD/$root/golden DSV4_SHARED_DIR=$PWD/$root/no-shared RUST_BACKTRACE=1
  for d in "$root"/*/; do
    n=$(basename "$d")
    [ -x "$d/dsv4" ] || continue
    echo "==================== $n: $(cat "$d/ref.txt")"
    export DSV4_CACHE_DIR=$PWD/$d/kernel-cache
    status=ok
    for bf in $filter; do
      bin=${bf%%:*} f=${bf#*:}
      timeout "${DSV4_VARIANT_TIMEOUT:-300}" "$d/tests/$bin" --include-ignored --test-threads=1 "$f" > "$d/test-$bin-$f.log" 2>&1 || status="FAILED ($bf)"
      grep -E "^test |test result" "$d/test-$bin-$f.log" | grep -v "^test result: ok. 0 passed"
    done
    echo "tests: $status"
    # shellcheck disable=SC2086
    timeout 300 "$d/dsv4" bench $bench 2>&1 | grep -E "sparse_attention|indexer|sinkhorn|qnorm" | cut -c1-140
  done
  ;;
defines)
  filter=$1 bench=$2
  shift 2
  export DSV4_GOLDEN_DIR=$PWD/.dev/gpu/golden DSV4_SHARED_DIR=$PWD/.dev/gpu/no-shared RUST_BACKTRACE=1
  for defs in "$@"; do
    echo "==================== DSV4_EXTRA_DEFINES=\"$defs\""
    export DSV4_EXTRA_DEFINES=$defs DSV4_CACHE_DIR=$PWD/.dev/gpu/kernel-cache-$(echo "${defs:-default}" | tr -c 'A-Za-z0-9_\n' '_')
    status=ok
    for bf in $filter; do
      bin=${bf%%:*} f=${bf#*:}
      log=$DSV4_CACHE_DIR.test-$bin-$f.log
      timeout "${DSV4_VARIANT_TIMEOUT:-300}" ".dev/gpu/tests/$bin" --include-ignored --test-threads=1 "$f" > "$log" 2>&1 || status="FAILED ($bf)"
      grep -E "^test |test result" "$log" | grep -v "^test result: ok. 0 passed"
    done
    echo "tests: $status"
    # shellcheck disable=SC2086
    timeout 300 .dev/gpu/dsv4 bench $bench 2>&1 | grep -E "sparse_attention|indexer|sinkhorn|qnorm" | cut -c1-140
  done
  ;;
*)
  echo "usage: $0 build <git ref>... | run [\"test filters\"] [\"bench args\"] | defines \"test filters\" \"bench args\" <define set>..."
  exit 2
  ;;
esac
