#!/usr/bin/env bash
# gpu_check_build.sh - sourced by tools/gpu-check.sh (not run alone): the GPU
# machine's run-time environment (where NCCL and the CUDA libraries are, the
# variables the stages run with) and the build stage (the dependencies
# carried in, the CMake configure and build, what the build found). Uses
# gpu-check.sh's variables (GC_ROOT, the folders) and gpu_check_lib.sh.

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
    if [ -n "${FSDP_GPU_CHECK_TARGETS:-}" ] && [[ " $FSDP_GPU_CHECK_TARGETS " != *" $(basename "$t" .so | sed 's/^lib//') "* ]]; then
      continue  # not asked for
    elif [ -e "$GC_BUILD/$t" ]; then
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
  # FSDP_GPU_CHECK_TARGETS: build only these targets (a short lease that
  # runs a few binaries); part of the stamp, so a later full build is not
  # taken for this one.
  local targets=()
  read -ra targets <<<"${FSDP_GPU_CHECK_TARGETS:-}"
  id=$(gc_source_id "${cmake_args[@]}" "targets=${targets[*]}" \
    "$(cd "$GC_ROOT/.gpu-deps" 2>/dev/null && compgen -G '*.deb')")
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
  gc_timed 570 "$GC_STATE/logs/build.log" env "${configure_env[@]}" cmake --build "$GC_BUILD" -j"$(nproc)" \
    ${targets[@]:+--target "${targets[@]}"}
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

