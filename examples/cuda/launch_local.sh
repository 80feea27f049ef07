#!/usr/bin/env bash
# launch_local.sh N PROGRAM [ARGS...] - starts N processes of PROGRAM on this
# host the way torchrun does (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
# MASTER_ADDR=127.0.0.1, a free MASTER_PORT), process r on GPU r
# (FSDP_DEVICE=cuda:r: NCCL takes one rank per GPU), and fails if any of them
# fails, or at once when this host has fewer than N GPUs.
# Without torchrun; with it: torchrun --nproc-per-node N --no-python PROGRAM ARGS.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 N PROGRAM [ARGS...]" >&2; exit 2; }
n=$1
shift
port=${MASTER_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${gpus:-0}" -lt "$n" ]; then
  echo "launch_local.sh: $n processes need $n GPUs (NCCL takes one rank per GPU); this machine has ${gpus:-0}" >&2
  exit 1
fi
pids=()
for ((r = 0; r < n; r++)); do
  RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    FSDP_DEVICE=cuda:$r "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do
  wait "$p" || rc=1
done
exit $rc
