#!/usr/bin/env python3
"""One rank of an mpirun job dies in the middle of a snapshot; a new job
restores from the snapshots: test_async_ckpt's AsyncCkptProcesses tests,
phase 1 (rank 1's process exits at once, _Exit(86), after writing its shard
of the third snapshot: the job must end, not hang) then phase 2 (restores
step 2 bitwise and trains on exactly).

usage: run_mpi_snapshot_kill.py MPIEXEC TEST_BINARY WORKDIR
"""
import os
import shutil
import subprocess
import sys

mpiexec, binary, work = sys.argv[1:4]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
env = dict(os.environ, FSDP_TEST_CKPT_DIR=work, FSDP_TEST_CONFIG_FROM_ENV="1")
base = [mpiexec, "-n", "2", "--oversubscribe", binary, "--gtest_color=no"]

p = subprocess.run(base + ["--gtest_filter=AsyncCkptProcesses.SnapshotsUntilRankOneDies"], env=env,
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
print(p.stdout)
if p.returncode == 0:
    sys.exit("phase 1: the job did not fail, though rank 1 died")
if "simulated crash" not in p.stdout:
    sys.exit("phase 1: rank 1 did not die where told to")
markers = [os.path.join(work, "shm", f"rank{r}", "snapshot.json") for r in (0, 1)]
if not all(os.path.exists(m) for m in markers):
    sys.exit("phase 1: a rank has no snapshot marker")

p = subprocess.run(base + ["--gtest_filter=AsyncCkptProcesses.RestoresAfterRankOneDied"], env=env,
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
print(p.stdout)
if p.returncode != 0 or "[  PASSED  ] 1 test" not in p.stdout:
    sys.exit("phase 2 failed")
shutil.rmtree(work, ignore_errors=True)
