#!/usr/bin/env python3
"""The ABI checker's own test: tools/check_abi.sh must fail on real ABI
breaks and pass on what a minor version may do (docs/abi.md).

  python3 tools/test_check_abi.py [BUILD_DIR] [--full] [--keep]

Takes a build tree that has built libfsdp (default build/default; the
Makefiles generator, as the presets use) and builds variants of the real
library from edited copies of the real sources, with the build's own compile
commands (compile_commands.json) and link command (link.txt):

  control           sources unchanged, rebuilt as the variants are     pass, "no change"
  minor-release     a new function taking a new enum, an enum value
                    appended to fsdp_status_t, a field appended to
                    fsdp_memory_stats_t                                pass, lists the addition
  removed           fsdp_trace_write no longer exported                fail
  removed-new-major the same with SONAME libfsdp.so.1                  pass, says to record a baseline
  struct-reordered  two fsdp_memory_stats_t fields swapped             fail
  reordered-grown   swapped and a field appended                       fail
  enum-changed      FSDP_ERR_IO's value changed                        fail
  param-changed     fsdp_set_lr's double parameter made float          fail

Each variant is compared with a baseline recorded (check_abi.sh --update)
from BUILD_DIR's own libfsdp.so. A variant recompiles the translation units
that define the exported functions (the DWARF abidiff reads for them) and
relinks them with the build's other objects; --full recompiles every
translation unit of the library instead (slower; the same verdicts). Each
verdict is checked by exit status and by what the report must name.
"""
import concurrent.futures
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = os.path.join(ROOT, "tools", "check_abi.sh")


def fail(msg):
    print(f"test_check_abi: {msg}", file=sys.stderr)
    sys.exit(2)


def edit(old, new, count=1):
    """A text edit that must apply exactly `count` times (else the sources
    moved on and this test must be updated, not silently weakened)."""
    return (old, new, count)


HEADER = "include/fsdp.h"
API_CTX = "src/api/api_context.cpp"
API_UNIT = "src/api/api_unit.cpp"

ADD_FUNCTION = {
    HEADER: [
        edit("#ifdef __cplusplus\n}\n#endif",
             "typedef enum fsdp_abi_test_mode { FSDP_ABI_TEST_A = 0, FSDP_ABI_TEST_B = 1 } fsdp_abi_test_mode_t;\n"
             "FSDP_API fsdp_status_t fsdp_abi_test_added(fsdp_ctx_t* ctx, fsdp_abi_test_mode_t mode);\n\n"
             "#ifdef __cplusplus\n}\n#endif"),
        edit("  FSDP_ERR_INTERNAL = 10 /*", "  FSDP_ERR_INTERNAL = 10, /*"),
        edit("report it */\n} fsdp_status_t;", "report it */\n  FSDP_ERR_ABI_TEST = 11\n} fsdp_status_t;"),
        edit("\n} fsdp_memory_stats_t;", "\n  size_t abi_test_nbytes;\n} fsdp_memory_stats_t;"),
    ],
    API_CTX: [
        edit("    case FSDP_ERR_INTERNAL:",
             "    case FSDP_ERR_ABI_TEST:\n      return \"FSDP_ERR_ABI_TEST\";\n    case FSDP_ERR_INTERNAL:"),
        edit("const char* fsdp_last_error(void) {",
             "fsdp_status_t fsdp_abi_test_added(fsdp_ctx_t* ctx, fsdp_abi_test_mode_t mode) {\n"
             "  return ctx && mode == FSDP_ABI_TEST_A ? FSDP_OK : FSDP_ERR_INVALID_ARGUMENT;\n}\n\n"
             "const char* fsdp_last_error(void) {"),
    ],
}
REORDER = edit("  size_t sharded_params_nbytes;  /* fp32 master (+ param_dtype shard where kept) */\n"
               "  size_t sharded_grads_nbytes;   /* fp32 sharded grads */\n",
               "  size_t sharded_grads_nbytes;   /* fp32 sharded grads */\n"
               "  size_t sharded_params_nbytes;  /* fp32 master (+ param_dtype shard where kept) */\n")
