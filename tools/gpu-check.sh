#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU: builds libfsdp with the CUDA
# parts, runs the GPU suite (the tests named Cuda*; on a GPU none may skip),
# runs the Python binding's GPU test (torch and cupy, zero-copy), runs the
# suite again under compute-sanitizer (memcheck, then racecheck), runs the
# CUDA benchmarks, and ends with a summary. Works without a package
# registry: build dependencies the machine lacks come from .gpu-deps/ (Debian
# packages that tools/gpu-deps.sh downloads elsewhere), unpacked into a prefix.
#
#   tools/gpu-check.sh [build dir, default build/gpu]
# Environment: FSDP_CUDA_ARCHS (default: native, the GPU present),
# FSDP_GPU_CHECK_OUT (a folder for the logs and JSON, default the build dir).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/gpu}
out=${FSDP_GPU_CHECK_OUT:-$build}
mkdir -p "$build" "$out"
summary=()
failed=0
note() { summary+=("$*"); echo "gpu-check: $*"; }

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU is visible here (nvidia-smi -L failed); this check needs one" >&2
  exit 2
fi
note "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"

cmake_args=(-DFSDP_WITH_CUDA=ON -DFSDP_WITH_MPI=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo
            "-DCMAKE_CUDA_ARCHITECTURES=${FSDP_CUDA_ARCHS:-native}")
