#!/usr/bin/env bash
# Downloads, on a machine with Debian's package registry and PyPI, the build
# dependencies that tools/gpu-check.sh needs on a GPU machine that has no
# registry: into .gpu-deps/ (git-ignored), which gpu-check unpacks there.
# With the device tool: run this here once, then name .gpu-deps in `carry`
# (docs/gpu.md, "The GPU check (tools/gpu-check.sh)").
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu-deps

# cudnn-frontend's headers first (the GPU GPT's fused attention,
# examples/gpt/cuda): the pinned wheel's include/ unpacked into
# .gpu-deps/cudnn-frontend, where CMake looks for them. Without them the GPU
# GPT is not built, which is worth more than pytest below. cuDNN itself is
# the GPU machine's (its CUDA toolkit, or a Python package nvidia-cudnn-cu*).
tools/deps.sh --cudnn-frontend .gpu-deps/cudnn-frontend

# Debian packages. googletest: GoogleTest's sources, built there with that
# machine's compiler (a prebuilt libgtest.a would tie it to this machine's
# libstdc++). nlohmann-json3-dev: header only. libdeflate: CRC-32 of
# checkpoints. pkgconf: CMake finds libdeflate through pkg-config. OpenBLAS
# (the pthread build, and the libgfortran it needs): the CPU GPT of
# examples/gpt, which the GPU GPT links for its data and init and tests against.
apt-get update -qq
(cd .gpu-deps && rm -f ./*.deb &&
  apt-get download googletest nlohmann-json3-dev libdeflate-dev libdeflate0 zlib1g-dev zlib1g pkgconf pkgconf-bin \
    libpkgconf3 libopenblas-dev libopenblas0 libopenblas-pthread-dev libopenblas0-pthread libgfortran5 libquadmath0)

# pytest's wheels (pure Python) for the binding's GPU tests, in case that
# machine's Python has no pytest; gpu-check unzips them there (no pip
# needed). Downloaded with python3's pip, or a venv's where python3 has none
# (Debian's own python3 has no pip, as tools/deps.sh also finds).
pip=(python3 -m pip)
tmp=""
if ! python3 -m pip --version >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m venv "$tmp/venv"
  pip=("$tmp/venv/bin/python" -m pip)
fi
rm -rf .gpu-deps/wheels
"${pip[@]}" download -q --disable-pip-version-check --only-binary=:all: --dest .gpu-deps/wheels pytest
ls -la .gpu-deps .gpu-deps/wheels
