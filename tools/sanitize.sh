#!/usr/bin/env bash
# The C kernels built with AddressSanitizer + UndefinedBehaviorSanitizer, run by the kernel
# tests and the differential fuzz (tools/fuzz_kernels.py); any sanitizer report fails.
# Run by .ci/run and `nox -s sanitize`, in an environment with attnscore installed.
#
#   bash tools/sanitize.sh [FUZZ ARGS...]     (default: --cases 2000)
#
# A fresh build cache; gcc's runtimes preloaded (Python is not built with them, and ASan
# must come first); detect_leaks=0 (CPython and torch keep memory until exit by design);
# every error aborts the process. pytest runs with -s so that a report reaches the log (its
# capture would swallow the stderr of a process that aborts); the sanitizers also write
# reports under logs/ where they honour log_path, and a file there fails the run.
# ATTNSCORE_SANITIZE_TESTS names other tests (e.g. a file that proves a report fails this).
set -uo pipefail
cd "$(dirname "$0")/.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
logs="$work/logs"
mkdir -p "$logs"
export CC=gcc ATTNSCORE_CACHE="$work/cache" MPLBACKEND=Agg
export ATTNSCORE_CFLAGS="-fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=all -fno-omit-frame-pointer -g"
for runtime in libasan.so libubsan.so; do
    path="$(gcc -print-file-name="$runtime")"
    if [ ! -e "$path" ]; then
        echo "gcc has no $runtime (install gcc's sanitizer runtimes)" >&2
        exit 1
    fi
    LD_PRELOAD="${LD_PRELOAD:+$LD_PRELOAD:}$path"
done
export LD_PRELOAD
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:allocator_may_return_null=1:log_path=$logs/asan"
export UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1:log_path=$logs/ubsan"
rc=0
# The kernels loaded must be the sanitized build: a failed build would leave the PyTorch
# fallbacks, and every test would pass without running a line of C.
python - <<'PY' || rc=1
import os, pathlib
import attnscore.kernels as K
assert K.load_library() is not None, f"C kernels unavailable: {K.build_info().error}"
info = K.build_info()
cache = pathlib.Path(os.environ["ATTNSCORE_CACHE"]).resolve()
assert pathlib.Path(info.path).resolve().parent == cache, info.path
maps = pathlib.Path("/proc/self/maps").read_text()
assert "libasan" in maps and "libubsan" in maps, "sanitizer runtimes not loaded"
print(f"sanitized kernels: {info.path}")
PY
# shellcheck disable=SC2086  # ATTNSCORE_SANITIZE_TESTS may name several paths
python -m pytest ${ATTNSCORE_SANITIZE_TESTS:-tests/kernels} -m "not cuda" --no-cov -s \
    -p no:cacheprovider -q -o addopts="" || rc=1
if [ "$#" -eq 0 ]; then
    set -- --cases 2000
fi
python tools/fuzz_kernels.py "$@" || rc=1
for report in "$logs"/*; do
    [ -e "$report" ] || continue
    echo "==== sanitizer report $report ====" >&2
    head -c 20000 "$report" >&2
    rc=1
done
exit "$rc"
