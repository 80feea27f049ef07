#!/usr/bin/env bash
# LoRA fine-tuning of the demo's GPT (issue 27; docs/fine-tuning.md): builds
# what the demo builds, makes the base model once (the demo's training,
# exported as safetensors into build/gpt-base; delete it to make it again),
# then freezes it and trains rank-R adapters on every block's qkv, proj, fc
# and fc2 on 4 thread-ranks, and prints per-rank memory beside one step of
# full fine-tuning of the same model.
#
#   tools/lora.sh [R] [train_gpt options...]   (R: the adapters' rank, 8)
#
# e.g. tools/lora.sh 16 --steps 400 --lr 1e-2. Options for the base go in
# FSDP_LORA_BASE_ARGS (e.g. "--steps 200"), and must give the same shape.
set -euo pipefail
cd "$(dirname "$0")/.."
rank=8
if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then rank=$1; shift; fi
base=build/gpt-base
if [ ! -f "$base/model.safetensors" ]; then
  rm -rf "$base"
  echo "== the base model: the demo's training, exported to $base"
  # shellcheck disable=SC2086
  tools/demo.sh --sample 0 --export "$base" ${FSDP_LORA_BASE_ARGS:-}
  echo
fi
tools/deps.sh
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=true
cmake --preset default >/dev/null
cmake --build --preset default -j"$(nproc)" --target train_gpt
echo "== LoRA rank $rank on the frozen base"
exec build/default/examples/gpt/train_gpt --lora "$rank" --base "$base" --steps 200 --print-every 25 "$@"