GROW = edit("\n} fsdp_memory_stats_t;", "\n  size_t abi_test_nbytes;\n} fsdp_memory_stats_t;")

# name: (source edits, names made local by the version script, SONAME or
# None, expected exit status, strings the output must contain)
VARIANTS = {
    "control": ({}, [], None, 0, ["no change"]),
    "minor-release": (ADD_FUNCTION, [], None, 0,
                      ["only additions", "[A] 'function fsdp_status_t fsdp_abi_test_added(fsdp_ctx_t*, fsdp_abi_test_mode_t)'",
                       "enum fsdp_status: enumerator FSDP_ERR_ABI_TEST = 11",
                       "struct fsdp_memory_stats_s grew at its end:", "'size_t abi_test_nbytes' at bit"]),
    "removed": (None, ["fsdp_trace_write"], None, 1,
                ["FAILED", "1 Removed function", "[D] 'function fsdp_status_t fsdp_trace_write("]),
    "removed-new-major": (None, ["fsdp_trace_write"], "libfsdp.so.1", 0,
                          ["SONAME changed from libfsdp.so.0", "1 Removed", "tools/check_abi.sh --update"]),
    "struct-reordered": ({HEADER: [REORDER]}, [], None, 1,
                         ["FAILED", "struct fsdp_memory_stats_s may only grow at its end",
                          "member 1 was 'size_t sharded_params_nbytes' at bit 64, is now 'size_t sharded_grads_nbytes' at bit 64"]),
    "reordered-grown": ({HEADER: [REORDER, GROW]}, [], None, 1,
                        ["FAILED", "member 1 was 'size_t sharded_params_nbytes' at bit 64"]),
    "enum-changed": ({HEADER: [edit("  FSDP_ERR_IO = 9,", "  FSDP_ERR_IO = 12,")]}, [], None, 1,
                     ["FAILED", "enum fsdp_status: enumerator FSDP_ERR_IO was 9, is now 12",
                      "abidiff's report", "FSDP_ERR_IO"]),
    "param-changed": ({HEADER: [edit("fsdp_set_lr(fsdp_ctx_t* ctx, double lr);", "fsdp_set_lr(fsdp_ctx_t* ctx, float lr);")],
                       API_UNIT: [edit("fsdp_set_lr(fsdp_ctx_t* ctx, double lr) {", "fsdp_set_lr(fsdp_ctx_t* ctx, float lr) {")]},
                      [], None, 1, ["FAILED", "fsdp_set_lr", "'double' changed", "'float'"]),
}


