#!/usr/bin/env bash
# Downloads, on a machine with Debian's package registry, the build
# dependencies that tools/gpu-check.sh needs on a GPU machine that has none:
# Debian packages into .gpu-deps/ (git-ignored), unpacked there into a prefix.
# With the device tool: run this here once, then name .gpu-deps in `carry`
# (docs/gpu.md, "The GPU check").
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu-deps
apt-get update -qq
# googletest: GoogleTest's sources, built there with that machine's compiler
# (a prebuilt libgtest.a would tie it to this machine's libstdc++).
# nlohmann-json3-dev: header only. libdeflate: CRC-32 of checkpoints.
# pkgconf: CMake finds libdeflate through pkg-config.
cd .gpu-deps
rm -f ./*.deb
apt-get download googletest nlohmann-json3-dev libdeflate-dev libdeflate0 zlib1g-dev zlib1g pkgconf pkgconf-bin \
  libpkgconf3
# pytest (pure-Python wheels) for the binding's GPU test, which that machine's
# Python (with torch and cupy) runs; installed there into a folder of its own.
rm -rf wheels
python3 -m pip download -q --only-binary=:all: --dest wheels pytest
ls -la . wheels
