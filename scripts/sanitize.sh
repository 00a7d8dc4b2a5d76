#!/usr/bin/env bash
# The native tests under AddressSanitizer and UndefinedBehaviorSanitizer.
#
# Every C part (the host forward, the small kernels, the view builder) is rebuilt with
# -fsanitize=address,undefined (DS4SERVE_NATIVE_SANITIZE=1, in a cache of its own) and the tests that
# drive it run in a Python whose process preloads the ASan runtime (Python itself is not instrumented).
# Any invalid read or write, overflow, misaligned access or other undefined behaviour stops the run with
# a report; leak checking is off (CPython and torch keep memory until exit by design).
#
#   scripts/sanitize.sh                   # the native test files below (~8-10 minutes on 2 cores)
#   scripts/sanitize.sh tests/test_x.py   # other tests
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
CC="$(command -v cc || command -v gcc)"
ASAN="$("$CC" -print-file-name=libasan.so)"
if [ ! -e "$ASAN" ]; then
    echo "no libasan.so for $CC (Debian: apt-get install libasan8, or gcc's own package)" >&2
    exit 2
fi
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
    tests=(tests/test_host_forward.py tests/test_host_packed.py tests/test_native_kernels.py tests/test_native_view.py
           tests/test_prefix_cache.py tests/test_engine_invariance.py tests/test_tiny_model.py)
fi
export DS4SERVE_NATIVE_SANITIZE=1
export DS4SERVE_CACHE="${DS4SERVE_CACHE:-$HOME/.cache/ds4serve-sanitize}"
# halt on the first error; no leak reports; torch's own allocator is not instrumented, so no
# container-overflow false positives from it
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:detect_odr_violation=0:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
echo "+ LD_PRELOAD=$ASAN $PYTHON -m pytest ${tests[*]}"
start=$(date +%s)
LD_PRELOAD="$ASAN" "$PYTHON" -m pytest -q -p no:cacheprovider "${tests[@]}"
echo "sanitizers: clean ($(( $(date +%s) - start )) s)"