def run(cmd, cwd=None, env=None):
    return subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def main():
    sys.stdout.reconfigure(line_buffering=True)
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    opts = {a for a in sys.argv[1:] if a.startswith("--")}
    if opts - {"--full", "--keep"} or len(args) > 1:
        fail("usage: python3 tools/test_check_abi.py [BUILD_DIR] [--full] [--keep]")
    build = os.path.abspath(args[0] if args else os.path.join(ROOT, "build", "default"))
    full = "--full" in opts
    lib = os.path.join(build, "src", "libfsdp.so")
    link_txt = os.path.join(build, "src", "CMakeFiles", "fsdp.dir", "link.txt")
    if not os.path.isfile(lib) or not os.path.isfile(link_txt):
        fail(f"needs a Makefiles build tree that has built libfsdp: no {lib} or {link_txt}")
    ccdb = os.path.join(build, "compile_commands.json")
    if not os.path.isfile(ccdb):
        # Only writes the compile commands: no flag changes, nothing rebuilt.
        r = run(["cmake", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON", build])
        if r.returncode or not os.path.isfile(ccdb):
            fail(f"could not write {ccdb}:\n{r.stdout}")
    source_dir = None
    with open(os.path.join(build, "CMakeCache.txt")) as f:
        for line in f:
            if line.startswith("CMAKE_HOME_DIRECTORY:"):
                source_dir = line.split("=", 1)[1].strip()
    if not source_dir or not os.path.isfile(os.path.join(source_dir, "include", "fsdp.h")):
        fail(f"cannot find the sources {build} was configured from")
    # The variants are edited copies of those sources (normally this checkout).
    SRC = os.path.realpath(source_dir)
    src_dir = os.path.join(SRC, "src")

    # The library's objects, in link order, and the compile command of each.
    with open(link_txt) as f:
        link = shlex.split(f.read())
    link_cwd = os.path.join(build, "src")
    objects = [os.path.normpath(os.path.join(link_cwd, a)) for a in link if a.endswith(".o")]
    compiles = {}
    for e in json.load(open(ccdb)):
        cmd = shlex.split(e["command"])
        obj = os.path.normpath(os.path.join(e["directory"], cmd[cmd.index("-o") + 1]))
        if obj in objects:
            compiles[obj] = (e["directory"], cmd, os.path.normpath(e["file"]))
    if len(compiles) != len(objects):
        fail(f"{len(objects)} objects in link.txt, compile commands for {len(compiles)}")

    def exports(obj):
        out = run(["nm", "-g", "--defined-only", obj]).stdout
        return any(re.search(r" [TDBR] fsdp_", line) for line in out.splitlines())

    abi_objects = [o for o in objects if exports(o)]
    rebuilt = objects if full else abi_objects
    print(f"test_check_abi: {len(objects)} objects; the exported functions are defined in "
          f"{', '.join(os.path.relpath(compiles[o][2], SRC) for o in abi_objects)}; "
          f"variants rebuild {'all of them' if full else 'those'}")
    with open(os.path.join(src_dir, "libfsdp.map")) as f:
        real_map = f.read()

    tmp = tempfile.mkdtemp(prefix="fsdp-abi-test-")
    # ccache, where installed (CI's runs after the first compile nothing):
    # paths under the temporary folder are hashed relative to the compile's
    # working directory, so a new folder's name does not miss the cache.
    ccache = None if any("ccache" in os.path.basename(c[1][0]) for c in compiles.values()) else shutil.which("ccache")
    cc_env = dict(os.environ, CCACHE_BASEDIR=tmp, CCACHE_NOHASHDIR="true") if ccache else None
    t0 = time.monotonic()
    try:
        base = os.path.join(tmp, "baseline.abi")
        r = run([CHECK, "--update", "--baseline", base, lib])
        if r.returncode:
            fail(f"recording the baseline failed:\n{r.stdout}")

        # Sources of each variant: a copy of include/ and src/ with its edits.
        jobs = []
        for name, (edits, _, _, _, _) in VARIANTS.items():
            if edits is None:
                continue
            vdir = os.path.join(tmp, name)
            shutil.copytree(os.path.join(SRC, "include"), os.path.join(vdir, "include"))
            shutil.copytree(src_dir, os.path.join(vdir, "src"))
            for entry in os.listdir(SRC):  # what src/ includes by relative path (kernels/)
                if entry not in ("include", "src"):
                    os.symlink(os.path.join(SRC, entry), os.path.join(vdir, entry))
            for rel, changes in edits.items():
                path = os.path.join(vdir, rel)
                with open(path) as f:
                    text = f.read()
                for old, new, count in changes:
                    if text.count(old) != count:
                        fail(f"variant {name}: {rel} holds {text.count(old)} copies of {old!r}, "
                             f"expected {count}: the sources changed, update this test")
                    text = text.replace(old, new)
                with open(path, "w") as f:
                    f.write(text)
            for obj in rebuilt:
                directory, cmd, src = compiles[obj]
                new_obj = os.path.join(vdir, "obj", os.path.relpath(obj, build))
                os.makedirs(os.path.dirname(new_obj), exist_ok=True)

                def moved(a, vdir=vdir):
                    for tree in ("include", "src"):
                        for prefix in ("-I", ""):
                            old = prefix + os.path.join(SRC, tree)
                            if a == old or a.startswith(old + os.sep):
                                return prefix + os.path.join(vdir, tree) + a[len(old):]
                    return a

                vcmd = [moved(a) for a in cmd]
                vcmd[vcmd.index("-o") + 1] = new_obj
                if os.path.join(vdir, os.path.relpath(src, SRC)) not in vcmd:
                    fail(f"variant {name}: cannot move the compile of {src} to the copy")
                if ccache:
                    vcmd = [ccache] + vcmd
                # From the variant's own folder: with ccache's base_dir at the
                # temporary folder, the copy's paths hash the same in every run.
                jobs.append((name, obj, new_obj, vdir, vcmd))

        print(f"test_check_abi: compiling {len(jobs)} translation units for "
              f"{len({j[0] for j in jobs})} source variants")
        with concurrent.futures.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
            results = list(pool.map(lambda j: run(j[4], cwd=j[3], env=cc_env), jobs))
        replaced = {}
        for (name, obj, new_obj, _, vcmd), r in zip(jobs, results):
            if r.returncode:
                fail(f"variant {name}: compiling failed:\n{shlex.join(vcmd)}\n{r.stdout}")
            replaced.setdefault(name, {})[obj] = new_obj
        t_compile = time.monotonic() - t0

        def link_and_check(name, hidden, soname):
            vdir = os.path.join(tmp, name)
            os.makedirs(vdir, exist_ok=True)
            out = os.path.join(vdir, "libfsdp.so")
            cmd = []
            for a in link:
                obj = os.path.normpath(os.path.join(link_cwd, a)) if a.endswith(".o") else None
                if obj is not None:
                    a = replaced.get(name, {}).get(obj, obj)
                elif a.startswith("-Wl,--version-script=") and hidden:
                    vmap = os.path.join(vdir, "libfsdp.map")
                    with open(vmap, "w") as f:
                        f.write(real_map.replace("  local:\n", "  local:\n" + "".join(f"    {h};\n" for h in hidden)))
                    a = "-Wl,--version-script=" + vmap
                elif a.startswith("-Wl,-soname,") and soname:
                    a = "-Wl,-soname," + soname
                cmd.append(a)
            cmd[cmd.index("-o") + 1] = out
            r = run(cmd, cwd=link_cwd)
            if r.returncode:
                return None, f"linking failed:\n{shlex.join(cmd)}\n{r.stdout}"
            return run([CHECK, "--baseline", base, out]), None

        if real_map.count("  local:\n") != 1:
            fail("src/libfsdp.map changed shape (one '  local:' line expected): update this test")
        # The variants link and are checked at once (abidw and abidiff take
        # most of this test's time, one process each).
        with concurrent.futures.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
            checked = {name: pool.submit(link_and_check, name, v[1], v[2]) for name, v in VARIANTS.items()}
        failures = []
        for name, (edits, hidden, soname, want_rc, want_text) in VARIANTS.items():
            r, error = checked[name].result()
            if error:
                fail(f"variant {name}: {error}")
            missing = [t for t in want_text if t not in r.stdout]
            ok = r.returncode == want_rc and not missing
            verdict = "pass" if r.returncode == 0 else f"fail ({r.returncode})"
            print(f"  {'ok  ' if ok else 'BAD '} {name:18} checker says {verdict}, expected "
                  f"{'pass' if want_rc == 0 else 'fail'}")
            if not ok:
                failures.append(name)
                why = f"exit {r.returncode}, expected {want_rc}" if r.returncode != want_rc else f"no {missing}"
                print(f"       ({why}); the checker's output:\n" +
                      "\n".join("       | " + line for line in r.stdout.splitlines()))
        print(f"test_check_abi: {len(VARIANTS) - len(failures)}/{len(VARIANTS)} as expected "
              f"({time.monotonic() - t0:.0f} s, compiling {t_compile:.0f} s)")
        if failures:
            sys.exit(1)
    finally:
        if "--keep" in opts:
            print(f"test_check_abi: kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
