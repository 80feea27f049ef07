#!/usr/bin/env bash
# The demo: builds libfsdp and its GPT example, then trains the GPT on 4
# in-process ranks (FULL_SHARD, bf16 params, AdamW), saves a sharded
# checkpoint, resumes it on 2 ranks and samples text (examples/gpt).
# Extra arguments go to train_gpt (e.g. --steps 200, --recompute, --trace
# out.json, --plot DIR; --help lists them). It also builds the MLP example
# (build/default/examples/c/train_mlp) that README's other examples use.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/deps.sh
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=true
cmake --preset default >/dev/null
cmake --build --preset default -j"$(nproc)" --target train_gpt train_mlp
exec build/default/examples/gpt/train_gpt "$@"