if [ -d .gpu-deps ] && compgen -G ".gpu-deps/*.deb" >/dev/null; then
  prefix=/tmp/fsdp-gpu-deps
  mkdir -p "$prefix"
  for f in .gpu-deps/*.deb; do dpkg -x "$f" "$prefix"; done
  multiarch=$prefix/usr/lib/x86_64-linux-gnu
  export PATH=$prefix/usr/bin:$PATH
  export LD_LIBRARY_PATH=$multiarch${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PKG_CONFIG_PATH=$multiarch/pkgconfig:$multiarch/openblas-pthread/pkgconfig:$prefix/usr/share/pkgconfig
  sed -i "s|=/usr|=$prefix/usr|" "$multiarch"/pkgconfig/*.pc  # their paths say /usr
  compgen -G "$multiarch/openblas-pthread/pkgconfig/*.pc" >/dev/null &&
    sed -i "s|=/usr|=$prefix/usr|" "$multiarch"/openblas-pthread/pkgconfig/*.pc
  cmake_args+=("-DCMAKE_PREFIX_PATH=$prefix/usr" "-DCMAKE_LIBRARY_PATH=$multiarch" "-DCMAKE_INCLUDE_PATH=$prefix/usr/include")
  [ -d "$prefix/usr/src/googletest" ] && cmake_args+=("-DFSDP_GTEST_SOURCE_DIR=$prefix/usr/src/googletest")
  note "build dependencies from .gpu-deps ($(ls .gpu-deps/*.deb | wc -l) packages) in $prefix"
fi
# NCCL: the toolkit's, or a Python package's (nvidia-nccl-cu*: headers to
# build against, the library that comm=nccl opens at run time).
nccl_dir=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null || true)
if [ -n "$nccl_dir" ] && [ -f "$nccl_dir/include/nccl.h" ]; then
  cmake_args+=("-DNCCL_ROOT=$nccl_dir")
  [ -f "$nccl_dir/lib/libnccl.so.2" ] && export FSDP_NCCL_LIBRARY="$nccl_dir/lib/libnccl.so.2"
  note "NCCL from the Python package in $nccl_dir"
fi
# cuDNN (the GPU GPT's attention, examples/gpt/cuda): the toolkit's or the
# system's, else a Python package's (nvidia-cudnn-cu*, which torch brings).
# cudnn-frontend's headers come from .gpu-deps/cudnn-frontend (tools/gpu-deps.sh).
if ! compgen -G "/usr/local/cuda/include/cudnn_version.h" >/dev/null &&
   ! compgen -G "/usr/include/cudnn_version*.h" >/dev/null &&
   ! compgen -G "/usr/include/x86_64-linux-gnu/cudnn_version*.h" >/dev/null; then
  cudnn_dir=$(python3 -c 'import nvidia.cudnn as n; print(list(n.__path__)[0])' 2>/dev/null || true)
  if [ -n "$cudnn_dir" ] && [ -f "$cudnn_dir/include/cudnn_version.h" ]; then
    cmake_args+=("-DCUDNN_ROOT=$cudnn_dir")
    export LD_LIBRARY_PATH=$cudnn_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}  # libcudnn opens its parts by name
    note "cuDNN from the Python package in $cudnn_dir"
  fi
fi
command -v ninja >/dev/null && cmake_args+=(-G Ninja)

if ! cmake -S . -B "$build" "${cmake_args[@]}" >"$out/configure.log" 2>&1; then
  tail -30 "$out/configure.log"
  note "configure FAILED (log: $out/configure.log)"
  printf '%s\n' "${summary[@]}"
  exit 1
fi
if ! cmake --build "$build" -j"$(nproc)" >"$out/build.log" 2>&1; then
  grep -m20 -B2 -A8 "error" "$out/build.log"
  note "build FAILED (log: $out/build.log)"
  printf '%s\n' "${summary[@]}"
  exit 1
fi
note "built: $(python3 -c '
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1]); lib.fsdp_build_info.restype = ctypes.c_char_p
print(lib.fsdp_build_info().decode())' "$build/src/libfsdp.so")"

# The GPU GPT (examples/gpt/cuda, its tests CudaGpt.*) needs OpenBLAS, cuDNN 9
# and cudnn-frontend's headers; configure says which one was missing.
if ! nm -C "$build/examples/gpt/train_gpt" 2>/dev/null | grep -q make_cuda_trainer; then
  failed=1
  note "the GPU GPT was not built: $(grep -h -A3 'GPU GPT\|OpenBLAS not found' "$out/configure.log" | tr -s ' \n' ' ' | head -c 400)"
fi

# The GPU suite: every test named Cuda*. On a GPU, a skip is a failure, but
# for the tests of machines without one (*WithoutAGpu*) and, with one GPU,
# those that need two (*AnotherGpu*), which are left out.
gpus=$(nvidia-smi -L | grep -c '^GPU')
exclude='WithoutAGpu'
[ "$gpus" -lt 2 ] && exclude+='|AnotherGpu|TwoGpus' && note "1 GPU: the tests that need 2 (*AnotherGpu*, *TwoGpus) are left out"
ctest --test-dir "$build" -R '^Cuda' -E "$exclude" -j4 --output-on-failure >"$out/gpu-suite.log" 2>&1
rc=$?
passed=$(grep -c " Passed " "$out/gpu-suite.log")
skipped=$(grep -c "(Skipped)\| Skipped " "$out/gpu-suite.log")
failures=$(grep -c "\*\*\*Failed\|\*\*\*Exception\|\*\*\*Timeout" "$out/gpu-suite.log")
if [ $rc -ne 0 ] || [ "$skipped" -ne 0 ] || [ "$passed" -eq 0 ]; then
  failed=1
  grep -A30 "\*\*\*Failed\|Skipped" "$out/gpu-suite.log" | head -80
  note "GPU suite FAILED: $passed passed, $failures failed, $skipped skipped (log: $out/gpu-suite.log)"
else
  note "GPU suite: $passed passed, 0 failed, 0 skipped"
fi

# The Python binding on the GPU (torch and cupy zero-copy), with that
# machine's Python; pytest from .gpu-deps/wheels when it has none.
pyenv=()
if ! python3 -c "import pytest" 2>/dev/null && [ -d .gpu-deps/wheels ]; then
  python3 -m pip install -q --no-index --find-links .gpu-deps/wheels --target /tmp/fsdp-gpu-pytest pytest \
    >"$out/pytest-install.log" 2>&1 && pyenv=(PYTHONPATH=/tmp/fsdp-gpu-pytest)
fi
if env "${pyenv[@]}" python3 -c "import pytest" 2>/dev/null; then
  if env "${pyenv[@]}" FSDP_LIBRARY="$PWD/$build/src/libfsdp.so" PYTHONPATH="$PWD/bindings/python${pyenv:+:/tmp/fsdp-gpu-pytest}" \
      python3 -m pytest -q -rs -p no:cacheprovider bindings/python/tests/test_cuda.py >"$out/python-gpu.log" 2>&1 &&
      ! grep -q "skipped" "$out/python-gpu.log"; then
    note "Python GPU test: $(tail -1 "$out/python-gpu.log")"
  else
    failed=1
    tail -40 "$out/python-gpu.log"
    note "Python GPU test FAILED or skipped (log: $out/python-gpu.log)"
  fi
else
  failed=1
  note "pytest not found (run tools/gpu-deps.sh elsewhere and carry .gpu-deps): the Python GPU test did not run"
fi

# The GPU suite's binaries again under compute-sanitizer.
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    for t in test_cuda test_cuda_engine; do
      log="$out/sanitizer-$tool-$t.log"
      if compute-sanitizer --tool "$tool" --error-exitcode 99 "$build/tests/$t" --gtest_filter=-'*WithoutAGpu*:*AnotherGpu*' \
          >"$log" 2>&1; then
        note "compute-sanitizer $tool $t: clean ($(grep -o 'PASSED.*' "$log" | tail -1))"
      else
        failed=1
        tail -40 "$log"
        note "compute-sanitizer $tool $t FAILED (log: $log)"
      fi
    done
  done
else
  failed=1
  note "compute-sanitizer not found: the sanitizer runs did not happen"
fi

# The GPU GPT under memcheck: its kernels, cuBLAS and cuDNN on one step beside
# the CPU model, and trained through libfsdp.
if [ -x "$build/tests/test_gpt_cuda" ] && command -v compute-sanitizer >/dev/null; then
  log="$out/sanitizer-memcheck-test_gpt_cuda.log"
  if compute-sanitizer --tool memcheck --error-exitcode 99 "$build/tests/test_gpt_cuda" >"$log" 2>&1; then
    note "compute-sanitizer memcheck test_gpt_cuda: clean ($(grep -o 'PASSED.*' "$log" | tail -1))"
  else
    failed=1
    tail -40 "$log"
    note "compute-sanitizer memcheck test_gpt_cuda FAILED (log: $log)"
  fi
fi

# Benchmarks (JSON lines).
if [ -x "$build/benchmarks/bench_cuda_kernels" ]; then
  "$build/benchmarks/bench_cuda_kernels" | tee "$out/bench_cuda_kernels.json"
  note "bench_cuda_kernels: $(python3 -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(", ".join("%s %.2f of copy" % (r["kernel"], r["ratio_to_copy"]) for r in rows if "kernel" in r) or rows)
' "$out/bench_cuda_kernels.json")"
fi

if [ -x "$build/benchmarks/bench_cuda_engine" ]; then
  "$build/benchmarks/bench_cuda_engine" | tee "$out/bench_cuda_engine.json"
  note "bench_cuda_engine: $(python3 -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("; ".join(", ".join("%s=%s" % kv for kv in r.items() if kv[0] != "bench") for r in rows))
' "$out/bench_cuda_engine.json")"
fi

if [ -x "$build/benchmarks/bench_nccl" ] && [ "$gpus" -ge 2 ]; then
  examples/cuda/launch_local.sh "$gpus" "$build/benchmarks/bench_nccl" | tee "$out/bench_nccl.json"
  note "bench_nccl ($gpus GPUs): $(python3 -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print(", ".join("%s %d MiB %.2f of NCCL" % (r["collective"], r["bytes"] / 2**20, r["ratio_to_nccl"]) for r in rows if "collective" in r))
' "$out/bench_nccl.json")"
fi
# The example's step with and without prefetch (overlap), one GPU.
if [ -x "$build/examples/cuda/train_mlp_cuda" ]; then
  for p in 0 1; do
    FSDP_FORWARD_PREFETCH=$p "$build/examples/cuda/train_mlp_cuda" --steps 100 >"$out/example-prefetch$p.log" 2>&1
    note "train_mlp_cuda forward_prefetch=$p: $(grep -h 'step time\|FSDP_ERR' "$out/example-prefetch$p.log" | head -1)"
  done
fi

# The README's demo on the GPU (4 thread-ranks sharing it, then the checkpoint
# on 2): loss, validation loss against the unigram baseline, tokens/s.
if [ -x "$build/examples/gpt/train_gpt" ]; then
  if "$build/examples/gpt/train_gpt" --device cuda >"$out/train_gpt_cuda.log" 2>&1; then
    note "train_gpt --device cuda: $(grep '^step' "$out/train_gpt_cuda.log" | tail -1 | tr -s ' '); $(grep '^validation loss' "$out/train_gpt_cuda.log")"
  else
    failed=1
    tail -20 "$out/train_gpt_cuda.log"
    note "train_gpt --device cuda FAILED (log: $out/train_gpt_cuda.log)"
  fi
fi

echo "== gpu-check summary =="
printf '%s\n' "${summary[@]}"
exit $failed
