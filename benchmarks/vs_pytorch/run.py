#!/usr/bin/env python3
"""libfsdp against PyTorch FSDP2 on the same small GPT: runs both, prints one Markdown table.

Rows (one run each, in this order):
  pytorch  single   torch_gpt.py --mode single                     (one process, no FSDP)
  pytorch  fsdp2    torchrun --standalone --nproc_per_node N torch_gpt.py --mode fsdp2
  libfsdp  VARIANT  train_gpt ... --bench-json F                   (one process, world 1; the first variant)
  libfsdp  VARIANT  mpirun -np N --bind-to none train_gpt ...      (one row per --libfsdp-variant)
Every run writes one JSON object (the fields are in README.md); this script reads them and
prints the table (and writes it, with the machine and the commands, to --out).

  run.py [--world 2] [--layers 6 --width 384 --heads 6 --context 256 --batch 8 --steps 10]
         [--dtype bf16|fp32] [--device cpu|cuda] [--train-gpt PATH]
         [--libfsdp-variant NAME:ARGS ...] [--torch-only | --libfsdp-only] [--out FILE.md]
         [--json-dir DIR] [--venv DIR | --python PY] [--pip-arg ARG ...] [--setup-only]
         [--env KEY=VALUE ...] [--timeout S]

The PyTorch rows run in a venv (default benchmarks/vs_pytorch/.venv) that this script makes
and fills with `pip install torch numpy` when it lacks torch. Standard library only.
"""
import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DEFAULT_BIN = os.path.join(ROOT, "build", "default", "examples", "gpt", "train_gpt")
MiB = 2.0 ** 20


def log(msg):
    print(f"run.py: {msg}", flush=True)


# ---- environment -------------------------------------------------------------------------------

def usable_cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_info(device):
    """A line about this machine: CPU model, cores, memory (and GPUs with --device cuda)."""
    model, sockets, cores_per_socket, threads_per_core = platform.processor() or "unknown CPU", None, None, None
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, val = line.partition(":")
            key, val = key.strip(), val.strip()
            if key == "Model name":
                model = val
            elif key == "Socket(s)":
                sockets = val
            elif key == "Core(s) per socket":
                cores_per_socket = val
            elif key == "Thread(s) per core":
                threads_per_core = val
    except (OSError, subprocess.SubprocessError):
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    parts = [model, f"{usable_cores()} usable cores (os.cpu_count {os.cpu_count()}"
             + (f"; {sockets} socket(s) x {cores_per_socket} core(s) x {threads_per_core} thread(s)"
                if cores_per_socket else "") + ")"]
    if mem:
        parts.append(f"{mem / 2**30:.1f} GiB memory")
    if device == "cuda":
        try:
            gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout.strip()
            parts.append("GPUs: " + ("; ".join(gpus.splitlines()) if gpus else "none found by nvidia-smi"))
        except (OSError, subprocess.SubprocessError):
            parts.append("GPUs: nvidia-smi not found")
    parts.append(f"{platform.system()} {platform.release()}")
    return ", ".join(parts)


def ensure_venv(args):
    """The Python that runs torch_gpt.py: --python, or the venv's (made and filled when needed)."""
    if args.python:
        py = args.python
    else:
        venv = os.path.abspath(args.venv)
        py = os.path.join(venv, "bin", "python")
        if not os.path.exists(py):
            log(f"making the venv {venv}")
            subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    probe = [py, "-c", "import torch, numpy; print(torch.__version__)"]
    r = subprocess.run(probe, capture_output=True, text=True)
    if r.returncode != 0:
        if args.python:
            sys.exit(f"run.py: {py} cannot import torch and numpy:\n{r.stderr.strip()}")
        # Plain PyPI torch on Linux x86_64 is the CUDA build (it pulls the nvidia-* wheels, some
        # GB); it runs on the CPU all the same. PyPI has no CPU-only x86_64 wheel: for one, point
        # pip at PyTorch's own CPU index with --pip-arg.
        cmd = [py, "-m", "pip", "install", "--progress-bar", "off", *args.pip_arg, "torch", "numpy"]
        log("installing torch and numpy into the venv (a large download): " + shlex.join(cmd))
        subprocess.run(cmd, check=True)
        r = subprocess.run(probe, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"run.py: torch still does not import in {py}:\n{r.stderr.strip()}")
    version = r.stdout.strip().splitlines()[-1]
    log(f"torch {version} ({py})")
    return py, version


