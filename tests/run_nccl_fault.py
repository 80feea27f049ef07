#!/usr/bin/env python3
"""Runs tests/nccl_fault.cpp as N processes with torchrun's variables (one GPU
each) and checks that every rank but the failing last one reported the
expected error naming what went wrong, within the limit. Exits 77 (CTest's
skip) when this machine has fewer than N GPUs.

usage: run_nccl_fault.py N PROGRAM SCENARIO
"""
import os
import re
import socket
import subprocess
import sys
import time

EXPECT = {
    # scenario: (status every other rank must print, what its message must say, max seconds)
    # Rank 0 names the rank that never connected; the others time out fetching the id or forming NCCL.
    "exit_before_create": ("FSDP_ERR_TIMEOUT", r"rank {last} did not connect|did not form|could not fetch", 60),
    # The watchdog names the collective; the step's own wait for its stream may see the timeout first.
    "stall": ("FSDP_ERR_TIMEOUT", r"all_gather of unit 'block'.*timeout_s|did not finish within timeout_s", 60),
}


def gpus():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU"))


def main():
    n, program, scenario = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if gpus() < n:
        print(f"skipped: {n} NCCL processes need {n} GPUs, this machine has {gpus()}")
        return 77
    status, pattern, limit = EXPECT[scenario]
    last = n - 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    start = time.monotonic()
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FSDP_DEVICE=f"cuda:{r}")
        procs.append(subprocess.Popen([program, scenario], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs, ok = [], True
    for r, p in enumerate(procs[:last]):
        try:
            out, _ = p.communicate(timeout=max(1, limit - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            print(f"rank {r} did not end within {limit} s (a hang)")
            ok = False
        outputs.append(out)
        print(out, end="")
        want = re.compile(rf"rank {r}: {status}: .*({pattern.format(last=last)})")
        if not want.search(out):
            print(f"rank {r}: expected {status} matching {pattern.format(last=last)!r}")
            ok = False
    procs[last].kill()  # the stalled one (or long gone)
    procs[last].communicate()
    print(f"{scenario}: {'ok' if ok else 'FAILED'} in {time.monotonic() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
