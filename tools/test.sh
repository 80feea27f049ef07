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
# Twice as many tests as cores: much of the suite waits (late host streams,
# ranks meeting in collectives, processes starting). On 2 cores the default
# suite went from 156 s to 107 s (2026-11-27), ASan+UBSan from 212 s to
# 157 s and TSan from 278 s to 212-221 s (2026-11-30; its longest test then
# takes 35 s of its 300 s limit).
jobs=$((2 * $(nproc)))
ctest --preset "$preset" -j"$jobs"
if [ "$preset" = default ]; then
  tools/test_python.sh
  tools/test_go.sh build/default
fi
