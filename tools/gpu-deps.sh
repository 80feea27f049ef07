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
# pkgconf: CMake finds libdeflate through pkg-config. OpenBLAS (the pthread
# build, and the libgfortran it needs): the CPU GPT of examples/gpt, which the
# GPU GPT (examples/gpt/cuda) links for its data and init and tests against.
cd .gpu-deps
rm -f ./*.deb
apt-get download googletest nlohmann-json3-dev libdeflate-dev libdeflate0 zlib1g-dev zlib1g pkgconf pkgconf-bin \
  libpkgconf3 libopenblas-dev libopenblas0 libopenblas-pthread-dev libopenblas0-pthread libgfortran5 libquadmath0
# pytest (pure-Python wheels) for the binding's GPU test, which that machine's
# Python (with torch and cupy) runs; installed there into a folder of its own.
rm -rf wheels
python3 -m pip download -q --only-binary=:all: --dest wheels pytest
# cudnn-frontend's headers (the GPU GPT's fused attention, examples/gpt/cuda):
# the pinned wheel's include/ unpacked into .gpu-deps/cudnn-frontend, where
# CMake looks for them. cuDNN itself is the GPU machine's (its CUDA toolkit,
# or a Python package nvidia-cudnn-cu*: tools/gpu-check.sh).
cd ..
tools/deps.sh --cudnn-frontend .gpu-deps/cudnn-frontend
ls -la .gpu-deps .gpu-deps/wheels
