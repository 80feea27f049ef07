#!/usr/bin/env python3
"""The demo's save-and-resume cycle, as docs/checkpoints.md shows it: train 10
steps at 4 ranks and save, resume at 2 ranks for 3 more; the resumed run's
first step (11) must match step 11 of an uninterrupted 4-rank run of 13 steps
(fp32: within 1e-4 relative, the equivalence tests' tolerance with margin for
the different rank count), and be far from a fresh start's loss.

usage: check_demo_resume.py TRAIN_MLP WORKDIR
"""
import re
import shutil
import subprocess
import sys


def losses(out):
    """{step: (loss N ranks, loss 1 rank)} from the demo's loss table."""
    return {int(m.group(1)): (float(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"^\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)$", out, re.M)}


def run(*args):
    p = subprocess.run(list(args), capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"FAIL: {' '.join(args)} exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p.stdout


def main():
    demo, work = sys.argv[1], sys.argv[2]
    ckpt = work + "/demo_resume_ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    common = ["--dtype", "fp32"]
    straight = losses(run(demo, "--ranks", "4", "--steps", "13", *common))  # prints steps 1, 11 and 13
    saved = run(demo, "--ranks", "4", "--steps", "10", "--save", ckpt, *common)
    if "saved a sharded checkpoint of step 10" not in saved:
        sys.exit("FAIL: the demo did not report its checkpoint\n" + saved)
    out = run(demo, "--ranks", "2", "--steps", "3", "--resume", ckpt, "--check", *common)
    print(out)
    resumed = losses(out)
    if "resumed from" not in out or 11 not in resumed:
        sys.exit("FAIL: the resumed run does not start at step 11")
    got, want, fresh = resumed[11][0], straight[11][0], straight[1][0]
    print(f"step 11: resumed at 2 ranks {got:.6f}, uninterrupted at 4 ranks {want:.6f}, a fresh start {fresh:.6f}")
    if abs(got - want) > 1e-4 * want or abs(resumed[11][1] - want) > 1e-4 * want:
        sys.exit("FAIL: the resumed loss does not continue the saved run")
    if not abs(fresh - want) > 10 * 1e-4 * want:
        sys.exit("FAIL: the test cannot tell a resume from a fresh start")
    print("OK")


if __name__ == "__main__":
    main()