# ---- runs --------------------------------------------------------------------------------------

def parse_kv(items, what):
    out = {}
    for item in items:
        key, eq, val = item.partition("=")
        if not eq or not key:
            sys.exit(f"run.py: {what} wants KEY=VALUE, got {item!r}")
        out[key] = val
    return out


def parse_variants(items):
    variants = []
    for item in items or ["default:"]:
        name, colon, rest = item.partition(":")
        if not colon or not name:
            sys.exit(f"run.py: --libfsdp-variant wants NAME:ARGS (ARGS may be empty), got {item!r}")
        if any(v[0] == name for v in variants):
            sys.exit(f"run.py: two --libfsdp-variant named {name!r}")
        variants.append((name, shlex.split(rest)))
    return variants


def run_one(tag, cmd, env, json_path, logdir, timeout):
    """Runs cmd, its output shown and kept in logdir/tag.log; the JSON it wrote, or None."""
    log(f"[{tag}] {shlex.join(cmd)}")
    if os.path.exists(json_path):
        os.remove(json_path)
    t0 = time.time()
    with open(os.path.join(logdir, tag + ".log"), "w") as logf:
        try:
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True)
        except OSError as e:
            log(f"[{tag}] could not start: {e}")
            return None, f"could not start: {e}"
        timed_out = []

        def kill():  # the launcher and the ranks it started (its own session)
            timed_out.append(True)
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            for line in p.stdout:
                sys.stdout.write(f"  {line}")
                sys.stdout.flush()
                logf.write(line)
            p.wait()
        finally:
            timer.cancel()
        if timed_out:
            log(f"[{tag}] killed after {timeout} s")
            return None, f"timed out after {timeout:g} s"
    if p.returncode != 0:
        log(f"[{tag}] failed with exit status {p.returncode} (log: {os.path.join(logdir, tag + '.log')})")
        return None, f"exit status {p.returncode}"
    if not os.path.exists(json_path):
        log(f"[{tag}] exited 0 but wrote no {json_path}")
        return None, "no JSON written"
    with open(json_path) as f:
        d = json.load(f)
    log(f"[{tag}] done in {time.time() - t0:.1f} s: median step {d['median_step_s'] * 1e3:.1f} ms")
    return d, None


# ---- the table ---------------------------------------------------------------------------------

def fmt(x, spec):
    return "—" if x is None else format(x, spec)


def max_mib(lst):
    vals = [v for v in (lst or []) if v is not None]
    return max(vals) / MiB if vals else None


def ratio(a, b):
    return a / b if a is not None and b else None


