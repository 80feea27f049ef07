# test_example.py - examples/python/train_mlp.py as a user runs it: flags, --save/--resume across rank counts,
# --check, and under mpirun rank 0 alone printing every rank's lines in order.
import os
import re
import shutil
import subprocess
import sys

import pytest

import fsdp

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples", "python",
                       "train_mlp.py")
ROW = re.compile(r"^\s*(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s*$")  # step, loss, grad norm
MPI_ENV = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def run(*args, launcher=(), check=True):
    r = subprocess.run([*launcher, sys.executable, EXAMPLE, *map(str, args)], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, **MPI_ENV))
    if check:
        assert r.returncode == 0, f"{args}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def losses(stdout):
    """{step: loss} of the printed rows."""
    return {int(m.group(1)): float(m.group(2)) for m in map(ROW.match, stdout.splitlines()) if m}


def test_save_at_4_ranks_resume_at_2(tmp_path):
    ck = tmp_path / "ck"
    saved = losses(run("--ranks", 4, "--steps", 10, "--save", ck).stdout)
    assert sorted(saved) == [1, 10] and saved[10] < saved[1]
    out = run("--ranks", 2, "--steps", 2, "--resume", ck).stdout
    assert "resumed from %s (saved after step 10 by 4 ranks)" % ck in out
    resumed = losses(out)
    assert sorted(resumed) == [11, 12], out  # the step count goes on from the checkpoint
    # The first resumed loss goes on from the saved run's last one (a little lower: one more update), far from
    # the loss of a fresh start; and two more steps land where an uninterrupted 12-step run does.
    assert saved[10] * 0.7 < resumed[11] < saved[10], (saved, resumed)
    assert resumed[11] < 0.5 * saved[1]
    straight = losses(run("--ranks", 4, "--steps", 12).stdout)
    assert resumed[12] == pytest.approx(straight[12], rel=1e-4), (resumed, straight)


def test_flags_and_check(tmp_path):
    r = run("--ranks", 2, "--steps", 3, "--dtype", "bf16", "--sharding", "SHARD_GRAD_OP", "--check")
    assert "over 2 thread-ranks, SHARD_GRAD_OP, param_dtype bf16" in r.stdout
    assert "check passed: the loss fell" in r.stdout
    assert re.search(r"^rank 1 of 2 +\d+\.\d{3}", r.stdout, re.M), r.stdout  # memory in MiB
    for bad, msg in [(("--ranks", 3), "must divide the batch"), (("--steps", 1, "--check"), ">= 2 with --check"),
                     (("--resume", tmp_path), "no libfsdp checkpoint"), (("--dtype", "int8"), "invalid choice"),
                     (("--mp", "bf16"), "unrecognized arguments")]:
        r = run(*bad, check=False)
        assert r.returncode == 2 and msg in r.stderr, (bad, r.stderr)


@pytest.mark.skipif(shutil.which("mpirun") is None or "mpi" not in fsdp.build_info().split("comms=")[-1],
                    reason="needs mpirun and a libfsdp built with MPI")
def test_mpirun_rank0_prints_everything_in_order():
    """Under mpirun the output is the thread run's, line for line (numbers aside): rank 0 prints the header, the
    losses and one memory line per rank in rank order; no other rank prints, so no line is split by another's."""
    threads = run("--ranks", 2, "--steps", 3).stdout
    mpi = run("--steps", 3, launcher=("mpirun", "--oversubscribe", "-np", "2")).stdout

    def shape(text):
        return [re.sub(r"\d+\.\d+", "N", line) for line in text.replace("processes (mpirun or srun)", "thread-ranks").splitlines()]

    assert shape(mpi) == shape(threads), mpi
    mem = [line.split()[1] for line in mpi.splitlines() if line.startswith("rank ")]
    assert mem == ["0", "1"], mpi
    assert losses(mpi)[3] == pytest.approx(losses(threads)[3], rel=1e-5)
