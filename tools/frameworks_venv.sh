#!/usr/bin/env bash
# frameworks_venv.sh - the venv in which the Python adapters' tests run against their frameworks (torch,
# transformers, JAX, peft, safetensors from PyPI: bindings/python/tests/requirements-frameworks.txt).
#
# Kept between runs (FSDP_FRAMEWORKS_VENV, by default ~/.cache/libfsdp/frameworks-venv: outside the
# checkout, so that CI's fresh clones reuse it) and reinstalled only when the requirements change; prints
# its path's state and exits 0 when it is ready, 1 when it could not be made (no PyPI).
#
# Holds a lock on the venv while it works, so that two callers do not build it at once: .ci/run starts it
# in the background before the first build, so that on a fresh machine the downloads overlap the
# compiler, and tools/test_python.sh calls it again when it needs the venv (waiting for the first, then
# finding it made).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
fw="${FSDP_FRAMEWORKS_VENV:-$HOME/.cache/libfsdp/frameworks-venv}"
req="$root/bindings/python/tests/requirements-frameworks.txt"
stamp="$fw/.requirements.sha256"
want="$(sha256sum "$req" | cut -d' ' -f1)"
pipq() { "$1" -m pip install -q --disable-pip-version-check "${@:2}"; }

mkdir -p "$(dirname "$fw")"
exec 9>"$fw.lock"
flock 9
# A changed requirements file is first installed over the kept venv (pip changes only what differs: a
# package added need not download torch again); the venv is made anew only if that fails.
if [[ -x "$fw/bin/python" && "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
  echo "   updating $fw to $req"
  if pipq "$fw/bin/python" -r "$req"; then
    echo "$want" >"$stamp"
  fi
fi
if [[ ! -x "$fw/bin/python" || "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
  echo "   making $fw (torch, transformers, JAX from PyPI: a few minutes once, then reused)"
  start=$SECONDS
  rm -rf "$fw"
  if python3 -m venv "$fw" && pipq "$fw/bin/python" -r "$req"; then
    echo "$want" >"$stamp"
    echo "   made in $((SECONDS - start)) s"
  else
    echo "   could not make the frameworks venv $fw" >&2
    exit 1
  fi
else
  echo "   $fw holds $req"
fi
