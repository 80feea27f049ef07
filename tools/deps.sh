#!/usr/bin/env bash
# Installs what building and testing libfsdp needs, from Debian's packages,
# only when something is missing (a fresh machine of this kind has most of it).
# Where the CUDA toolkit is, also fetches cudnn-frontend's headers (below).
#   tools/deps.sh                          everything
#   tools/deps.sh --cudnn-frontend DIR     only cudnn-frontend's headers, into DIR/include
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# cudnn-frontend: NVIDIA's header-only C++ API of cuDNN, through which the GPU
# GPT (examples/gpt/cuda) runs cuDNN's fused attention. It is no Debian
# package; its headers come from PyPI's wheel nvidia-cudnn-frontend (this
# version, checked against this hash), unpacked into DIR/include. DIR is
# build/_deps/cudnn-frontend here (git-ignored; CMake looks there), and
# .gpu-deps/cudnn-frontend for a GPU machine without a registry (tools/gpu-deps.sh).
cudnn_frontend_version=1.32.0
cudnn_frontend_sha256=c6006556017a4d1c914c52a556c71b1267f2d6a0500f742e7b4edef539878df0
fetch_cudnn_frontend() {
  local dest=$1 tmp
  [ "$(cat "$dest/VERSION" 2>/dev/null)" = "$cudnn_frontend_version" ] && return 0
  echo "fetching cudnn-frontend $cudnn_frontend_version's headers into $dest"
  tmp=$(mktemp -d)
  local pip=(python3 -m pip)
  if ! python3 -m pip --version >/dev/null 2>&1; then  # Debian's python3 has no pip: a venv's
    python3 -m venv "$tmp/venv"
    pip=("$tmp/venv/bin/python" -m pip)
  fi
  echo "nvidia-cudnn-frontend==$cudnn_frontend_version --hash=sha256:$cudnn_frontend_sha256" >"$tmp/requirements.txt"
  # The one wheel of that hash (any wheel's headers are the same): its tags, pinned.
  "${pip[@]}" download -q --disable-pip-version-check --no-deps --require-hashes --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --python-version 3.11 --implementation cp --abi cp311 \
    --dest "$tmp" -r "$tmp/requirements.txt"
  rm -rf "$dest"
  mkdir -p "$dest"
  python3 -c '
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("include/")])
' "$tmp"/nvidia_cudnn_frontend-*.whl "$dest"
  echo "$cudnn_frontend_version" >"$dest/VERSION"
  rm -rf "$tmp"
}
if [ "${1:-}" = "--cudnn-frontend" ]; then
  [ $# -eq 2 ] || { echo "usage: $0 [--cudnn-frontend DIR]" >&2; exit 2; }
  fetch_cudnn_frontend "$2"
  exit 0
fi

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
command -v make >/dev/null || missing+=(make)
command -v nm >/dev/null || missing+=(binutils)
command -v pkg-config >/dev/null || missing+=(pkg-config)
# Compiler cache: CMake uses it when present (FSDP_CCACHE), so rebuilds on a
# machine that keeps ~/.cache/ccache take seconds.
command -v ccache >/dev/null || missing+=(ccache)
# LLVM's linker: CMake links with it where it works (FSDP_LLD), twice as fast
# as GNU ld; ccache caches compiles, not links.
command -v ld.lld >/dev/null || missing+=(lld)
command -v python3 >/dev/null || missing+=(python3)
# The Python binding's tests run in a venv (numpy, pytest and scikit-build-core from PyPI).
python3 -c "import venv, ensurepip" 2>/dev/null || missing+=(python3-venv)
# The Go binding (cgo, standard library only).
command -v go >/dev/null || missing+=(golang-go)
[ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
[ -d /usr/include/benchmark ] || missing+=(libbenchmark-dev)
# Checkpoints: JSON metadata and safetensors headers, CRC-32 checksums.
[ -f /usr/include/nlohmann/json.hpp ] || missing+=(nlohmann-json3-dev)
[ -f /usr/include/zlib.h ] || missing+=(zlib1g-dev)
[ -f /usr/include/libdeflate.h ] || missing+=(libdeflate-dev)
# Open MPI: the mpi communicator and its tests (mpirun -np 2 and 4).
command -v mpirun >/dev/null || missing+=(openmpi-bin)
command -v mpicc >/dev/null || missing+=(libopenmpi-dev)
# The locale tests build a decimal-comma locale (de_DE) with localedef.
[ -f /usr/share/i18n/locales/de_DE ] || missing+=(locales)
# OpenBLAS: the sgemm of the engine-overhead benchmark (benchmarks/bench_step.cpp);
# without it that benchmark alone is not built.
pkg-config --exists openblas 2>/dev/null || missing+=(libopenblas-dev)
# The ABI check (tools/check_abi.sh, docs/abi.md): libabigail's abidw and abidiff.
command -v abidiff >/dev/null || missing+=(abigail-tools)
# srun as a launcher, on a Slurm the test starts for one node (tests/run_slurm.py).
command -v slurmctld >/dev/null || missing+=(slurmctld)
command -v slurmd >/dev/null || missing+=(slurmd)
command -v srun >/dev/null || missing+=(slurm-client)
command -v munged >/dev/null || [ -x /usr/sbin/munged ] || missing+=(munge)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
# The GPU GPT's attention (examples/gpt/cuda) needs cudnn-frontend's headers
# beside the toolkit's cuDNN; without the toolkit nothing CUDA is built.
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
  fetch_cudnn_frontend "$root/build/_deps/cudnn-frontend"
fi
