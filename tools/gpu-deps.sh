#!/usr/bin/env bash
# Downloads, on a machine with Debian's package registry and PyPI, the build
# dependencies that tools/gpu-check.sh needs on a GPU machine that has no
# registry: into .gpu-deps/ (git-ignored, 19 MB), which gpu-check unpacks
# there; and what its python and go stages need (transformers' wheels and a Go
# toolchain) into .gpu-deps-tests/ (git-ignored, 47 MB). The device tool
# carries at most 64 MiB per call: name .gpu-deps in `carry` for the build
# call and .gpu-deps-tests for the call that runs those stages (what the
# build left on the machine stays there between calls; docs/gpu.md, "The GPU
# check (tools/gpu-check.sh)").
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu-deps .gpu-deps-tests

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

# The adapters' GPU tests (fsdp.torch with Hugging Face GPT-2) need
# transformers, which the GPU machine's Python lacks: its wheels and those of
# its dependencies that such a machine may lack (torch and numpy are there),
# pinned as the CPU venv pins them, for the machine's Python (3.12 unless
# GPU_PY says otherwise), unzipped there by gpu-check's python stage.
rm -rf .gpu-deps-tests/py-wheels
"${pip[@]}" download -q --disable-pip-version-check --only-binary=:all: --no-deps --dest .gpu-deps-tests/py-wheels \
  --python-version "${GPU_PY:-3.12}" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  "$(grep -E '^transformers==' bindings/python/tests/requirements-frameworks.txt)" \
  huggingface-hub tokenizers safetensors regex tqdm pyyaml filelock fsspec requests urllib3 idna certifi \
  charset-normalizer typing-extensions packaging hf-xet

# A Go toolchain for gpu-check's go stage (that machine has none): Debian's
# golang (this machine's version), trimmed to what `go test` with cgo needs
# (the go command, the compiler, assembler, linker, cgo, vet; the standard
# library's sources without tests; no prebuilt packages: go builds them into
# its cache there), as one tar.xz that fits the device tool's carry limit.
gover=$(apt-cache policy golang-go | sed -n 's/.*Candidate: [0-9]*:\([0-9]*\.[0-9]*\).*/\1/p')
gotmp=$(mktemp -d)
(cd "$gotmp" && apt-get download "golang-$gover-go" "golang-$gover-src" >/dev/null)
for d in "$gotmp"/*.deb; do dpkg-deb -x "$d" "$gotmp/root"; done
lib=$gotmp/root/usr/lib/go-$gover
mkdir -p "$gotmp/go/pkg/tool/linux_amd64"
cp -a "$lib/VERSION" "$lib/bin" "$gotmp/go/"
for t in asm buildid cgo compile link pack vet test2json; do cp "$lib/pkg/tool/linux_amd64/$t" "$gotmp/go/pkg/tool/linux_amd64/"; done
cp -aL "$lib/pkg/include" "$gotmp/go/pkg/include"
cp -aL "$lib/src" "$gotmp/go/src"
find "$gotmp/go/src" -name testdata -type d -prune -exec rm -rf {} +
find "$gotmp/go/src" -name '*_test.go' -delete
tar -C "$gotmp" -cJf .gpu-deps-tests/go.tar.xz go
rm -rf "$gotmp"
ls -la .gpu-deps .gpu-deps/wheels .gpu-deps-tests/py-wheels
du -sh .gpu-deps
