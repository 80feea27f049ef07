#!/usr/bin/env python3
"""srun as a launcher, on a real Slurm: starts munged, slurmctld and slurmd
for one node on this machine (Debian's packages; a minimal slurm.conf
written here, cgroup-free plugins: proctrack/linuxproc, task/none), runs
`srun -n 4 --mpi=pmix` of the C example (train_mlp) and of the Python one
(examples/python/train_mlp.py), and checks that each trains as a world of 4
(its table names ranks 0-3 of 4) with, step for step, the same losses as the
same program under `mpirun -np 4`. Stops every daemon it started. Exits 77
(CTest: skipped) with the reason when Slurm is not installed or its daemons
do not come up here.

usage: run_slurm.py TRAIN_MLP PYTHON_EXAMPLE WORKDIR [PYTHON]
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

SKIP = 77
STEPS = "12"


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(SKIP)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(text):
    """The (step, loss) rows of an example's table, and the ranks it names."""
    rows = re.findall(r"^\s*(?:step\s+)?(\d+)\s+(?:loss\s+)?(\d+\.\d+)(?:\s+\d+\.\d+)?\s*$", text, re.M)
    ranks = sorted(set(re.findall(r"rank (\d+) of (\d+)", text)))
    return rows, ranks


def run(cmd, env, what):
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    if p.returncode != 0:
        sys.exit(f"{what} failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout}")
    return p.stdout


def main():
    train_mlp, py_example, work = sys.argv[1:4]
    python = sys.argv[4] if len(sys.argv) > 4 else sys.executable
    tools = {t: shutil.which(t) or shutil.which(t, path="/usr/sbin:/sbin") for t in
             ("munged", "slurmctld", "slurmd", "srun", "sinfo", "mpirun")}
    missing = [t for t, p in tools.items() if p is None]
    if missing:
        skip("not installed: " + ", ".join(missing) + " (apt-get install slurmctld slurmd slurm-client munge)")
    shutil.rmtree(work, ignore_errors=True)
    for d in ("state", "spool", "log", "munge"):
        os.makedirs(os.path.join(work, d))
    host = socket.gethostname().split(".")[0]
    key = os.path.join(work, "munge", "munge.key")
    with open(key, "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(key, 0o400)
    sock = os.path.join(work, "munge", "munge.socket")
    conf = os.path.join(work, "slurm.conf")
    with open(conf, "w") as f:
        f.write(f"""ClusterName=libfsdp-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
StateSaveLocation={work}/state
SlurmdSpoolDir={work}/spool
SlurmctldPidFile={work}/slurmctld.pid
SlurmdPidFile={work}/slurmd.pid
SlurmctldLogFile={work}/log/slurmctld.log
SlurmdLogFile={work}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/linear
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
NodeName={host} CPUs=4 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
""")
    env = dict(os.environ, SLURM_CONF=conf)
    daemons = []
    try:
        daemons.append(subprocess.Popen([tools["munged"], "--foreground", "--force", f"--key-file={key}",
                                         f"--socket={sock}", f"--pid-file={work}/munge/munged.pid",
                                         f"--log-file={work}/log/munged.log", f"--seed-file={work}/munge/seed"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        for _ in range(50):
            if os.path.exists(sock):
                break
            time.sleep(0.1)
        else:
            skip("munged did not start (see its log)")
        daemons.append(subprocess.Popen([tools["slurmctld"], "-D", "-f", conf], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        daemons.append(subprocess.Popen([tools["slurmd"], "-D", "-f", conf], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        state = ""
        for _ in range(60):
            time.sleep(0.5)
            p = subprocess.run([tools["sinfo"], "-h", "-o", "%T"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
            state = p.stdout.strip()
            if state.startswith("idle"):
                break
        else:
            logs = ""
            for name in ("slurmctld.log", "slurmd.log"):
                path = os.path.join(work, "log", name)
                if os.path.exists(path):
                    logs += f"--- {name}\n" + open(path).read()[-2000:]
            skip(f"the node did not become idle (sinfo: {state!r})\n{logs}")
        print(f"slurm up: node {host} {state}")
        mpi_env = dict(env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", FSDP_LOG_LEVEL="info")
        programs = [("C", [train_mlp, "--steps", STEPS]),
                    ("Python", [python, py_example, "--steps", STEPS])]
        for name, cmd in programs:
            srun_out = run([tools["srun"], "-n", "4", "--mpi=pmix", "--kill-on-bad-exit=1"] + cmd, mpi_env,
                           f"srun -n 4 ({name})")
            mpi_out = run([tools["mpirun"], "-np", "4", "--oversubscribe"] + cmd, mpi_env, f"mpirun -np 4 ({name})")
            s_rows, s_ranks = losses(srun_out)
            m_rows, m_ranks = losses(mpi_out)
            want = [(str(r), "4") for r in range(4)]
            if s_ranks != want:
                sys.exit(f"{name}: under srun the ranks are {s_ranks}, not 0-3 of 4:\n{srun_out}")
            if "over 4 processes" not in srun_out or srun_out.count("libfsdp ") != 1:
                sys.exit(f"{name}: under srun the example did not run as one job of 4 processes:\n{srun_out}")
            if "launched by srun" not in srun_out:
                sys.exit(f"{name}: rank 0 did not log that srun launched it:\n{srun_out}")
            if not s_rows or s_rows != m_rows:
                sys.exit(f"{name}: the losses differ\nsrun:   {s_rows}\nmpirun: {m_rows}\n{srun_out}\n{mpi_out}")
            print(f"{name}: srun -n 4 trained as ranks 0-3 of 4, losses equal to mpirun -np 4 at steps "
                  f"{', '.join(r[0] for r in s_rows)} ({s_rows[-1][1]} at the last)")
    finally:
        for d in reversed(daemons):
            d.send_signal(signal.SIGTERM)
        for d in reversed(daemons):
            try:
                d.wait(timeout=15)
            except subprocess.TimeoutExpired:
                d.kill()
                d.wait()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
