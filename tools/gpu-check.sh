#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU, in stages that each fit in
# one 10-minute command:
#   driver     (every invocation, first) a GPU is listed and its driver runs
#              the toolkit's code (CUDA 13 needs R580+); stops plainly if not
#   build      configure and build with the CUDA parts; reused by a later
#              invocation when the build folder holds a finished build of
#              the same sources
#   suite      every CTest named Cuda* (on a GPU a skip is a failure); the
#              multi-process NCCL ones after the rest, one at a time
#   python     the Python binding's GPU tests (bindings/python/tests/test_cuda*.py)
#              and the fsdp.torch / fsdp.jax suites with their device=cuda cases
#   go         the Go binding's tests, its GPU ones included (tools/test_go.sh);
#              unavailable, not failed, where go is not installed
#   memcheck   compute-sanitizer memcheck on test_cuda, test_cuda_engine, test_gpt_cuda
#   racecheck  compute-sanitizer racecheck on test_cuda, test_cuda_engine
#   bench      bench_cuda_kernels, bench_cuda_engine, bench_nccl (2+ GPUs),
#              train_mlp_cuda --check with forward prefetch off and on
#   demo       train_gpt --device cuda (the README's demo on the GPU)
# Every stage writes its records into the build folder's gpu-check/ as it
# goes; each invocation ends with one summary (text and JSON) assembled from
# all of them, earlier invocations' included, and exits 1 if anything failed.
#
#   tools/gpu-check.sh [--build-dir DIR] [STAGE[,STAGE]...]
#     STAGE: driver, build, suite, python, go, memcheck, racecheck, bench, demo,
#            sanitize (memcheck racecheck), run (all but build), all (default)
# Environment: FSDP_GPU_CHECK_STAGES (the stages, when none are given),
# FSDP_GPU_CHECK_BUILD (the build folder, default build/gpu; an argument
# with a / in it names it too), FSDP_GPU_CHECK_OUT (a folder that receives
# the logs and the summary as the run goes, default the build folder's
# gpu-check/), FSDP_GPU_CHECK_BUDGET_S (this invocation's time, default 570 s),
# FSDP_CUDA_ARCHS (default native, the GPU present). Relative folders are
# taken from where the command runs; the default build folder is the
# checkout's build/gpu.
#
# Works without a package registry: build dependencies the machine lacks come
# from .gpu-deps/ (tools/gpu-deps.sh downloads them elsewhere), unpacked into
# a prefix in the build folder. docs/gpu.md, "The GPU check", says how to run
# it with the device tool and what to look at.
set -uo pipefail
caller_dir=$PWD  # relative folders given are relative to it
GC_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$GC_ROOT" || exit 2
# shellcheck source=tools/gpu_check_lib.sh
. "$GC_ROOT/tools/gpu_check_lib.sh"

build_dir=${FSDP_GPU_CHECK_BUILD:-$GC_ROOT/build/gpu}
words=()
while [ $# -gt 0 ]; do
  case $1 in
    --build-dir) build_dir=${2:?--build-dir needs a folder}; shift 2 ;;
    --build-dir=*) build_dir=${1#--build-dir=}; shift ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    */*) build_dir=$1; shift ;;  # the older form: the build folder alone
    *) words+=("$1"); shift ;;
  esac
