#!/usr/bin/env bash
# test_python.sh - builds a venv, installs the Python binding and runs its tests and example against libfsdp.
# Usage: tools/test_python.sh [path/to/libfsdp.so]   (default: $FSDP_LIBRARY, else build/default/src/libfsdp.so)
# Run after the C++ build; needs python3 (with venv) and network access to PyPI for numpy and pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
lib="${1:-${FSDP_LIBRARY:-build/default/src/libfsdp.so}}"
[[ -f "$lib" ]] || { echo "test_python.sh: no library at '$lib'; build the C++ library first (or pass its path)" >&2; exit 2; }
export FSDP_LIBRARY="$(cd "$(dirname "$lib")" && pwd)/$(basename "$lib")"
venv="${FSDP_PYVENV:-$root/build/pyvenv}"
if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check numpy pytest
# A regular (non-editable) install of the package, as a user would do it; tests then import the installed copy.
"$py" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$root/bindings/python"
cd "$root/bindings/python/tests"  # not bindings/python: 'import fsdp' must find the installed package
"$py" -m pytest -q -p no:cacheprovider .
cd "$root"
echo "== examples/python/train_mlp.py --ranks 4 --steps 3"
"$py" examples/python/train_mlp.py --ranks 4 --steps 3
echo "test_python.sh: OK"
