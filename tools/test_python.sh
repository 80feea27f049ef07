#!/usr/bin/env bash
# test_python.sh - the Python binding as a user gets it: a fresh venv (build/pyvenv, made anew each run),
# `pip install ./bindings/python` (builds libfsdp with CMake through scikit-build-core and ships it inside
# the package), then the tests in bindings/python/tests and the example, against the installed package
# and the libfsdp.so inside it (FSDP_LIBRARY is unset).
# Usage: tools/test_python.sh
#   An argument (the library path that callers used to pass) is accepted and ignored.
# Needs python3 with venv, a C++ compiler, CMake >= 3.25 and the libraries tools/deps.sh installs, and
# PyPI (numpy, pytest; scikit-build-core for the build).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [[ $# -gt 0 ]]; then
  echo "test_python.sh: ignoring '$*': the tests use the libfsdp built into the installed package" >&2
fi
unset FSDP_LIBRARY
venv="$root/build/pyvenv"
rm -rf "$venv"
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check numpy pytest
echo "== pip install ./bindings/python (builds libfsdp)"
start=$SECONDS
"$py" -m pip install -q --disable-pip-version-check ./bindings/python
echo "   installed in $((SECONDS - start)) s"
cd "$root/bindings/python/tests"  # not bindings/python: 'import fsdp' must find the installed package
"$py" -m pytest -q -p no:cacheprovider .
cd "$root"
echo "== examples/python/train_mlp.py --ranks 4 --steps 20 --check"
"$py" examples/python/train_mlp.py --ranks 4 --steps 20 --check
echo "test_python.sh: OK"
