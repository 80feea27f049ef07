#!/usr/bin/env bash
# Installs what building and testing libfsdp needs, from Debian's packages,
# only when something is missing (a fresh machine of this kind has most of it).
set -euo pipefail
missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
command -v make >/dev/null || missing+=(make)
command -v nm >/dev/null || missing+=(binutils)
command -v pkg-config >/dev/null || missing+=(pkg-config)
# Compiler cache: CMake uses it when present (FSDP_CCACHE), so rebuilds on a
# machine that keeps ~/.cache/ccache take seconds.
command -v ccache >/dev/null || missing+=(ccache)
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
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