done
[ ${#words[@]} -gt 0 ] || read -ra words <<<"${FSDP_GPU_CHECK_STAGES:-all}"
gc_select_stages "${words[@]}" || exit 2

# Absolute once, here: every later path is built on these (an absolute build
# folder given to the Python test's FSDP_LIBRARY as "$PWD/$build" once broke it).
absolute() { (mkdir -p "$1" && cd "$1" && pwd) || { echo "gpu-check: cannot make the folder $1" >&2; exit 2; }; }
[[ $build_dir == /* ]] || build_dir=$caller_dir/$build_dir
GC_BUILD=$(absolute "$build_dir") || exit 2
GC_STATE=$GC_BUILD/gpu-check
out=${FSDP_GPU_CHECK_OUT:-$GC_STATE}
[[ $out == /* ]] || out=$caller_dir/$out
mkdir -p "$GC_STATE/records" || exit 2
GC_OUT=$(absolute "$out") || exit 2
[ "$GC_OUT" = "$GC_STATE" ] || : >"$GC_OUT/progress.log"
gc_start_clock

# ----------------------------------------------------------------------------- the run-time environment

# What the build stage learnt that the run stages need (possibly in a later
# invocation): the prefix's run-time libraries, where NCCL's headers and
# cuDNN came from. Set only for the commands that need them, never exported
# to every later process (cmake, nvcc, python3 with torch would load them too).
run_env_file=$GC_STATE/run.env
GC_RUN_LD="" GC_NCCL_BUILD="" GC_NCCL_PY_DIR="" GC_CUDNN_LIB_DIR="" GC_NCCL_HEADERS=""
# shellcheck source=/dev/null
[ -f "$run_env_file" ] && . "$run_env_file"
# RUN_ENV: the command prefix of libfsdp's own binaries (and of ctest, which
# starts them): the prefix's libraries that the machine lacks (libgfortran
# for OpenBLAS...) and a Python package's cuDNN (libcudnn opens its parts by
# name), ahead of the loader's path.
set_run_env() {
  local ld=$GC_RUN_LD
  [ -z "$GC_CUDNN_LIB_DIR" ] || ld=${ld:+$ld:}$GC_CUDNN_LIB_DIR
  # FSDP_REQUIRE_GPU=1: a GPU test that would skip fails (tests/gpu_presence.h, the bindings' tests).
  RUN_ENV=(env FSDP_REQUIRE_GPU=1)
  [ -z "$ld" ] || RUN_ENV+=("LD_LIBRARY_PATH=$ld${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
}
py_package_dir() {  # py_package_dir nvidia.nccl: the folder of a Python package, if python3 has it
  python3 -c "import $1 as n; print(list(n.__path__)[0])" 2>/dev/null
}
# NCCL is opened at run time (FSDP_NCCL_LIBRARY, else libnccl.so.2 on the
# loader's path). Take the one that goes with the headers the build used
# (the toolkit's or the system's through ldconfig, or the Python package's),
# else any of them, name it in FSDP_NCCL_LIBRARY, and say which.
find_nccl_library() {
  local ldcache cands=() c how="" version
  if [ -n "${FSDP_NCCL_LIBRARY:-}" ]; then
    cands=("$FSDP_NCCL_LIBRARY:as FSDP_NCCL_LIBRARY gave it")
  else
    local py=${GC_NCCL_PY_DIR:-$(py_package_dir nvidia.nccl)} cuda_home=""
    local nvcc
    nvcc=$(gc_nvcc) && cuda_home=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
    ldcache=$(ldconfig -p 2>/dev/null)
    local from_ld="" re='libnccl\.so\.2 \([^)]*\) => ([^[:space:]]+)'
    [[ $ldcache =~ $re ]] && from_ld=${BASH_REMATCH[1]}
    local system=("$from_ld:from ldconfig" "$cuda_home/lib64/libnccl.so.2:from the CUDA toolkit"
                  "$cuda_home/lib/libnccl.so.2:from the CUDA toolkit")
    local python=("$py/lib/libnccl.so.2:from the Python package in $py")
    if [ "$GC_NCCL_BUILD" = python ]; then cands=("${python[@]}" "${system[@]}"); else cands=("${system[@]}" "${python[@]}"); fi
  fi
  # The first that forms a one-rank communicator on GPU 0 (a libnccl that
  # loads may still fail there: one built without kernels for this GPU's
  # architecture, or for another driver); else the first found, so that
  # comm=nccl's tests fail naming it.
  local first="" first_how="" probe
  for c in "${cands[@]}"; do
    [ -f "${c%%:*}" ] || continue
    [ -n "$first" ] || { first=${c%%:*}; first_how=${c#*:}; }
    if probe=$(nccl_probe "${c%%:*}"); then
      export FSDP_NCCL_LIBRARY=${c%%:*}
      how=${c#*:}
      break
    fi
    gc_note "NCCL ${c%%:*} (${c#*:}) left out: it could not form a one-rank communicator on GPU 0: $probe"
  done
  if [ -z "$how" ] && [ -n "$first" ]; then
    export FSDP_NCCL_LIBRARY=$first
    how="$first_how; no candidate formed a one-rank communicator, so comm=nccl's tests will fail"
  fi
  if [ -z "$how" ]; then
    unset FSDP_NCCL_LIBRARY
    gc_version nccl "no libnccl.so.2 found (ldconfig, the CUDA toolkit, Python's nvidia.nccl): comm=nccl fails with UNSUPPORTED; headers: ${GC_NCCL_HEADERS:-?}"
    return
  fi
  version=$(python3 -c '
import ctypes, sys
v = ctypes.c_int()
ctypes.CDLL(sys.argv[1]).ncclGetVersion(ctypes.byref(v))
print("%d.%d.%d" % (v.value // 10000, v.value // 100 % 100, v.value % 100))' "$FSDP_NCCL_LIBRARY" 2>/dev/null) || version="?"
  gc_version nccl "$version, library $FSDP_NCCL_LIBRARY ($how; FSDP_NCCL_LIBRARY set to it); headers: ${GC_NCCL_HEADERS:-?}"
}

# nccl_probe LIB: forms and destroys a one-rank communicator on GPU 0 with
# LIB through ctypes; prints NCCL's error and fails where that does not work.
nccl_probe() {
  timeout 60 python3 - "$1" 2>&1 <<'PY'
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
lib.ncclGetErrorString.restype = ctypes.c_char_p
class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]
uid, comm = UniqueId(), ctypes.c_void_p()
for what, r in (("ncclGetUniqueId", lambda: lib.ncclGetUniqueId(ctypes.byref(uid))),
                ("ncclCommInitRank", lambda: lib.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0)),
                ("ncclCommDestroy", lambda: lib.ncclCommDestroy(comm))):
    res = r()
    if res != 0:
        sys.exit("%s returned %d (%s)" % (what, res, lib.ncclGetErrorString(res).decode()))
PY
}

# Every run stage needs a finished build.
need_build() {
  if [ -z "$(gc_current_source)" ] || [ ! -f "$GC_BUILD/src/libfsdp.so" ]; then
    gc_stage_end FAIL "no finished build in $GC_BUILD: run the build stage first (tools/gpu-check.sh build)"
    return 1
  fi
  set_run_env
}

# ----------------------------------------------------------------------------- build

# .gpu-deps/*.deb unpacked into a prefix in the build folder, made usable
# where Debian's files assume they are installed in /usr: their .pc files
# say /usr (and libdeflate's names /usr/lib, not the multiarch folder that
# holds it), and some of their symlinks are absolute (zlib1g-dev's libz.so
# points to /lib/x86_64-linux-gnu/libz.so.1.2.13, dangling on a host with
# another zlib, where FindZLIB would quietly take the static libz.a).
unpack_gpu_deps() {
  local prefix=$GC_BUILD/deps-prefix multiarch l t pc libdir lib f
  compgen -G "$GC_ROOT/.gpu-deps/*.deb" >/dev/null || return 0
  multiarch=$prefix/usr/lib/x86_64-linux-gnu
  rm -rf "$prefix"
  mkdir -p "$prefix/runtime-lib"
  for f in "$GC_ROOT"/.gpu-deps/*.deb; do dpkg -x "$f" "$prefix" || return 1; done
  while IFS= read -r l; do
    t=$(readlink "$l")
    [[ $t == /* ]] && [ -e "$prefix$t" ] && ln -sfn "$prefix$t" "$l"
  done < <(find "$prefix" -type l)
  for pc in "$multiarch"/pkgconfig/*.pc "$multiarch"/openblas-pthread/pkgconfig/*.pc; do
    [ -f "$pc" ] || continue
    sed -i "s|=/usr|=$prefix/usr|" "$pc"
    libdir=$(sed -n 's/^libdir=//p' "$pc")
    libdir=${libdir//\$\{prefix\}/$prefix/usr}
    libdir=${libdir//\$\{exec_prefix\}/$prefix/usr}
    lib=$(sed -n 's/^Libs:.*-l\([A-Za-z0-9_+]*\).*/\1/p' "$pc")
    if [ -n "$lib" ] && ! compgen -G "$libdir/lib$lib.*" >/dev/null && compgen -G "$multiarch/lib$lib.*" >/dev/null; then
      sed -i "s|^libdir=.*|libdir=$multiarch|" "$pc"
    fi
  done
  # Run time: only the libraries this machine's loader lacks (libgfortran for
  # OpenBLAS, libdeflate where absent...), never the prefix as a whole.
  local ldcache
  ldcache=$(ldconfig -p 2>/dev/null)
  for f in "$multiarch"/lib*.so.[0-9]* "$multiarch"/openblas-pthread/lib*.so.[0-9]*; do
    if [ -e "$f" ] && [[ ${f##*/} =~ ^(.*\.so\.[0-9]+) ]]; then  # libfoo.so.5.0.0: libfoo.so.5
      [[ $ldcache == *"${BASH_REMATCH[1]} "* ]] || ln -sfn "$f" "$prefix/runtime-lib/${BASH_REMATCH[1]}"
    fi
  done
  cmake_args+=("-DCMAKE_PREFIX_PATH=$prefix/usr" "-DCMAKE_LIBRARY_PATH=$multiarch" "-DCMAKE_INCLUDE_PATH=$prefix/usr/include")
  [ -d "$prefix/usr/src/googletest" ] && cmake_args+=("-DFSDP_GTEST_SOURCE_DIR=$prefix/usr/src/googletest")
  configure_env+=("PKG_CONFIG_PATH=$multiarch/pkgconfig:$multiarch/openblas-pthread/pkgconfig:$prefix/usr/share/pkgconfig")
  if ! command -v pkg-config >/dev/null && [ -x "$prefix/usr/bin/pkgconf" ]; then
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$multiarch" "$prefix/usr/bin/pkgconf" >"$prefix/pkg-config"
    chmod +x "$prefix/pkg-config"
    cmake_args+=("-DPKG_CONFIG_EXECUTABLE=$prefix/pkg-config")
  fi
  compgen -G "$prefix/runtime-lib/*" >/dev/null && GC_RUN_LD=$prefix/runtime-lib
  local runtime
  runtime=$(cd "$prefix/runtime-lib" && compgen -G '*' | tr '\n' ' ')
  gc_note "build dependencies from .gpu-deps ($(compgen -G "$GC_ROOT/.gpu-deps/*.deb" | wc -l) packages) in $prefix;" \
    "at run time from there (this machine lacks them): ${runtime:-none}"
}

# NCCL's headers: the toolkit's or the system's, else a Python package's
# (nvidia-nccl-cu*). cuDNN (the GPU GPT's attention): the toolkit's or the
# system's, else a Python package's (nvidia-cudnn-cu*, which torch brings).
find_gpu_libraries() {
  local nvcc cuda_home="" dir
  GC_CUDNN_FROM="the toolkit or the system"
  nvcc=$(gc_nvcc) && cuda_home=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
  if [ -f "$cuda_home/include/nccl.h" ] || [ -f /usr/include/nccl.h ]; then
    GC_NCCL_BUILD=system
  elif dir=$(py_package_dir nvidia.nccl) && [ -f "$dir/include/nccl.h" ]; then
    GC_NCCL_BUILD=python GC_NCCL_PY_DIR=$dir
    cmake_args+=("-DNCCL_ROOT=$dir")
  else
    GC_NCCL_BUILD=none
    gc_note "no nccl.h (the toolkit, /usr/include, Python's nvidia.nccl): built without the nccl communicator"
  fi
  if ! compgen -G "$cuda_home/include/cudnn_version.h" >/dev/null &&
     ! compgen -G "/usr/include/cudnn_version*.h" >/dev/null &&
     ! compgen -G "/usr/include/x86_64-linux-gnu/cudnn_version*.h" >/dev/null &&
     dir=$(py_package_dir nvidia.cudnn) && [ -f "$dir/include/cudnn_version.h" ]; then
    cmake_args+=("-DCUDNN_ROOT=$dir")
    GC_CUDNN_LIB_DIR=$dir/lib
    # A wheel made for another CUDA (torch's nvidia-cudnn-cu12 beside a CUDA
    # 13 toolkit) loads, but its runtime-compiled engines, which Hopper's
    # fused attention uses, want that CUDA's NVRTC and cuBLASLt (review
    # finding 21): said here, so that a CudaGpt failure in graph building
    # points at it.
    local wheel cuda
    wheel=$(python3 -c 'import importlib.metadata as m
print(" ".join(sorted({d.metadata["Name"] for d in m.distributions()
                       if (d.metadata["Name"] or "").lower().startswith("nvidia-cudnn-cu")})))' 2>/dev/null)
    cuda=$(gc_toolkit_version)
    GC_CUDNN_FROM="the Python package ${wheel:-nvidia.cudnn} in $dir"
    if [[ " ${wheel,,} " != *"-cu${cuda%%.*} "* ]]; then
      GC_CUDNN_FROM+=", made for another CUDA than the toolkit's $cuda: its runtime-compiled engines may fail to load (review finding 21)"
      gc_note "cuDNN from $GC_CUDNN_FROM"
    fi
  fi
}

cache_value() {  # cache_value NAME: a value of the build's CMakeCache.txt
  sed -n "s/^$1:[A-Z]*=//p" "$GC_BUILD/CMakeCache.txt" 2>/dev/null | head -n 1
}
header_version() {  # header_version FILE PREFIX: e.g. 2.28.9 from NCCL_MAJOR/_MINOR/_PATCH
  local text v=() k re
  text=$(cat "$1" 2>/dev/null)
  for k in MAJOR MINOR PATCH PATCHLEVEL; do
    re="#define ${2}_$k +([0-9]+)"
    [[ $text =~ $re ]] && v+=("${BASH_REMATCH[1]}")
  done
  local IFS=.
  echo "${v[*]:-?}"
}
# What the summary says of the build: versions, and which GPU programs exist.
describe_build() {
  local d cxx text
  text=$(python3 -c '
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1]); lib.fsdp_build_info.restype = ctypes.c_char_p
print(lib.fsdp_build_info().decode())' "$GC_BUILD/src/libfsdp.so" 2>&1)
  gc_version build_info "${text//$'\n'/ }"
  gc_version source "$(sed -n 's/^source=//p' "$(gc_stamp)" 2>/dev/null || gc_source_name)"
  d=$(cache_value FSDP_NCCL_INCLUDE_DIR)
  GC_NCCL_HEADERS="$(header_version "$d/nccl.h" NCCL) in ${d:-?}"
  d=$(cache_value FSDP_CUDNN_INCLUDE_DIR)
  if [ -f "$d/cudnn_version.h" ]; then
    gc_version cudnn "$(header_version "$d/cudnn_version.h" CUDNN) from ${GC_CUDNN_FROM:-?} (headers in $d; library $(cache_value FSDP_CUDNN_LIBRARY))"
  else
    gc_version cudnn "not found by configure (then the GPU GPT is not built)"
  fi
  cxx=$(cache_value CMAKE_CXX_COMPILER)
  text=$("${cxx:-c++}" --version 2>/dev/null)
  gc_version compiler "${text%%$'\n'*}"
  text=$(cmake --version 2>/dev/null)
  gc_version cmake "${text%%$'\n'*}"
  gc_version python "$(python3 -c 'import sys; print(sys.version.split()[0])' 2>/dev/null)"
  printf 'GC_RUN_LD=%q\nGC_NCCL_BUILD=%q\nGC_NCCL_PY_DIR=%q\nGC_CUDNN_LIB_DIR=%q\nGC_NCCL_HEADERS=%q\n' \
    "$GC_RUN_LD" "$GC_NCCL_BUILD" "$GC_NCCL_PY_DIR" "$GC_CUDNN_LIB_DIR" "$GC_NCCL_HEADERS" >"$run_env_file"
  # The GPU programs the run stages need; the GPU GPT (test_gpt_cuda, and
  # train_gpt's --device cuda) needs OpenBLAS, cuDNN 9 and cudnn-frontend,
  # and configure says which one was missing.
  local t why
  for t in src/libfsdp.so tests/test_cuda tests/test_cuda_engine tests/test_cuda_graph tests/test_gpt_cuda examples/cuda/train_mlp_cuda \
           examples/gpt/train_gpt benchmarks/bench_cuda_kernels benchmarks/bench_cuda_engine; do
    if [ -e "$GC_BUILD/$t" ]; then
      gc_item "built $t" PASS "" ""
    else
      why=""
      [ "$t" != tests/test_gpt_cuda ] || why=$(grep -h -A3 'GPU GPT\|OpenBLAS not found' "$GC_STATE/logs/configure.log" 2>/dev/null)
      gc_item "built $t" FAIL "" "not built${why:+: ${why//$'\n'/ }}"
    fi
  done
}

stage_build() {
  gc_stage_begin build
  local cmake_args=(-DFSDP_WITH_CUDA=ON -DFSDP_WITH_MPI=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo
                    -DFSDP_WARNINGS_AS_ERRORS=OFF "-DCMAKE_CUDA_ARCHITECTURES=${FSDP_CUDA_ARCHS:-native}")
  local configure_env=() id rc
  # Warnings are not errors here: this machine's compiler is not CI's (a
  # newer GCC warns where CI's does not, e.g. -Wdangling-reference), and CI
  # already holds the code to -Werror.
  GC_RUN_LD="" GC_NCCL_BUILD="" GC_NCCL_PY_DIR="" GC_CUDNN_LIB_DIR=""
  find_gpu_libraries
  command -v ninja >/dev/null && cmake_args+=(-G Ninja)
  id=$(gc_source_id "${cmake_args[@]}" "$(cd "$GC_ROOT/.gpu-deps" 2>/dev/null && compgen -G '*.deb')")
  if gc_build_is_current "$id"; then
    gc_note "reusing the finished build of these sources in $GC_BUILD ($(sed -n 's/^finished=//p' "$(gc_stamp)"))"
    # shellcheck source=/dev/null
    . "$run_env_file"  # and what that build found
    describe_build
    gc_stage_end "" "reused"
    return
  fi
  rm -f "$(gc_stamp)"
  printf '%s\n' "$id" >"$(gc_rec)/source_id"  # what an earlier build's run records no longer describe
  unpack_gpu_deps || { gc_stage_end FAIL "could not unpack .gpu-deps"; return; }
  local generator=Ninja
  command -v ninja >/dev/null || generator="Unix Makefiles"
  if [ -f "$GC_BUILD/CMakeCache.txt" ] && [ "$(cache_value CMAKE_GENERATOR)" != "$generator" ]; then
    rm -rf "$GC_BUILD/CMakeCache.txt" "$GC_BUILD/CMakeFiles"  # configured with another generator before
  fi
  gc_timed 300 "$GC_STATE/logs/configure.log" env "${configure_env[@]}" cmake -S "$GC_ROOT" -B "$GC_BUILD" "${cmake_args[@]}"
  rc=$?
  if [ $rc -ne 0 ]; then
    tail -30 "$GC_STATE/logs/configure.log"
    gc_stage_end FAIL "configure failed (exit $rc; log: logs/configure.log)"
    return
  fi
  gc_timed 570 "$GC_STATE/logs/build.log" env "${configure_env[@]}" cmake --build "$GC_BUILD" -j"$(nproc)"
  rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ] || [ $rc -eq 125 ]; then
    gc_stage_end FAIL "the build did not finish in this invocation's time: run the build stage again, it goes on where it stopped"
    return
  elif [ $rc -ne 0 ]; then
    grep -m20 -B2 -A8 "error" "$GC_STATE/logs/build.log"
    gc_stage_end FAIL "build failed (exit $rc; log: logs/build.log)"
    return
  fi
  gc_write_stamp "$id"
  describe_build
  gc_stage_end
}

# ----------------------------------------------------------------------------- suite

# ctest_run LOG CAP ARGS...: one ctest over the build's GPU tests; every test's verdict becomes an item.
ctest_run() {
  local log=$1 cap=$2 rc t0 n
  shift 2
  t0=$(date +%s)
  gc_timed "$cap" "$log" "${RUN_ENV[@]}" ctest --test-dir "$GC_BUILD" --output-on-failure "$@"
  rc=$?
  n=0
  while IFS=$'\t' read -r name verdict secs detail; do
    gc_item "$name" "$verdict" "$secs" "$detail"
    n=$((n + 1))
  done < <(python3 "$GC_ROOT/tools/gpu_check_summary.py" ctest-items "$log")
  if [ $rc -eq 124 ] || [ $rc -eq 137 ] || [ $rc -eq 125 ]; then
    gc_item "ctest $*" TIMEOUT "$(($(date +%s) - t0))" "stopped by this invocation's time limit; the tests above finished"
  elif [ $n -eq 0 ]; then
    gc_item "ctest $*" FAIL "$(($(date +%s) - t0))" "no test ran (exit $rc; log: ${log#"$GC_STATE/"})"
  elif [ $rc -ne 0 ]; then
    grep -A30 '\*\*\*Failed\|\*\*\*Skipped\|\*\*\*Timeout\|\*\*\*Exception' "$log" | head -80
    GC_STAGE_FAILED=1
  fi
}

stage_suite() {
  gc_stage_begin suite
  need_build || return
  local exclude='WithoutAGpu'
  if [ "$gpus" -lt 2 ]; then
    exclude+='|AnotherGpu'
    gc_note "$gpus GPU visible: the tests that need 2 (*AnotherGpu*, *TwoGpus) are left out"
  fi
  # The GPU tests share the GPU four at a time; those that start one NCCL
  # process per GPU run afterwards, one at a time (tests/CMakeLists.txt marks
  # them RUN_SERIAL for plain ctest too).
  ctest_run "$GC_STATE/logs/suite.log" 480 -R '^Cuda' -E "$exclude|TwoGpus" -j4
  if [ "$gpus" -ge 2 ]; then
    ctest_run "$GC_STATE/logs/suite-nccl-processes.log" 420 -R '^Cuda.*TwoGpus' -E "$exclude" -j1
  fi
  gc_stage_end
}

# ----------------------------------------------------------------------------- python

stage_python() {
  gc_stage_begin python
  need_build || return
  local site="" rc t0 w files=()
  # pytest and transformers: the machine's, else the wheels of
  # .gpu-deps/wheels and .gpu-deps-tests/py-wheels unzipped (no pip needed) into a
  # folder of their own, behind what the machine has (its torch, numpy).
  local need=()
  python3 -c "import pytest" 2>/dev/null || need+=("$GC_ROOT"/.gpu-deps/wheels/*.whl)
  python3 -c "import transformers" 2>/dev/null || need+=("$GC_ROOT"/.gpu-deps-tests/py-wheels/*.whl)
  if [ ${#need[@]} -gt 0 ] && compgen -G "${need[0]}" >/dev/null; then
    site=$GC_STATE/pytest-site
    rm -rf "$site"
    for w in "${need[@]}"; do
      [ -f "$w" ] || continue
      python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$w" "$site"
    done
    gc_note "wheels from .gpu-deps unzipped into $site: ${need[*]##*/}"
  fi
  local pythonpath=${PYTHONPATH:-}
  [ -z "$site" ] || pythonpath=$site${pythonpath:+:$pythonpath}
  if ! PYTHONPATH=$pythonpath python3 -c "import pytest" 2>/dev/null; then
    gc_stage_end FAIL "pytest not found (run tools/gpu-deps.sh elsewhere and carry .gpu-deps): the Python GPU tests did not run"
    return
  fi
  # The binding's own GPU tests, and the adapters' suites, whose device=cuda
  # cases run here against the frameworks' own runs on the GPU (the CPU cases
  # run too: every adapter test that passes on the CPU must pass here).
  for w in "$GC_ROOT"/bindings/python/tests/{test_cuda*,test_torch_adapter,test_jax_adapter,test_api}.py; do
    [ -f "$w" ] && files+=("$w")
  done
  rm -f "$GC_STATE/logs/python-junit.xml"
  t0=$(date +%s)
  gc_timed 540 "$GC_STATE/logs/python.log" env FSDP_REQUIRE_GPU=1 "FSDP_LIBRARY=$GC_BUILD/src/libfsdp.so" \
    "PYTHONPATH=$GC_ROOT/bindings/python${pythonpath:+:$pythonpath}" \
    python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$GC_STATE/logs/python-junit.xml" "${files[@]}"
  rc=$?
  if [ -s "$GC_STATE/logs/python-junit.xml" ]; then
    while IFS=$'\t' read -r name verdict secs detail; do
      gc_item "$name" "$verdict" "$secs" "$detail"
    done < <(python3 "$GC_ROOT/tools/gpu_check_summary.py" junit-items "$GC_STATE/logs/python-junit.xml")
  fi
  if [ $rc -ne 0 ] && [ "$GC_STAGE_FAILED" -eq 0 ]; then
    tail -40 "$GC_STATE/logs/python.log"
    gc_item "pytest ${files[*]##*/}" "$(failed_verdict $rc)" \
      "$(($(date +%s) - t0))" "exit $rc (log: logs/python.log)"
  fi
  gc_stage_end
}

# ----------------------------------------------------------------------------- go

# The Go binding against this build (tools/test_go.sh links it through
# CGO_LDFLAGS): its tests, cuda_test.go's on the GPU included, and its example.
stage_go() {
  gc_stage_begin go
  need_build || return
  # Go: the machine's, else the toolchain tools/gpu-deps.sh packed into
  # .gpu-deps-tests/go.tar.xz, unpacked once into the state folder.
  if ! command -v go >/dev/null && [ -f "$GC_ROOT/.gpu-deps-tests/go.tar.xz" ]; then
    if [ ! -x "$GC_STATE/go/bin/go" ]; then
      rm -rf "$GC_STATE/go" && tar -C "$GC_STATE" -xJf "$GC_ROOT/.gpu-deps-tests/go.tar.xz"
    fi
    export GOROOT=$GC_STATE/go PATH=$GC_STATE/go/bin:$PATH
    gc_note "go from .gpu-deps-tests/go.tar.xz: $(go version 2>&1)"
  fi
  if ! command -v go >/dev/null; then
    gc_stage_end UNAVAILABLE "go is not installed here (and no .gpu-deps-tests/go.tar.xz): the Go binding's GPU tests did not run"
    return
  fi
  local t0 rc t failed=()
  t0=$(date +%s)
  gc_timed 400 "$GC_STATE/logs/go.log" env FSDP_REQUIRE_GPU=1 "$GC_ROOT/tools/test_go.sh" "$GC_BUILD"
  rc=$?
  if [ $rc -eq 0 ]; then
    gc_item "tools/test_go.sh" PASS "$(($(date +%s) - t0))" "$(grep -c '^ok ' "$GC_STATE/logs/go.log") packages ok"
  else
    tail -30 "$GC_STATE/logs/go.log"
    mapfile -t failed < <(sed -n 's/^ *--- FAIL: \([^ ]*\).*/\1/p' "$GC_STATE/logs/go.log")
    for t in "${failed[@]}"; do gc_item "go test $t" FAIL "" "log: logs/go.log"; done
    [ ${#failed[@]} -gt 0 ] || gc_item "tools/test_go.sh" "$(failed_verdict $rc)" \
      "$(($(date +%s) - t0))" "exit $rc (log: logs/go.log)"
  fi
  gc_stage_end
}

# ----------------------------------------------------------------------------- compute-sanitizer

# sanitizer_pass TOOL BINARY TESTS CAP API_ERRORS: a gtest binary's tests
# (all, one suite, or all but one) under the tool.
# Left out: the tests of machines without a GPU or with two, and every
# multi-process NCCL test (*TwoGpus*, and NcclChild.*, the processes that
# CudaEngine.NcclProcesses... starts): their children would run under the
# tool too, slowly, and NCCL's own kernels and transports are not ours to check.
# Also left out: the test that faults the GPU on purpose (*AFaultOnTheGpu*, in
# a child process: GpuFaultChild.*), whose illegal address the tool reports,
# and the test that a kernel's first launch waits for no other stream
# (*AFirstLaunchWaitsForNoOtherStream*): the tool serializes every launch.
# API_ERRORS: "explicit" (the tool's default) where only libfsdp calls CUDA
# (test_cuda but its NCCL tests); "no" where NCCL, cuBLAS or cuDNN run. They
# probe with calls they expect to fail and carry on; reported, those would
# fail the pass for nothing of libfsdp's. libfsdp checks every CUDA call's
# result itself (a failure throws, and the test fails), so nothing of ours
# is lost; memory errors and races still fail the pass (--error-exitcode).
sanitizer_pass() {  # sanitizer_pass TOOL BINARY TESTS CAP API_ERRORS; TESTS: all, SUITE.* or -SUITE.* (all but)
  local tool=$1 bin=$2 tests=$3 cap=$4 api=$5 log t0 rc verdict detail
  local name="compute-sanitizer $tool $bin" file=$bin
  local positive='*' negative='*WithoutAGpu*:*AnotherGpu*:*TwoGpus*:NcclChild.*:*AFaultOnTheGpu*:GpuFaultChild.*:*AFirstLaunchWaitsForNoOtherStream*'
  if [ "$tests" != all ]; then
    name+=" ($tests)"
    file+="-${tests//[^A-Za-z]/}"
    if [ "${tests#-}" != "$tests" ]; then negative+=":${tests#-}"; else positive=$tests; fi
  fi
  log=$GC_STATE/logs/sanitizer-$tool-$file.log
  if [ -n "${GC_SANITIZER_UNAVAILABLE:-}" ]; then
    gc_item "$name" UNAVAILABLE 0 "not run: $GC_SANITIZER_UNAVAILABLE"
    return
  fi
  if [ ! -x "$GC_BUILD/tests/$bin" ]; then
    gc_item "$name" FAIL 0 "$bin was not built"
    return
  fi
  t0=$(date +%s)
  gc_timed "$cap" "$log" "${RUN_ENV[@]}" compute-sanitizer --tool "$tool" --error-exitcode 99 --report-api-errors "$api" \
    "$GC_BUILD/tests/$bin" --gtest_filter="$positive-$negative"
  rc=$?
  IFS=$'\t' read -r verdict detail < <(python3 "$GC_ROOT/tools/gpu_check_summary.py" sanitizer-verdict "$log" "$rc")
  [ "$verdict" = UNAVAILABLE ] && GC_SANITIZER_UNAVAILABLE=$detail
  [ "$verdict" = PASS ] || [ "$verdict" = UNAVAILABLE ] || tail -40 "$log"
  gc_item "$name" "$verdict" "$(($(date +%s) - t0))" "$detail"
}
sanitizer_stage() {  # sanitizer_stage TOOL (BINARY TESTS CAP API_ERRORS)...
  local tool=$1
  gc_stage_begin "$tool"
  need_build || return
  if ! command -v compute-sanitizer >/dev/null; then
    gc_stage_end FAIL "compute-sanitizer not found (it comes with the CUDA toolkit: put its bin/ on PATH)"
    return
  fi
  shift
  while [ $# -ge 4 ]; do
    sanitizer_pass "$tool" "$1" "$2" "$3" "$4"
    shift 4
  done
  if [ -n "${GC_SANITIZER_UNAVAILABLE:-}" ] && [ "$GC_STAGE_FAILED" -eq 0 ]; then
    gc_stage_end UNAVAILABLE "compute-sanitizer cannot run on this machine: $GC_SANITIZER_UNAVAILABLE"
  else
    gc_stage_end
  fi
}
stage_memcheck() {
  # test_cuda's NCCL tests on their own: libnccl probes its kernels with
  # calls that fail (cudaFuncGetAttributes: no kernel image) and carries on.
  sanitizer_stage memcheck test_cuda '-CudaNccl.*' 150 explicit test_cuda 'CudaNccl.*' 120 no \
    test_cuda_engine all 220 no test_gpt_cuda all 150 no
}
stage_racecheck() {
  sanitizer_stage racecheck test_cuda all 240 explicit test_cuda_engine all 290 no
}

# ----------------------------------------------------------------------------- bench

# bench_run NAME CAP CMD...: a benchmark's JSON lines into bench/NAME.json, its exit status checked.
bench_run() {
  local name=$1 cap=$2 t0 rc verdict detail
  shift 2
  t0=$(date +%s)
  gc_timed "$cap" "$GC_STATE/bench/$name.json" "${RUN_ENV[@]}" "$@"
  rc=$?
  IFS=$'\t' read -r verdict detail < <(python3 "$GC_ROOT/tools/gpu_check_summary.py" bench-verdict \
    "$GC_STATE/bench/$name.json" "$rc")
  [ "$verdict" = PASS ] || tail -20 "$GC_STATE/bench/$name.json"
  gc_item "$name" "$verdict" "$(($(date +%s) - t0))" "$detail"
}

stage_bench() {
  gc_stage_begin bench
  need_build || return
  local b=$GC_BUILD/benchmarks p t0 rc line
  rm -f "$GC_STATE"/bench/*.json
  bench_run bench_cuda_kernels 150 "$b/bench_cuda_kernels"
  bench_run bench_cuda_engine 150 "$b/bench_cuda_engine" --graph
  if [ ! -x "$b/bench_nccl" ]; then
    gc_note "bench_nccl was not built (no NCCL headers): not run"
  elif [ "$gpus" -ge 2 ]; then
    bench_run bench_nccl 200 "$GC_ROOT/examples/cuda/launch_local.sh" "$gpus" "$b/bench_nccl"
  else
    gc_note "bench_nccl needs 2 GPUs, $gpus visible: not run"
  fi
  # The example's step with forward prefetch off and on (the overlap's gain);
  # --check: it fails unless the loss halves (a NaN loss fails too).
  for p in 0 1; do
    t0=$(date +%s)
    gc_timed 120 "$GC_STATE/logs/train_mlp_cuda-prefetch$p.log" "${RUN_ENV[@]}" FSDP_FORWARD_PREFETCH=$p \
      "$GC_BUILD/examples/cuda/train_mlp_cuda" --steps 100 --check
    rc=$?
    line=$(grep -h 'step time\|FSDP_ERR\|it did not learn' "$GC_STATE/logs/train_mlp_cuda-prefetch$p.log")
    line=${line//$'\n'/; }
    if [ $rc -eq 0 ]; then
      gc_item "train_mlp_cuda --check forward_prefetch=$p" PASS "$(($(date +%s) - t0))" "$line"
    else
      tail -20 "$GC_STATE/logs/train_mlp_cuda-prefetch$p.log"
      gc_item "train_mlp_cuda --check forward_prefetch=$p" "$(failed_verdict $rc)" \
        "$(($(date +%s) - t0))" "exit $rc${line:+: $line}"
    fi
  done
  gc_stage_end
}

# ----------------------------------------------------------------------------- demo

stage_demo() {
  gc_stage_begin demo
  need_build || return
  local log=$GC_STATE/logs/train_gpt_cuda.log t0 rc detail
  t0=$(date +%s)
  # The README's demo on the GPU: 4 thread-ranks sharing it, then the checkpoint on 2.
  gc_timed 540 "$log" "${RUN_ENV[@]}" "$GC_BUILD/examples/gpt/train_gpt" --device cuda
  rc=$?
  detail="$(grep '^step' "$log" | tail -1 | tr -s ' '); $(grep '^validation loss' "$log")"
  if [ $rc -eq 0 ]; then
    gc_item "train_gpt --device cuda" PASS "$(($(date +%s) - t0))" "$detail"
  else
    tail -20 "$log"
    gc_item "train_gpt --device cuda" "$(failed_verdict $rc)" \
      "$(($(date +%s) - t0))" "exit $rc (log: logs/train_gpt_cuda.log)"
  fi
  gc_stage_end
}

# ----------------------------------------------------------------------------- the run

gc_stage_begin driver
gc_driver_check
rc=$?
if [ $rc -ne 0 ]; then
  gc_stage_end FAIL "$(tail -n 1 "$(gc_rec)/driver.notes" | sed 's/^STOP: //')"
  gc_summarize
  exit $rc
fi
gc_stage_end PASS
gpus=$(cat "$(gc_rec)/versions/gpus_visible")
for stage in "${GC_SELECTED[@]}"; do
  [ "$stage" != driver ] || continue
  if [ "$(gc_time_left)" -lt 60 ]; then  # not started: the summary lists it as not run yet
    echo "gpu-check: no time left in this invocation for the $stage stage: run it again (tools/gpu-check.sh $stage)"
    continue
  fi
  case $stage in
    driver | build) ;;
    *) [ -n "${nccl_found:-}" ] || { find_nccl_library; nccl_found=1; } ;;
  esac
  "stage_$stage"
done
echo "== gpu-check summary (also in $GC_OUT/summary.txt, summary.json) =="
gc_summarize
