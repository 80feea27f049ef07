#!/usr/bin/env bash
# Every test: builds libfsdp with its tests (default preset), runs CTest, then
# the Python binding's tests (tools/test_python.sh: a fresh venv and
# `pip install ./bindings/python`, which builds its own libfsdp into the
# package) and the Go binding's (tools/test_go.sh) against the library just
# built. With --asan or --tsan,
# runs the C++ suite under that sanitizer preset instead.
set -euo pipefail
cd "$(dirname "$0")/.."
preset=default
case "${1:-}" in
  --asan) preset=asan ;;
  --tsan) preset=tsan ;;
  "") ;;
  *) echo "usage: $0 [--asan|--tsan]" >&2; exit 2 ;;
esac
tools/deps.sh
# ccache keys on paths relative to the checkout, so that a clone elsewhere (CI's
# fresh one) reuses what earlier builds compiled.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}" CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-true}"
# Explicit ON: a build tree configured by hand with tests off must not pass silently.
cmake --preset "$preset" -DFSDP_BUILD_TESTS=ON >/dev/null
cmake --build --preset "$preset" -j"$(nproc)"
ctest --preset "$preset" -j"$(nproc)"
if [ "$preset" = default ]; then
  tools/test_python.sh
  tools/test_go.sh build/default
fi
