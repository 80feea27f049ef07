#!/usr/bin/env bash
# test_python.sh - the Python binding as a user gets it, then its framework adapters.
#
# 1. A fresh venv (build/pyvenv, made anew each run) with numpy and pytest only, and the package built
#    from this checkout (`pip wheel ./bindings/python`: scikit-build-core builds libfsdp with CMake and
#    ships it inside): every test in bindings/python/tests but the adapters', and the numpy example.
#    `import fsdp` needs nothing more than numpy.
# 2. The adapters (fsdp.torch, fsdp.jax) against their frameworks' own unsharded runs, in a venv with
#    torch, transformers, JAX and safetensors from PyPI, kept between runs (tools/frameworks_venv.sh);
#    the same wheel goes into it. Where it cannot be made (no PyPI), the adapter
#    tests run in the first venv, where each skips saying why, and the skips are counted below.
#
# Usage: tools/test_python.sh
#   An argument (the library path that callers used to pass) is accepted and ignored.
# Needs python3 with venv, a C++ compiler, CMake >= 3.25, the libraries tools/deps.sh installs, PyPI.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [[ $# -gt 0 ]]; then
  echo "test_python.sh: ignoring '$*': the tests use the libfsdp built into the installed package" >&2
fi
unset FSDP_LIBRARY
pipq() { "$1" -m pip install -q --disable-pip-version-check "${@:2}"; }
adapters=(test_torch_adapter.py test_torch_idioms.py test_jax_adapter.py)
present=()
for t in "${adapters[@]}"; do [[ -f bindings/python/tests/$t ]] && present+=("$t"); done

venv="$root/build/pyvenv"
rm -rf "$venv" "$root/build/wheel"
python3 -m venv "$venv"
py="$venv/bin/python"
pipq "$py" numpy pytest
echo "== pip wheel ./bindings/python (builds libfsdp)"
start=$SECONDS
"$py" -m pip wheel -q --disable-pip-version-check --no-deps -w "$root/build/wheel" ./bindings/python
wheel="$(ls "$root"/build/wheel/fsdp-*.whl)"
pipq "$py" "$wheel"
echo "   built and installed in $((SECONDS - start)) s"
ignore=()
for t in "${present[@]}"; do ignore+=(--ignore="$t"); done
cd "$root/bindings/python/tests"  # not bindings/python: 'import fsdp' must find the installed package
"$py" -m pytest -q -p no:cacheprovider "${ignore[@]}" .
cd "$root"
echo "== examples/python/train_mlp.py --ranks 4 --steps 20 --check"
"$py" examples/python/train_mlp.py --ranks 4 --steps 20 --check

# srun as a launcher: a one-node Slurm started here runs `srun -n 4` of the C and Python examples, which
# must train as a world of 4 with mpirun -np 4's losses (tests/run_slurm.py; 77: skipped, with its reason).
echo "== srun -n 4 of the examples on a Slurm started here (tests/run_slurm.py)"
rc=0
"$py" tests/run_slurm.py "$root/build/default/examples/c/train_mlp" examples/python/train_mlp.py \
  "$root/build/slurm_test" "$py" || rc=$?
if [[ $rc -eq 77 ]]; then
  echo "   SKIPPED (reason above)"
elif [[ $rc -ne 0 ]]; then
  exit "$rc"
fi

echo "== the framework adapters (${present[*]})"
fw="${FSDP_FRAMEWORKS_VENV:-$HOME/.cache/libfsdp/frameworks-venv}"
fw_ok=1
if ! tools/frameworks_venv.sh; then
  fw_ok=0
  echo "   the adapter tests run without their frameworks and skip" >&2
fi
cd "$root/bindings/python/tests"
if [[ $fw_ok == 1 ]]; then
  pipq "$fw/bin/python" --force-reinstall --no-deps "$wheel"
  fpy="$fw/bin/python"
else
  fpy="$py"
fi
log="$root/build/adapter-tests.log"
set +e
"$fpy" -m pytest -q -p no:cacheprovider -rs "${present[@]}" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
cd "$root"
[[ $rc == 0 ]] || { echo "test_python.sh: the adapter tests failed" >&2; exit "$rc"; }
skipped="$(grep -Eo '[0-9]+ skipped' "$log" | tail -1 | cut -d' ' -f1 || true)"
echo "   adapter tests skipped: ${skipped:-0} (each with its reason above)"
if [[ $fw_ok == 1 ]]; then
  for ex in examples/python/torch_gpt2.py examples/python/jax_mlp.py; do
    [[ -f $ex ]] || continue
    echo "== $ex --ranks 2 --check"
    "$fpy" "$ex" --ranks 2 --steps 10 --check
  done
fi
echo "test_python.sh: OK"
