#!/usr/bin/env bash
# The demo: builds libfsdp and trains an MLP on 4 in-process ranks (FULL_SHARD,
# bf16), printing loss and per-rank memory beside a 1-rank run.
# Extra arguments go to the demo (e.g. --ranks 2 --dtype fp16).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/deps.sh
cmake --preset default >/dev/null
cmake --build --preset default -j"$(nproc)" --target train_mlp
exec build/default/examples/c/train_mlp "$@"
