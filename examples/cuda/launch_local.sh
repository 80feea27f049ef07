#!/usr/bin/env bash
# launch_local.sh N PROGRAM [ARGS...] - starts N processes of PROGRAM on this
# host the way torchrun does (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
# MASTER_ADDR=127.0.0.1, a free MASTER_PORT), process r on visible GPU r
# (FSDP_DEVICE=cuda:r: NCCL takes one rank per GPU), and fails if any of them
# fails, or at once when this host has fewer than N visible GPUs.
# launch_local.sh --count-gpus prints how many GPUs the processes can see.
#
# When one process fails, the others are stopped at once: a rank whose peer
# died would otherwise wait in NCCL until its timeout_s (300 s by default,
# CTest's own limit), and CTest would report a time-out instead of the
# failure. SIGTERM and SIGINT (CTest's kill, Ctrl-C) stop them too, so no rank
# is left holding a GPU for the tests that follow. (SIGKILL cannot be caught.)
# Without torchrun; with it: torchrun --nproc-per-node N --no-python PROGRAM ARGS.
set -uo pipefail

# The GPUs CUDA will show these processes: nvidia-smi -L lists every GPU of
# the machine; CUDA_VISIBLE_DEVICES (indices or GPU-/MIG- UUIDs, as CUDA reads
# it: up to the first entry that names no GPU) narrows that list, and CUDA
# numbers what is left from 0.
visible_gpus() {
  local listing total n=0 e
  listing=$(nvidia-smi -L 2>/dev/null) || { echo 0; return; }
  total=$(grep -c '^GPU' <<<"$listing")
  if [ -z "${CUDA_VISIBLE_DEVICES+set}" ]; then
    echo "$total"
    return
  fi
  local entries=()
  IFS=',' read -ra entries <<<"$CUDA_VISIBLE_DEVICES"
  for e in "${entries[@]}"; do
    e=${e//[[:space:]]/}
    if [[ $e =~ ^[0-9]+$ ]] && ((10#$e < total)); then
      n=$((n + 1))
    elif [[ $e =~ ^(GPU|MIG)-[0-9A-Fa-f-]+$ ]] && grep -qF "UUID: $e" <<<"$listing"; then
      n=$((n + 1))
    else
      break
    fi
  done
  echo "$n"
}

if [ "${1:-}" = "--count-gpus" ]; then
  visible_gpus
  exit 0
fi
[ $# -ge 2 ] || { echo "usage: $0 N PROGRAM [ARGS...] | $0 --count-gpus" >&2; exit 2; }
n=$1
shift
gpus=$(visible_gpus)
if [ "$gpus" -lt "$n" ]; then
  echo "launch_local.sh: $n processes need $n GPUs (NCCL takes one rank per GPU); this machine has $gpus" \
       "visible${CUDA_VISIBLE_DEVICES+ (CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES)}" >&2
  exit 1
fi
port=${MASTER_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

# Each rank runs in a process group of its own (job control), so that
# stopping it stops whatever it started too.
set -m
pids=()
# Asks the ranks still running to stop, then kills those that do not within 10 s.
stop_ranks() {
  local p alive i
  [ ${#pids[@]} -gt 0 ] || return 0
  kill -TERM -- "${pids[@]/#/-}" 2>/dev/null
  for ((i = 0; i < 20; i++)); do
    alive=0
    for p in "${pids[@]}"; do kill -0 -- "-$p" 2>/dev/null && alive=1; done
    [ $alive -eq 0 ] && return 0
    sleep 0.5
  done
  kill -KILL -- "${pids[@]/#/-}" 2>/dev/null
  return 0
}
trap stop_ranks EXIT
trap 'echo "launch_local.sh: stopped by SIGTERM; stopping the ranks" >&2; exit 143' TERM
trap 'echo "launch_local.sh: interrupted; stopping the ranks" >&2; exit 130' INT

declare -A rank_of
for ((r = 0; r < n; r++)); do
  RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    FSDP_DEVICE=cuda:$r "$@" &
  pids+=($!)
  rank_of[$!]=$r
done
rc=0
for ((left = n; left > 0; left--)); do
  done_pid=
  if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= 501)); then wait -n -p done_pid; else wait -n; fi
  status=$?
  if [ $status -ne 0 ] && [ $rc -eq 0 ]; then
    rc=$status
    echo "launch_local.sh: rank ${rank_of[$done_pid]:-?} exited with status $status; stopping the other ranks" >&2
    stop_ranks
  fi
done
pids=()
exit $rc
