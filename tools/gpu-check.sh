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
# FSDP_CUDA_ARCHS (default native, the GPU present), FSDP_GPU_CHECK_TARGETS
# (build only these CMake targets; default all). Relative folders are
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

# The run-time environment (NCCL, the libraries the build found) and the build
# stage: tools/gpu_check_build.sh.
# shellcheck source=tools/gpu_check_build.sh
. "$GC_ROOT/tools/gpu_check_build.sh"

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
