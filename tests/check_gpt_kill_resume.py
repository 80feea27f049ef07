#!/usr/bin/env python3
"""train_gpt --snapshot-every resumes by itself after a kill: a run is killed
with SIGKILL after it printed step KILL_AT, the same command is started again,
and it must say that it resumed from the snapshot (at a step at or after the
last one it printed, within 1 s of its start on an idle machine is printed but
not asserted: tests do not assert wall-clock) and then print, for every later
step, the validation loss that the same run uninterrupted prints, to the last
digit, and the same final validation loss. With --save-every a second pair of
runs loses one rank's snapshot after the kill: the rerun resumes from the
async-saved checkpoint in --ckpt instead, and still ends where the
uninterrupted run does.

usage: check_gpt_kill_resume.py TRAIN_GPT WORKDIR
"""
import os
import re
import shutil
import signal
import subprocess
import sys

STEPS, EVERY, KILL_AT = 24, 4, 13
LINE = re.compile(r"^step\s+(\d+)\s+train\s+\S+\s+val\s+(\S+)")


def command(exe, snap, ckpt):
    return [exe, "--ranks", "2", "--resume-ranks", "0", "--steps", str(STEPS), "--print-every", "1",
            "--layers", "2", "--width", "64", "--context", "64", "--batch", "4", "--eval-batches", "1", "--sample", "0", "--snapshot-every", str(EVERY), "--snapshot-dir", snap, "--save-every", "8",
            "--ckpt", ckpt]


def vals(text):
    return {int(m.group(1)): m.group(2) for m in map(LINE.match, text.splitlines()) if m}


def final(text):
    m = re.search(r"validation loss (\S+) nats/byte", text)
    if not m:
        sys.exit("no final validation loss in:\n" + text)
    return m.group(1)


def run(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}")
    return p.stdout


def killed_run(cmd):
    """Starts cmd, kills it (SIGKILL) once it printed step KILL_AT; its output so far."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    out = []
    for line in p.stdout:
        out.append(line)
        m = LINE.match(line)
        if m and int(m.group(1)) >= KILL_AT:
            p.send_signal(signal.SIGKILL)
            break
    p.wait()
    if p.returncode != -signal.SIGKILL:
        sys.exit("the run ended before its kill:\n" + "".join(out))
    return "".join(out)


def check_resumed(text, reference, expect_from, printed_up_to):
    m = re.search(r"resumed at step (\d+) from the (snapshot|checkpoint) in .*?, ([\d.]+) s after the process started",
                  text)
    if not m:
        sys.exit("the rerun did not say it resumed:\n" + text)
    step, source, age = int(m.group(1)), m.group(2), float(m.group(3))
    if source != expect_from:
        sys.exit(f"resumed from the {source}, expected the {expect_from}:\n" + text)
    got = vals(text)
    later = [s for s in got if s > step]
    if not later or max(later) != STEPS:
        sys.exit("the rerun did not train on to the last step:\n" + text)
    for s in later:
        if got[s] != reference[s]:
            sys.exit(f"step {s}: validation loss {got[s]} after the resume, {reference[s]} uninterrupted")
    print(f"resumed from the {source} of step {step} (the killed run had printed step {printed_up_to}), "
          f"{age:.2f} s after the process started; steps {min(later)}-{STEPS} match the uninterrupted run")
    return step


def main():
    exe, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    ref_text = run(command(exe, f"{work}/snap_ref", f"{work}/ck_ref"))
    reference, ref_final = vals(ref_text), final(ref_text)
    if os.path.exists(f"{work}/snap_ref/rank0"):
        sys.exit("a run that ended left its snapshot behind")

    # A kill, then the same command: back from the snapshot.
    cmd = command(exe, f"{work}/snap", f"{work}/ck")
    printed = max(vals(killed_run(cmd)))
    step = check_resumed(run_text := run(cmd), reference, "snapshot", printed)
    if step < printed - EVERY or step > printed:
        sys.exit(f"resumed at step {step}, but the killed run had printed step {printed} (snapshots every {EVERY})")
    if final(run_text) != ref_final:
        sys.exit(f"final validation loss {final(run_text)}, uninterrupted {ref_final}")

    # A kill, one rank's snapshot lost: back from the async-saved checkpoint.
    cmd = command(exe, f"{work}/snap2", f"{work}/ck2")
    printed = max(vals(killed_run(cmd)))
    shutil.rmtree(f"{work}/snap2/rank1")
    step = check_resumed(run_text := run(cmd), reference, "checkpoint", printed)
    if step % 8 != 0 or step > printed:
        sys.exit(f"resumed at step {step} from the checkpoint saved every 8 steps, after step {printed}")
    if final(run_text) != ref_final:
        sys.exit(f"final validation loss {final(run_text)}, uninterrupted {ref_final}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
