# test_mpirun.py - under mpirun each process is one rank: run_ranks calls fn(launcher rank, None) once.
import os
import shutil
import subprocess
import sys

import pytest

import fsdp

SCRIPT = """
import fsdp, numpy as np
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
        print("rank", rank, "w", u.gather(0).tolist(), flush=True)
        ctx.finalize()
fsdp.run_ranks(2, fn)
"""


@pytest.mark.skipif(shutil.which("mpirun") is None or "mpi" not in fsdp.build_info().split("comms=")[-1],
                    reason="needs mpirun and a libfsdp built with MPI")
def test_mpirun_two_processes():
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               FSDP_LIBRARY=fsdp.LIB_PATH, PYTHONPATH=os.path.dirname(os.path.dirname(fsdp.__file__)))
    r = subprocess.run(["mpirun", "--oversubscribe", "-np", "2", sys.executable, "-c", SCRIPT],
                       capture_output=True, text=True, timeout=90, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in (0, 1):
        assert f"rank {rank} w [-1.5, -1.5, -1.5, -1.5, -1.5]" in r.stdout, r.stdout + r.stderr
