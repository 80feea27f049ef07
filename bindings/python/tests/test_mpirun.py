# test_mpirun.py - under mpirun each process is one rank: run_ranks calls fn(launcher rank, None) once.
import json
import os
import shutil
import subprocess
import sys

import pytest

import fsdp

SCRIPT = """
import json, os, sys
import fsdp, numpy as np
out_dir = sys.argv[1]
def fn(rank, group):
    assert group is None
    with fsdp.Context(fsdp.Config(sharding="FULL_SHARD", optimizer="sgd", lr=1.0, timeout_s=20)) as ctx:
        assert ctx.rank == rank and ctx.world_size == 2
        u = ctx.register_unit("u", {"w": (5,)})
        u.set_values(0, np.zeros(5))
        with u.forward():
            pass
        with u.backward():
            u.grad(0)[...] += rank + 1
        ctx.step()
        # One file per rank: mpirun may interleave the two processes' stdout mid-line.
        with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
            json.dump(u.gather(0).tolist(), f)
        ctx.finalize()
fsdp.run_ranks(2, fn)
"""


@pytest.mark.skipif(shutil.which("mpirun") is None or "mpi" not in fsdp.build_info().split("comms=")[-1],
                    reason="needs mpirun and a libfsdp built with MPI")
def test_mpirun_two_processes(tmp_path):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               FSDP_LIBRARY=fsdp.LIB_PATH, PYTHONPATH=os.path.dirname(os.path.dirname(fsdp.__file__)))
    r = subprocess.run(["mpirun", "--oversubscribe", "-np", "2", sys.executable, "-c", SCRIPT, str(tmp_path)],
                       capture_output=True, text=True, timeout=90, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    # SGD, lr 1, w0 = 0: w = -(mean of the two ranks' grads 1 and 2) = -1.5 on every rank.
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.json") as f:
            assert json.load(f) == [-1.5] * 5, (rank, r.stdout + r.stderr)
