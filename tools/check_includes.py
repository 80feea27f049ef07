#!/usr/bin/env python3
"""The layer rule, checked on the sources' #include lines (docs/architecture.md,
"Layers"): the core (src/core) and the C API (src/api) never see a CUDA,
NCCL or MPI header, directly or through any project header they include
(followed transitively, conditional includes counted: the check must hold in
every build); and a device, a communicator or the checkpoint format
(src/device, src/comm, src/ckpt), base and kernels never include the core or
the API. Prints every offending chain and exits 1; exits 0 when clean.

usage: check_includes.py [REPO_ROOT]
"""
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
VENDOR = re.compile(r'(^|/)(cuda[^/]*|cublas[^/]*|cudnn[^/]*|curand[^/]*|cusparse[^/]*|nvrtc[^/]*|nccl[^/]*|mpi[^/]*)\.h$')
SOURCES = (".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh")


def project_includes(path, root):
    """(kind, target) of each include of `path`: ('vendor', name) or ('file', resolved path)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    out = []
    for bracket, name in INCLUDE.findall(text):
        resolved = None
        if bracket == '"':
            for base in (os.path.dirname(path), os.path.join(root, "src"), root):
                cand = os.path.normpath(os.path.join(base, name))
                if os.path.isfile(cand):
                    resolved = cand
                    break
        if resolved is not None:
            out.append(("file", resolved))
        elif VENDOR.search(name):
            out.append(("vendor", name))
    return out


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    src = os.path.join(root, "src")
    memo = {}

    def vendor_chain(path, seen):
        """A chain of includes from `path` to a vendor header, or None."""
        if path in memo:
            return memo[path]
        if path in seen:
            return None
        seen.add(path)
        found = None
        for kind, target in project_includes(path, root):
            if kind == "vendor":
                found = [target]
                break
            sub = vendor_chain(target, seen)
            if sub is not None:
                found = [os.path.relpath(target, root)] + sub
                break
        memo[path] = found
        return found

    problems = []
    for layer in ("core", "api"):
        for dirpath, _, files in os.walk(os.path.join(src, layer)):
            for f in sorted(files):
                if not f.endswith(SOURCES):
                    continue
                path = os.path.join(dirpath, f)
                chain = vendor_chain(path, set())
                if chain is not None:
                    problems.append(f"{os.path.relpath(path, root)} includes a CUDA/NCCL/MPI header: "
                                    + " -> ".join([os.path.relpath(path, root)] + chain))
    lower = [os.path.join(src, d) for d in ("device", "comm", "ckpt", "base")] + [os.path.join(root, "kernels")]
    upper = (os.path.join(src, "core") + os.sep, os.path.join(src, "api") + os.sep)
    for top in lower:
        for dirpath, _, files in os.walk(top):
            for f in sorted(files):
                if not f.endswith(SOURCES):
                    continue
                path = os.path.join(dirpath, f)
                for kind, target in project_includes(path, root):
                    if kind == "file" and target.startswith(upper):
                        problems.append(f"{os.path.relpath(path, root)} includes {os.path.relpath(target, root)}: "
                                        "a lower layer never includes the core or the API")
    for p in problems:
        print(p)
    if problems:
        return 1
    print("layers: src/core and src/api reach no CUDA, NCCL or MPI header; no lower layer includes them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
