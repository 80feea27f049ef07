#!/usr/bin/env python3
"""Runs tests/mpi_fault.cpp under mpirun and checks that every surviving rank
reported the expected error, that messages name the right rank, and that the
job ended (an error, not a hang) well within the limit.

usage: run_mpi_fault.py MPIEXEC NP PROGRAM SCENARIO
"""
import os
import re
import signal
import subprocess
import sys
import time

EXPECT = {
    # scenario: (status every reporting rank must print, what the message must say, max seconds)
    "early_exit": ("FSDP_ERR_TIMEOUT", r"rank {last}\b", 60),
    "mismatch": ("FSDP_ERR_MISMATCH", r"unit 'b'", 30),
    "wrong_rank": ("FSDP_ERR_INVALID_ARGUMENT", r"pass -1", 30),
    # The others wait in MPI_Init (bounded by timeout_s: the message cannot name the rank, MPI is not up), or
    # pass it and wait for the context's first collective (which names it).
    "exit_before_create": ("FSDP_ERR_TIMEOUT", r"MPI initialisation did not finish|rank {last}\b", 60),
}
# When the rank that never initialises exits after the others entered MPI_Init, Open MPI's mpirun may end the
# job itself, before libfsdp's timeout: also an end, not a hang (docs/launching.md). It says so, except in about
# 1 run in 10 where the job ends as soon (1-2 s) with no message at all; an end before the ranks' timeout_s (5 s
# for this scenario in mpi_fault.cpp) with no report, once the last rank has started, cannot be libfsdp's, so
# that counts too, unless a rank crashed.
LAUNCHER_ENDS = {"exit_before_create": (r'did not call "init" before exiting', 5.0)}
CRASHED = r"exited on signal|Segmentation fault|Sanitizer|core dumped|terminate called"


def main():
    mpiexec, np_, program, scenario = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    status, pattern, limit = EXPECT[scenario]
    pattern = pattern.format(last=np_ - 1)
    t0 = time.monotonic()
    proc = subprocess.Popen([mpiexec, "-np", str(np_), "--oversubscribe", program, scenario],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        print(f"FAIL: the job did not end within {limit} s (hang)\nstdout:\n{out}\nstderr:\n{err}")
        return 1
    run = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    took = time.monotonic() - t0
    print(run.stdout)
    reports = {int(m.group(1)): (m.group(2), m.group(3))
               for m in re.finditer(r"^rank (\d+): (FSDP_\w+): (.*)$", run.stdout, re.M)}
    expected_ranks = range(np_ - 1) if scenario in ("early_exit", "exit_before_create") else range(np_)
    if scenario in LAUNCHER_ENDS and not reports and not re.search(CRASHED, run.stderr):
        message, before_timeout = LAUNCHER_ENDS[scenario]
        started = f"rank {np_ - 1}: exiting before fsdp_ctx_create" in run.stdout  # not mpirun refusing to start
        if started and (re.search(message, run.stdout + run.stderr) or took < before_timeout):
            print(f"mpirun ended the job itself (exit code {run.returncode}) after {took:.1f} s")
            return 0 if run.returncode != 0 else 1
    ok = True
    for r in expected_ranks:
        if r not in reports:
            print(f"FAIL: rank {r} printed no report\nstderr:\n{run.stderr}")
            ok = False
            continue
        got, msg = reports[r]
        if got != status:
            print(f"FAIL: rank {r} got {got}, expected {status}: {msg}")
            ok = False
        elif not re.search(pattern, msg):
            print(f"FAIL: rank {r}'s message does not match /{pattern}/: {msg}")
            ok = False
    if run.returncode == 0:
        print("FAIL: mpirun exited 0, but the job failed")
        ok = False
    print(f"job ended after {took:.1f} s with exit code {run.returncode}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