def table(rows, device):
    """rows: dicts with framework, variant, world, json (or None and error). Markdown lines."""
    def single_of(r):
        same = [s for s in rows if s["json"] and s["framework"] == r["framework"] and s["world"] == 1]
        exact = [s for s in same if s["variant"] == r["variant"]]
        return (exact or same or [None])[0]

    for r in rows:
        d = r["json"]
        if not d:
            continue
        s = single_of(r)
        r["overhead"] = ratio(d["median_step_s"], s["json"]["median_step_s"]) if s else None
        r["rss_mib"] = max_mib(d.get("peak_rss_bytes"))
    pt = {r["world"]: r for r in rows if r["framework"] == "pytorch" and r["json"]}

    head = ["framework", "variant", "world", "median step s", "in libfsdp s", "tokens/s", "overhead vs own single",
            "peak RSS/rank MiB", "params MiB/rank", "grads MiB/rank", "optim MiB/rank"]
    if device == "cuda":
        head.append("device peak MiB/rank")
    head += ["step time libfsdp/pytorch", "overhead libfsdp/pytorch", "peak RSS libfsdp/pytorch"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + "|"]
    for r in rows:
        d = r["json"]
        if not d:
            cells = [r["framework"], r["variant"], str(r["world"]), f"failed: {r['error']}"]
            cells += [""] * (len(head) - len(cells))
            lines.append("| " + " | ".join(cells) + " |")
            continue
        cells = [r["framework"], r["variant"], str(d["world"]), fmt(d["median_step_s"], ".4f"),
                 fmt(d.get("median_library_s"), ".4f"), fmt(d["tokens_per_s"], ",.0f"), fmt(r["overhead"], ".2f"), fmt(r["rss_mib"], ",.1f"),
                 fmt(max_mib(d.get("params_bytes")), ",.2f"), fmt(max_mib(d.get("grads_bytes")), ",.2f"),
                 fmt(max_mib(d.get("optim_bytes")), ",.2f")]
        if device == "cuda":
            cells.append(fmt(max_mib(d.get("device_peak_bytes")), ",.1f"))
        p = pt.get(d["world"]) if r["framework"] == "libfsdp" else None
        if p:
            cells += [fmt(ratio(d["median_step_s"], p["json"]["median_step_s"]), ".2f"),
                      fmt(ratio(r["overhead"], p["overhead"]), ".2f"), fmt(ratio(r["rss_mib"], p["rss_mib"]), ".2f")]
        else:
            cells += ["—", "—", "—"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# ---- main --------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--world", type=int, default=2, help="ranks of the sharded rows (default 2)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="global sequences per step (split over the ranks)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--train-gpt", default=DEFAULT_BIN, help="libfsdp's GPT example (default: %(default)s)")
    ap.add_argument("--libfsdp-variant", action="append", metavar="NAME:ARGS",
                    help="a libfsdp row: a name and extra train_gpt flags (repeatable; default 'default:'). "
                         "The world-1 row runs the first variant's flags")
    ap.add_argument("--single-per-variant", action="store_true",
                    help="run libfsdp's world-1 row for every variant, not only the first")
    ap.add_argument("--torch-args", default="", help="extra torch_gpt.py flags for both PyTorch rows")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--torch-only", action="store_true", help="only the PyTorch rows")
    only.add_argument("--libfsdp-only", action="store_true", help="only the libfsdp rows (no venv needed)")
    ap.add_argument("--out", help="write the Markdown (machine, commands, table) here")
    ap.add_argument("--json-dir", help="where the runs' JSON and logs go (default: a new temporary folder)")
    ap.add_argument("--venv", default=os.path.join(HERE, ".venv"), help="default: %(default)s")
    ap.add_argument("--python", help="a Python that already has torch (instead of the venv)")
    ap.add_argument("--pip-arg", action="append", default=[], help="extra argument to the venv's pip install")
    ap.add_argument("--setup-only", action="store_true", help="make the venv and stop")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="set in every run's environment (forwarded by mpirun -x)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run (default %(default)s)")
    args = ap.parse_args()

    world = args.world
    if world < 2:
        sys.exit("run.py: --world must be at least 2 (world 1 is the single rows)")
    if args.batch % world:
        sys.exit(f"run.py: --batch {args.batch} does not split evenly over --world {world}")
    variants = parse_variants(args.libfsdp_variant)
    extra_env = parse_kv(args.env, "--env")
    cores = usable_cores()

    torch_py, torch_version = (None, None)
    if not args.libfsdp_only or args.setup_only:
        torch_py, torch_version = ensure_venv(args)
    if args.setup_only:
        return 0

    binary = os.path.abspath(args.train_gpt)
    want_libfsdp = not args.torch_only
    if want_libfsdp:
        if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
            sys.exit(f"run.py: libfsdp's GPT example is not built: no executable {binary}.\n"
                     "  Build it (cmake --preset default && cmake --build --preset default), or point --train-gpt at it,\n"
                     "  or run the PyTorch rows alone with --torch-only.")
        if args.device == "cpu" and not shutil.which("mpirun"):
            sys.exit("run.py: mpirun not found (Debian: apt-get install openmpi-bin); "
                     "the sharded libfsdp rows run under it. --torch-only runs the PyTorch rows alone.")
        if args.device == "cuda":
            log("WARNING: libfsdp on cuda through this runner is UNTESTED (written on a machine without a GPU): "
                "world 1 runs train_gpt with FSDP_DEVICE=cuda:0, world N through examples/cuda/launch_local.sh N "
                "(one process per GPU, torchrun's variables); pass a CUDA build with --train-gpt and any flag it "
                "needs in --libfsdp-variant")

    json_dir = os.path.abspath(args.json_dir or tempfile.mkdtemp(prefix="vs_pytorch-"))
    os.makedirs(json_dir, exist_ok=True)
    log(f"JSON and logs in {json_dir}")

    shape = ["--layers", str(args.layers), "--width", str(args.width), "--heads", str(args.heads),
             "--context", str(args.context), "--batch", str(args.batch), "--steps", str(args.steps),
             "--dtype", args.dtype]
    base_env = dict(os.environ)
    base_env.update(extra_env)

    def env_for(ranks):
        """Each rank gets cores // ranks threads unless the caller set the variables."""
        env = dict(base_env)
        per = str(max(1, cores // ranks))
        for key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            if key not in os.environ and key not in extra_env:
                env[key] = per
        return env

    plan = []  # (framework, variant, world, tag, command, env)
    if not args.libfsdp_only:
        script = os.path.join(HERE, "torch_gpt.py")
        targs = shlex.split(args.torch_args)
        dev = ["--device", args.device]
        tag = "pytorch-single"
        plan.append(("pytorch", "single", 1, tag,
                     [torch_py, script, "--mode", "single", *shape, *dev, *targs, "--json", os.path.join(json_dir, tag + ".json")],
                     env_for(1)))
        tag = f"pytorch-fsdp2-w{world}"
        plan.append(("pytorch", "fsdp2", world, tag,
                     [torch_py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), script,
                      "--mode", "fsdp2", *shape, *dev, *targs, "--json", os.path.join(json_dir, tag + ".json")],
                     env_for(world)))
    if want_libfsdp:
        singles = variants if args.single_per_variant else variants[:1]
        for name, vargs in singles:
            tag = f"libfsdp-{name}-w1"
            env = env_for(1)
            if args.device == "cuda":
                env["FSDP_DEVICE"] = "cuda:0"
            plan.append(("libfsdp", name, 1, tag,
                         [binary, *shape, *vargs, "--bench-json", os.path.join(json_dir, tag + ".json")], env))
        for name, vargs in variants:
            tag = f"libfsdp-{name}-w{world}"
            env = env_for(world)
            prog = [binary, *shape, *vargs, "--bench-json", os.path.join(json_dir, tag + ".json")]
            if args.device == "cuda":
                cmd = [os.path.join(ROOT, "examples", "cuda", "launch_local.sh"), str(world), *prog]
            else:
                cmd = ["mpirun", "-np", str(world), "--bind-to", "none"]
                if os.geteuid() == 0:  # Open MPI refuses to start as root without it
                    cmd.append("--allow-run-as-root")
                if world > cores:
                    cmd.append("--oversubscribe")
                for key in sorted(set(extra_env) | {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}):
                    cmd += ["-x", key]
                cmd += prog
            plan.append(("libfsdp", name, world, tag, cmd, env))

    machine = machine_info(args.device)
    log(f"machine: {machine}")
    rows, commands = [], []
    for framework, variant, ranks, tag, cmd, env in plan:
        shown = {k: env[k] for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "FSDP_DEVICE",
                                                   *extra_env) if k in env}
        commands.append(" ".join([f"{k}={shlex.quote(v)}" for k, v in shown.items()] + [shlex.join(
            [os.path.relpath(c, ROOT) if os.path.isabs(c) and c.startswith(ROOT) else c for c in cmd])]))
        d, err = run_one(tag, cmd, env, os.path.join(json_dir, tag + ".json"), json_dir, args.timeout)
        rows.append(dict(framework=framework, variant=variant, world=ranks, json=d, error=err))
        if d and not torch_version and d.get("torch_version"):
            torch_version = d["torch_version"]

    lines = table(rows, args.device)
    threads = sorted({(r["framework"], r["world"], r["json"].get("threads_per_rank")) for r in rows if r["json"]})
    md = [f"GPT {args.layers} layers, width {args.width}, {args.heads} heads, context {args.context}, "
          f"global batch {args.batch} sequences ({args.batch * args.context} tokens) per step, {args.dtype}, "
          f"{args.device}; median of {args.steps} timed steps after 2 warm-up steps.",
          "",
          f"Machine: {machine}.",
          f"torch {torch_version or 'not run'}; threads per rank: "
          + (", ".join(f"{f} world {w}: {t}" for f, w, t in threads) or "—") + ".",
          ""]
    if args.device == "cuda" and want_libfsdp:
        md += ["**The libfsdp rows on cuda come from an untested path of this runner.**", ""]
    md += lines
    md += ["", "Commands:", "", "```", *commands, "```"]
    text = "\n".join(md) + "\n"
    print()
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        log(f"wrote {args.out}")
    failed = [r for r in rows if not r["json"]]
    if failed:
        log("failed: " + ", ".join(f"{r['framework']} {r['variant']} world {r['world']} ({r['error']})" for r in failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
