# Sourced (from the repository root on the GPU machine) by the one-off variant calls of
# the lab (docs/experiments/*.sh, kept by tag lab-v32): logs to $OUT/log.txt, points the tests at the staged golden files
# only, and defines `run DEFINES CMD...`: CMD with DSV4_EXTRA_DEFINES=DEFINES (commas) and a
# kernel cache of that define set's own.
out=${OUT:-.dev/out}; mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1
export DSV4_GOLDEN_DIR=$PWD/.dev/gpu/golden DSV4_SHARED_DIR=$PWD/.dev/gpu/no-shared
run(){ local d="$1"; shift; export DSV4_EXTRA_DEFINES="$d"; export DSV4_CACHE_DIR=/tmp/kc/$(echo "$d"|md5sum|cut -c1-8); env "$@"; }
