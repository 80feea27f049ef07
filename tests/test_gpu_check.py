#!/usr/bin/env python3
"""The GPU check's parts that need no GPU (tools/gpu-check.sh, its
gpu_check_lib.sh and gpu_check_summary.py, examples/cuda/launch_local.sh, and
the GPU tests' skip rule in tests/gpu_presence.h), run with stand-ins on PATH:
nvidia-smi, nvcc, cmake, ctest and compute-sanitizer. Another stand-in,
a pytest package, goes on PYTHONPATH.

- the driver check: a driver older than the toolkit needs stops the check
  plainly, before any build; R580 runs CUDA 13, R525 CUDA 12;
- stages: only the ones named run, an unknown one is refused, and a second
  build invocation reuses a finished build of the same sources;
- the skip-to-failure rule: a skipped GPU test fails the check, and the GPU
  test binaries (given with --gtest-binary, as CTest does) fail where
  nvidia-smi lists a GPU that CUDA cannot use and skip where it lists none;
- the summary: assembled from files, so that a run invocation summarizes a
  build that an earlier invocation made; every verdict, each benchmark's
  figure and ratio to its limit, and one PASS/FAIL line naming the failures;
  compute-sanitizer's "Device not supported" is reported as unavailable;
- launch_local.sh: GPUs counted as CUDA_VISIBLE_DEVICES shows them, and the
  other ranks stopped when one fails or the launcher gets SIGTERM.

Plain unittest (no pytest needed): python3 tests/test_gpu_check.py [--gtest-binary PATH:FILTER]...
"""
import argparse
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import gpu_check_summary as summary  # noqa: E402

GTEST_BINARIES = []  # (path, filter) from the command line

# ----------------------------------------------------------------------------- stand-ins

NVIDIA_SMI = r"""#!/bin/sh
# nvidia-smi: FAKE_GPUS GPUs (0: "No devices were found"), driver FAKE_DRIVER; FAKE_SMI_FAILS: exits 9.
[ -n "$FAKE_SMI_FAILS" ] && { echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"; exit 9; }
n=${FAKE_GPUS:-1}
case "$1" in
  -L)
    [ "$n" -eq 0 ] && { echo "No devices were found"; exit 6; }
    i=0; while [ $i -lt $n ]; do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-0000000$i-1111-2222-3333-444444444444)"; i=$((i+1)); done ;;
  --query-gpu=driver_version)
    i=0; while [ $i -lt $n ]; do echo "${FAKE_DRIVER:-580.159}"; i=$((i+1)); done ;;
  --query-gpu=*)
    i=0; while [ $i -lt $n ]; do echo "NVIDIA H100 80GB HBM3, ${FAKE_DRIVER:-580.159}, 81559 MiB"; i=$((i+1)); done ;;
  *) echo "| NVIDIA-SMI ${FAKE_DRIVER:-580.159}    Driver Version: ${FAKE_DRIVER:-580.159}    CUDA Version: ${FAKE_DRIVER_CUDA:-13.0} |" ;;
esac
"""

NVCC = r"""#!/bin/sh
echo "nvcc: NVIDIA (R) Cuda compiler driver"
echo "Cuda compilation tools, release ${FAKE_CUDA:-13.0}, V${FAKE_CUDA:-13.0}.48"
"""

# cmake: configure records its arguments and writes a cache; --build makes
# the programs the check looks for (FAKE_NO_GPT: no GPU GPT), libfsdp.so a
# real shared library whose fsdp_build_info answers.
CMAKE = r"""#!/bin/bash
echo "cmake $*" >>"$FAKE_LOG"
if [ "$1" = --version ]; then echo "cmake version 3.31.0"; exit 0; fi
if [ "$1" = --build ]; then
  b=$2
  [ -n "$FAKE_BUILD_FAILS" ] && { echo "x.cu(1): error: it broke"; exit 2; }
  mkdir -p "$b/src" "$b/tests" "$b/examples/cuda" "$b/examples/gpt" "$b/benchmarks"
  printf 'const char* fsdp_build_info(void) { return "libfsdp 0.1.0 devices=cpu,cuda cuda=13.0 (stand-in)"; }\n' >"$b/info.c"
  cc -shared -fPIC -o "$b/src/libfsdp.so" "$b/info.c" || exit 1
  progs="tests/test_cuda tests/test_cuda_engine tests/test_cuda_graph examples/cuda/train_mlp_cuda examples/gpt/train_gpt"
  progs="$progs benchmarks/bench_cuda_kernels benchmarks/bench_cuda_engine benchmarks/bench_nccl"
  [ -n "$FAKE_NO_GPT" ] || progs="$progs tests/test_gpt_cuda"
  for p in $progs; do cp "$FAKE_BIN/program" "$b/$p"; done
  exit 0
fi
b=.
while [ $# -gt 0 ]; do [ "$1" = -B ] && b=$2; shift; done
mkdir -p "$b"
printf 'CMAKE_GENERATOR:INTERNAL=Ninja\nCMAKE_CXX_COMPILER:FILEPATH=/bin/true\nFSDP_NCCL_INCLUDE_DIR:PATH=%s\n' "$FAKE_BIN" >"$b/CMakeCache.txt"
echo "-- libfsdp: building the GPU GPT"
"""

# The built programs: benchmarks print JSON lines, the examples their lines;
# FAKE_FAIL=name makes that one exit 3.
PROGRAM = r"""#!/bin/bash
name=$(basename "$0")
echo "$name $*" >>"$FAKE_LOG"
case $name in
  bench_cuda_kernels)
    echo '{"bench": "cuda_kernels", "kernel": "copy_d2d", "GBps": 3000, "ratio_to_copy": 1.0}'
    echo '{"bench": "cuda_kernels", "kernel": "adamw", "GBps": 2400, "ratio_to_copy": 0.8}'
    echo '{"bench": "cuda_kernels", "kernel": "adamw_spans+zero_grads", "GBps": 2700, "ratio_to_copy": 0.9}' ;;
  bench_cuda_engine)
    echo '{"bench": "cuda_engine", "what": "mlp_step", "plain_ms": 2.0, "fsdp_ms": 2.2, "overhead_ratio": 1.1}'
    echo '{"bench": "cuda_engine", "what": "transition_call_host_time", "calls": 100, "us_per_call": 4.0, "goal_us": 5.0}' ;;
  bench_nccl)
    [ "$RANK" = 0 ] && echo '{"bench": "nccl", "collective": "all_gather", "world": 2, "bytes": 1048576, "ratio_to_nccl": 0.97}' ;;
  train_mlp_cuda)
    echo "step time: $([ "$FSDP_FORWARD_PREFETCH" = 1 ] && echo 8.000 || echo 10.000) ms (median of 100 steps)"
    echo "loss 1.0 -> 0.3: it learned" ;;
  train_gpt)
    echo "step   600  train 1.8000  val 1.8100  tokens/s  500000  per-rank MiB params 1.00 grads 1.00 optim 1.00"
    echo "validation loss 1.7900 nats/byte against the unigram baseline's 3.1600 (57% of it)" ;;
esac
[ "${FAKE_FAIL:-}" = "$name" ] && exit 3
exit 0
"""

# ctest: prints FAKE_CTEST_LOG (its own lines otherwise) and exits FAKE_CTEST_RC.
CTEST = r"""#!/bin/bash
echo "ctest $*" >>"$FAKE_LOG"
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" >>"$FAKE_LOG"
if [[ " $* " == *TwoGpus\ -E* ]]; then
  echo "1/1 Test #40: CudaEngine.NcclProcessesTrainLikeTheSameWorldOnTheCpu_OnTwoGpus ...   Passed   12.31 sec"
  exit 0
fi
if [ -n "$FAKE_CTEST_LOG" ]; then cat "$FAKE_CTEST_LOG"; else
  echo "1/2 Test #1: CudaKernels.CastMatchesTheCpuBitwiseAndClearsItsSource ...   Passed    0.50 sec"
  echo "2/2 Test #2: CudaEngine.TrainsBitwiseLikeTheCpuDevice .................   Passed    3.00 sec"
fi
exit ${FAKE_CTEST_RC:-0}
"""

# compute-sanitizer: FAKE_SANITIZER = clean (default), unsupported (gVisor's
# refusal), skipped (the tests skip under it) or errors (exit 99).
SANITIZER = r"""#!/bin/bash
echo "compute-sanitizer $*" >>"$FAKE_LOG"
echo "========= COMPUTE-SANITIZER"
case ${FAKE_SANITIZER:-clean} in
  unsupported) echo "========= Error: Device not supported"; echo "[  PASSED  ] 0 tests."; exit 0 ;;
  skipped) echo "[  PASSED  ] 12 tests."; echo "[  SKIPPED ] 1 test, listed below:"; echo "[  SKIPPED ] CudaKernels.Cast"
           echo "========= ERROR SUMMARY: 0 errors"; exit 0 ;;
  errors) echo "========= Invalid __global__ read of size 4 bytes"; echo "[  PASSED  ] 5 tests."
          echo "========= ERROR SUMMARY: 1 error"; exit 99 ;;
  *) echo "[  PASSED  ] 13 tests."; echo "========= ERROR SUMMARY: 0 errors"; exit 0 ;;
esac
"""

# tools/test_go.sh: FAKE_GO_FAIL makes a GPU test fail.
TEST_GO = r"""#!/bin/bash
echo "test_go.sh $* FSDP_REQUIRE_GPU=$FSDP_REQUIRE_GPU" >>"$FAKE_LOG"
if [ -n "$FAKE_GO_FAIL" ]; then echo "--- FAIL: TestCudaTrainsLikeTheCpu (0.5s)"; echo "FAIL"; exit 1; fi
echo "ok  	github.com/libfsdp/fsdp	3.1s"
"""

# The stand-in pytest package: records FSDP_LIBRARY, writes a JUnit file with
# one case (FAKE_PYTEST=skip: skipped), exits 0.
PYTEST_MAIN = r"""
import os, sys
junit = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--junitxml="))
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write("pytest FSDP_LIBRARY=%s\n" % os.environ.get("FSDP_LIBRARY"))
body = '<skipped message="GPU test not run: no CUDA device can be used here"/>' if os.environ.get("FAKE_PYTEST") == "skip" else ""
with open(junit, "w") as f:
    f.write('<testsuites><testsuite><testcase classname="test_cuda" name="test_torch_world1" time="1.5">%s</testcase>'
            '</testsuite></testsuites>' % body)
"""


def write(path, text, mode=0o644):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)


class Sandbox:
    """A copy of the check's scripts in a scratch checkout, stand-ins on PATH."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.root = os.path.join(tmp, "repo")
        for rel in ("tools/gpu-check.sh", "tools/gpu_check_lib.sh", "tools/gpu_check_build.sh",
                    "tools/gpu_check_summary.py", "examples/cuda/launch_local.sh"):
            dst = os.path.join(self.root, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, rel), dst)
        write(os.path.join(self.root, "CMakeLists.txt"), "project(stand_in)\n")
        write(os.path.join(self.root, "src/a.cpp"), "int a() { return 1; }\n")
        write(os.path.join(self.root, "bindings/python/tests/test_cuda.py"), "# stand-in\n")
        write(os.path.join(self.root, "tools/test_go.sh"), TEST_GO, 0o755)
        self.bin = os.path.join(tmp, "bin")
        for name, text in (("nvidia-smi", NVIDIA_SMI), ("nvcc", NVCC), ("cmake", CMAKE), ("ctest", CTEST), ("go", "#!/bin/sh\n"),
                           ("compute-sanitizer", SANITIZER), ("program", PROGRAM)):
            write(os.path.join(self.bin, name), text, 0o755)
        write(os.path.join(tmp, "py/pytest/__init__.py"), "")
        write(os.path.join(tmp, "py/pytest/__main__.py"), PYTEST_MAIN)
        self.log = os.path.join(tmp, "calls.log")
        self.build = os.path.join(tmp, "build")  # absolute, outside the checkout
        self.out = os.path.join(tmp, "out")

    def env(self, **extra):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_", "FSDP_", "CUDA_VISIBLE"))}
        env.update(PATH=self.bin + os.pathsep + env.get("PATH", "/usr/bin:/bin"), FAKE_LOG=self.log, FAKE_BIN=self.bin,
                   PYTHONPATH=os.path.join(self.tmp, "py"), CUDA_HOME=self.tmp, FSDP_GPU_CHECK_BUDGET_S="300")
        env.update(extra)
        return env

    def check(self, *stages, **env):
        """Runs gpu-check.sh from the scratch folder; returns (exit status, its output)."""
        if os.path.exists(self.log):
            os.remove(self.log)
        env.setdefault("FSDP_GPU_CHECK_OUT", "out")  # relative: to where it runs
        p = subprocess.run(["bash", os.path.join(self.root, "tools/gpu-check.sh"), "--build-dir", self.build] +
                           list(stages), cwd=self.tmp, env=self.env(**env), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=240)
        return p.returncode, p.stdout

    def calls(self):
        try:
            with open(self.log) as f:
                return f.read()
        except OSError:
            return ""

    def summary(self):
        with open(os.path.join(self.out, "summary.json")) as f:
            return json.load(f)

    def summary_text(self):
        with open(os.path.join(self.out, "summary.txt")) as f:
            return f.read()


class ScriptTest(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory(prefix="gpu-check-test-")
        self.sb = Sandbox(self._tmp.name)

    def tearDown(self):
        self._tmp.cleanup()

    def assertRan(self, rc, out, expected=0):
        self.assertEqual(rc, expected, out)


# ----------------------------------------------------------------------------- the driver check


class DriverCheck(ScriptTest):
    def test_a_driver_older_than_r580_stops_a_cuda13_check_before_anything_else(self):
        rc, out = self.sb.check(FAKE_DRIVER="575.57.08", FAKE_DRIVER_CUDA="12.9")
        self.assertEqual(rc, 3, out)
        self.assertIn("575.57.08", out)
        self.assertIn("needs driver R580 or newer", out)
        self.assertIn("Nothing else was run", out)
        self.assertNotIn("cmake", self.sb.calls())
        self.assertEqual(self.sb.summary()["verdict"], "FAIL")
        self.assertIn("gpu-check: FAIL: driver stage", self.sb.summary_text())

    def test_r580_runs_cuda13_and_the_driver_stage_alone_records_the_versions(self):
        rc, out = self.sb.check("driver")
        self.assertRan(rc, out)
        self.assertIn("driver 580.159 runs CUDA 13.0 code", out)
        s = self.sb.summary()
        self.assertEqual(s["versions"]["driver"], "580.159")
        self.assertEqual(s["versions"]["toolkit"], "13.0")
        self.assertEqual(s["versions"]["gpus_listed"], "1")
        self.assertEqual(s["verdict"], "INCOMPLETE")
        self.assertNotIn("cmake", self.sb.calls())

    def test_the_needed_driver_follows_the_toolkit(self):
        rc, out = self.sb.check("driver", FAKE_CUDA="12.4", FAKE_DRIVER="550.54.15")
        self.assertRan(rc, out)
        rc, out = self.sb.check("driver", FAKE_CUDA="12.4", FAKE_DRIVER="520.61.05")
        self.assertEqual(rc, 3, out)
        self.assertIn("needs driver R525 or newer", out)

    def test_no_gpu_listed_or_no_driver_answering_stops_with_2(self):
        rc, out = self.sb.check("driver", FAKE_GPUS="0")
        self.assertEqual(rc, 2, out)
        self.assertIn("lists no GPU", out)
        rc, out = self.sb.check("driver", FAKE_SMI_FAILS="1")
        self.assertEqual(rc, 2, out)
        self.assertIn("does not answer", out)


# ----------------------------------------------------------------------------- stages and the build


class Stages(ScriptTest):
    def test_an_unknown_stage_is_refused(self):
        rc, out = self.sb.check("suit")
        self.assertEqual(rc, 2, out)
        self.assertIn("unknown stage 'suit'", out)

    def test_stage_selection_runs_only_the_stages_named_in_their_order(self):
        lib = os.path.join(ROOT, "tools/gpu_check_lib.sh")
        p = subprocess.run(["bash", "-c", f'. "{lib}"; gc_select_stages "$@" && echo "${{GC_SELECTED[*]}}"', "x",
                            "demo,suite", "sanitize"], stdout=subprocess.PIPE, text=True)
        self.assertEqual(p.stdout.split(), ["suite", "memcheck", "racecheck", "demo"])  # driver: always, first
        p = subprocess.run(["bash", "-c", f'. "{lib}"; gc_select_stages run && echo "${{GC_SELECTED[*]}}"'],
                           stdout=subprocess.PIPE, text=True)
        self.assertEqual(p.stdout.split(), ["suite", "python", "go", "memcheck", "racecheck", "bench", "demo"])

    def test_a_second_build_invocation_reuses_a_finished_build_of_the_same_sources(self):
        rc, out = self.sb.check("build")
        self.assertRan(rc, out)
        calls = self.sb.calls()
        self.assertIn("-DFSDP_WARNINGS_AS_ERRORS=OFF", calls)
        self.assertIn("cmake --build " + self.sb.build, calls)
        self.assertTrue(os.path.isfile(os.path.join(self.sb.build, "gpu-check-build.stamp")))
        rc, out = self.sb.check("build")
        self.assertRan(rc, out)
        self.assertIn("reusing the finished build", out)
        self.assertNotIn("cmake -S", self.sb.calls())
        self.assertNotIn("cmake --build", self.sb.calls())
        write(os.path.join(self.sb.root, "src/a.cpp"), "int a() { return 2; }\n")
        rc, out = self.sb.check("build")
        self.assertRan(rc, out)
        self.assertIn("cmake --build", self.sb.calls())

    def test_a_failed_build_leaves_no_stamp_and_the_run_stages_refuse(self):
        rc, out = self.sb.check("build", FAKE_BUILD_FAILS="1")
        self.assertEqual(rc, 1, out)
        self.assertFalse(os.path.exists(os.path.join(self.sb.build, "gpu-check-build.stamp")))
        rc, out = self.sb.check("suite")
        self.assertEqual(rc, 1, out)
        self.assertIn("run the build stage first", out)
        self.assertNotIn("ctest", self.sb.calls())

    def test_a_build_without_the_gpu_gpt_fails_naming_it(self):
        rc, out = self.sb.check("build", FAKE_NO_GPT="1")
        self.assertEqual(rc, 1, out)
        self.assertIn("built tests/test_gpt_cuda (build)", self.sb.summary_text().splitlines()[-1])


# ----------------------------------------------------------------------------- the run stages and the summary


class RunStages(ScriptTest):
    def build(self):
        rc, out = self.sb.check("build")
        self.assertRan(rc, out)

    def test_a_run_invocation_summarizes_a_build_of_an_earlier_one_and_passes_when_all_passes(self):
        self.build()
        rc, out = self.sb.check("run")
        self.assertRan(rc, out)
        s = self.sb.summary()
        self.assertEqual(s["verdict"], "PASS", self.sb.summary_text())
        self.assertTrue(self.sb.summary_text().rstrip().endswith("gpu-check: PASS"))
        self.assertIn("stand-in", s["versions"]["build_info"])  # recorded by the build invocation
        suite = {it["name"]: it["verdict"] for it in s["stages"]["suite"]["items"]}
        self.assertEqual(suite["CudaEngine.TrainsBitwiseLikeTheCpuDevice"], "PASS")
        self.assertEqual([it["verdict"] for it in s["stages"]["python"]["items"]], ["PASS"])
        bench = {b["name"]: b for b in s["benchmarks"]}
        adamw = bench["cuda_kernels adamw_spans+zero_grads"]  # the engine's optimizer pass: its goal 0.85
        self.assertAlmostEqual(adamw["ratio_to_limit"], 0.9 / 0.85)
        self.assertTrue(adamw["meets_goal"])
        self.assertIsNone(bench["cuda_kernels adamw"]["limit"])  # the per-range pass: measured beside it
        self.assertFalse(bench["cuda_engine MLP step vs plain CUDA"]["meets_goal"])
        self.assertAlmostEqual(bench["train_mlp_cuda prefetch on / off"]["figure"], 0.8)
        self.assertIn("train_gpt --device cuda validation loss", bench)
        calls = self.sb.calls()
        self.assertIn("FSDP_LIBRARY=" + os.path.join(self.sb.build, "src/libfsdp.so"), calls)  # absolute (G2)
        self.assertEqual(s["stages"]["go"]["verdict"], "PASS")
        self.assertIn("--check", calls.split("train_mlp_cuda", 1)[1].splitlines()[0])
        self.assertIn("ctest --test-dir", calls)
        self.assertIn("-E WithoutAGpu|AnotherGpu|TwoGpus -j4", calls)  # 1 GPU: the 2-GPU tests left out
        # The logs and the summary went to the out folder as the run went.
        self.assertTrue(os.path.isfile(os.path.join(self.sb.out, "logs", "suite.log")))
        self.assertTrue(os.path.isfile(os.path.join(self.sb.out, "progress.log")))

    def test_a_skipped_gpu_test_fails_the_check_by_name(self):
        self.build()
        log = os.path.join(self.sb.tmp, "ctest.log")
        write(log, "1/2 Test #1: CudaKernels.CastMatchesTheCpuBitwiseAndClearsItsSource ...   Passed    0.50 sec\n"
                   "2/2 Test #2: CudaGpt.OneStepMatchesTheCpuModel ...***Skipped   0.01 sec\n")
        rc, out = self.sb.check("suite", FAKE_CTEST_LOG=log)
        self.assertEqual(rc, 1, out)
        last = self.sb.summary_text().rstrip().splitlines()[-1]
        self.assertTrue(last.startswith("gpu-check: FAIL: "), last)
        self.assertIn("CudaGpt.OneStepMatchesTheCpuModel (suite)", last)
        self.assertNotIn("CastMatches", last)

    def test_a_skipped_python_gpu_test_fails(self):
        self.build()
        rc, out = self.sb.check("python", FAKE_PYTEST="skip")
        self.assertEqual(rc, 1, out)
        self.assertIn("test_cuda::test_torch_world1 (python)", self.sb.summary_text())

    def test_two_gpus_run_the_multi_process_nccl_tests_after_the_rest_one_at_a_time(self):
        self.build()
        rc, out = self.sb.check("suite", FAKE_GPUS="2")
        self.assertRan(rc, out)
        ctests = [l for l in self.sb.calls().splitlines() if l.startswith("ctest")]
        self.assertEqual(len(ctests), 2, ctests)
        self.assertIn("-E WithoutAGpu|TwoGpus -j4", ctests[0])
        self.assertIn("-R ^Cuda.*TwoGpus -E WithoutAGpu -j1", ctests[1])

    def test_a_benchmark_or_example_that_exits_non_zero_fails(self):
        self.build()
        for name in ("bench_cuda_kernels", "train_mlp_cuda"):
            rc, out = self.sb.check("bench", FAKE_FAIL=name)
            self.assertEqual(rc, 1, out)
            self.assertIn(name, self.sb.summary_text().rstrip().splitlines()[-1])

    def test_the_go_stage_runs_the_bindings_tests_requiring_the_gpu_and_names_a_failure(self):
        self.build()
        rc, out = self.sb.check("go")
        self.assertRan(rc, out)
        self.assertIn("test_go.sh " + self.sb.build + " FSDP_REQUIRE_GPU=1", self.sb.calls())
        rc, out = self.sb.check("go", FAKE_GO_FAIL="1")
        self.assertEqual(rc, 1, out)
        self.assertIn("TestCudaTrainsLikeTheCpu", self.sb.summary_text().rstrip().splitlines()[-1])

    def test_sanitizer_unavailable_on_the_device_is_reported_not_failed(self):
        self.build()
        rc, out = self.sb.check("sanitize", FAKE_SANITIZER="unsupported")
        self.assertRan(rc, out)
        s = self.sb.summary()
        self.assertEqual(s["stages"]["memcheck"]["verdict"], "UNAVAILABLE")
        self.assertEqual(s["stages"]["racecheck"]["verdict"], "UNAVAILABLE")
        self.assertEqual(s["verdict"], "INCOMPLETE")  # suite, python... not run in this test
        self.assertIn("unavailable on this machine, not failures", self.sb.summary_text())
        self.assertEqual(self.sb.calls().count("compute-sanitizer "), 1)  # not tried again once refused

    def test_sanitizer_passes_leave_out_nccl_processes_and_third_party_api_errors(self):
        self.build()
        rc, out = self.sb.check("memcheck")
        self.assertRan(rc, out)
        runs = [l for l in self.sb.calls().splitlines() if l.startswith("compute-sanitizer")]
        self.assertEqual(len(runs), 4, runs)
        for line in runs:
            self.assertIn("*TwoGpus*", line)
            self.assertIn("NcclChild.*", line)
            self.assertIn("GpuFaultChild.*", line)  # the GPU fault on purpose
            self.assertIn("*AFirstLaunchWaitsForNoOtherStream*", line)  # the tool serializes launches
            self.assertIn("--error-exitcode 99", line)
        # test_cuda but its NCCL tests: only libfsdp calls CUDA.
        self.assertIn("--report-api-errors explicit", runs[0])
        self.assertIn("test_cuda --gtest_filter=*-", runs[0])
        self.assertTrue(runs[0].endswith(":CudaNccl.*"), runs[0])
        # test_cuda's NCCL tests: libnccl probes its kernels with calls that fail.
        self.assertIn("--report-api-errors no", runs[1])
        self.assertIn("test_cuda --gtest_filter=CudaNccl.*-", runs[1])
        self.assertIn("--report-api-errors no", runs[2])        # test_cuda_engine: NCCL in the process
        self.assertIn("--report-api-errors no", runs[3])        # test_gpt_cuda: cuDNN and cuBLAS
        names = self.sb.summary_text()
        self.assertIn("compute-sanitizer memcheck test_cuda (-CudaNccl.*)", names)
        self.assertIn("compute-sanitizer memcheck test_cuda (CudaNccl.*)", names)

    def test_a_sanitizer_pass_whose_tests_skip_or_that_reports_errors_fails(self):
        self.build()
        for mode in ("skipped", "errors"):
            rc, out = self.sb.check("racecheck", FAKE_SANITIZER=mode)
            self.assertEqual(rc, 1, out)
            self.assertIn("compute-sanitizer racecheck test_cuda (racecheck)", self.sb.summary_text())

    def test_stages_left_without_time_are_listed_as_not_run_yet(self):
        self.build()
        rc, out = self.sb.check("suite", "demo", FSDP_GPU_CHECK_BUDGET_S="50")
        self.assertRan(rc, out)
        self.assertNotIn("ctest", self.sb.calls())
        last = self.sb.summary_text().rstrip().splitlines()[-1]
        self.assertTrue(last.startswith("gpu-check: INCOMPLETE"), last)
        self.assertIn("tools/gpu-check.sh suite python go memcheck racecheck bench demo", last)

    def test_a_new_build_makes_earlier_run_records_stale(self):
        self.build()
        rc, out = self.sb.check("suite")
        self.assertRan(rc, out)
        write(os.path.join(self.sb.root, "src/a.cpp"), "int a() { return 3; }\n")
        self.build()
        s = self.sb.summary()
        self.assertIn("suite", s["not_run"])


# ----------------------------------------------------------------------------- the summary's parts


class SummaryParts(unittest.TestCase):
    def test_ctest_lines_give_every_verdict_and_a_skip_is_a_failure(self):
        items = summary.ctest_items(textwrap.dedent("""\
            1/4 Test #1: CudaKernels.A ...........   Passed    0.50 sec
            2/4 Test #2: CudaKernels.B ...........***Skipped   0.00 sec
            3/4 Test #3: CudaKernels.C ...........***Timeout 300.01 sec
            4/4 Test #4: CudaKernels.D ...........***Exception: SegFault  0.10 sec
            """))
        self.assertEqual([(n, v) for n, v, _, _ in items],
                         [("CudaKernels.A", "PASS"), ("CudaKernels.B", "FAIL"), ("CudaKernels.C", "TIMEOUT"),
                          ("CudaKernels.D", "FAIL")])

    def test_sanitizer_verdicts(self):
        clean = "[  PASSED  ] 13 tests.\n========= ERROR SUMMARY: 0 errors\n"
        self.assertEqual(summary.sanitizer_verdict(clean, 0)[0], "PASS")
        self.assertEqual(summary.sanitizer_verdict("========= Error: Device not supported\n", 1)[0], "UNAVAILABLE")
        self.assertEqual(summary.sanitizer_verdict(clean + "[  SKIPPED ] CudaKernels.A\n", 0)[0], "FAIL")
        self.assertEqual(summary.sanitizer_verdict("[  PASSED  ] 0 tests.\n", 0)[0], "FAIL")
        self.assertEqual(summary.sanitizer_verdict(clean, 99)[0], "FAIL")
        self.assertEqual(summary.sanitizer_verdict(clean, 124)[0], "TIMEOUT")

    def test_benchmark_lines_give_their_figure_and_its_ratio_to_the_limit(self):
        f = summary.with_ratio(summary.bench_figures(
            {"bench": "nccl", "collective": "all_gather", "world": 2, "bytes": 2**20, "ratio_to_nccl": 0.76}))
        self.assertAlmostEqual(f["ratio_to_limit"], 0.8)
        self.assertFalse(f["meets_goal"])
        f = summary.with_ratio(summary.bench_figures(
            {"bench": "cuda_engine", "what": "transition_call_host_time", "us_per_call": 2.0, "goal_us": 5.0}))
        self.assertAlmostEqual(f["ratio_to_limit"], 0.4)
        self.assertTrue(f["meets_goal"])
        self.assertIsNone(summary.bench_figures({"bench": "cuda_kernels", "skipped": "no CUDA device"}))
        f = summary.bench_figures({"bench": "nccl", "what": "all_reduce", "ratio_to_nccl": 0.9})  # a new shape: kept
        self.assertEqual((f["name"], f["figure"]), ("nccl all_reduce", 0.9))
        self.assertEqual(summary.bench_verdict('{"bench": "nccl", "skipped": "no GPU"}\n', 0)[0], "FAIL")
        self.assertEqual(summary.bench_verdict('{"bench": "nccl", "collective": "x"}\n', 1)[0], "FAIL")


# ----------------------------------------------------------------------------- launch_local.sh


class LaunchLocal(ScriptTest):
    def launcher(self):
        return os.path.join(ROOT, "examples/cuda/launch_local.sh")

    def count(self, gpus, visible=None):
        env = self.sb.env(FAKE_GPUS=str(gpus))
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        return subprocess.run([self.launcher(), "--count-gpus"], env=env, stdout=subprocess.PIPE,
                              text=True).stdout.strip()

    def test_gpus_are_counted_as_cuda_visible_devices_shows_them(self):
        self.assertEqual(self.count(2), "2")
        self.assertEqual(self.count(2, "1"), "1")
        self.assertEqual(self.count(2, ""), "0")
        self.assertEqual(self.count(2, "0,5,1"), "1")  # CUDA stops at the first entry that names no GPU
        self.assertEqual(self.count(2, "GPU-00000001-1111"), "1")
        self.assertEqual(self.count(0), "0")

    def test_too_few_visible_gpus_say_so_in_the_words_ctest_skips_on(self):
        env = self.sb.env(FAKE_GPUS="2", CUDA_VISIBLE_DEVICES="0")
        p = subprocess.run([self.launcher(), "2", "/bin/true"], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
        self.assertEqual(p.returncode, 1)
        self.assertIn("need 2 GPUs", p.stdout)

    def rank_program(self, body):
        path = os.path.join(self.sb.tmp, "rank.sh")
        write(path, "#!/bin/bash\necho $$ >\"$PIDS/$RANK\"\n" + body, 0o755)
        os.makedirs(os.path.join(self.sb.tmp, "pids"), exist_ok=True)
        return path

    def alive(self):
        folder = os.path.join(self.sb.tmp, "pids")
        left = []
        for name in os.listdir(folder):
            with open(os.path.join(folder, name)) as f:
                pid = int(f.read())
            try:
                os.kill(pid, 0)
                left.append(pid)
            except ProcessLookupError:
                pass
        return left

    def test_the_other_ranks_are_stopped_when_one_fails(self):
        prog = self.rank_program('[ "$RANK" = 1 ] && { sleep 0.5; exit 3; }\nsleep 60\n')
        env = self.sb.env(FAKE_GPUS="2", PIDS=os.path.join(self.sb.tmp, "pids"), MASTER_PORT="29999")
        t0 = time.time()
        p = subprocess.run([self.launcher(), "2", prog], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=60)
        self.assertEqual(p.returncode, 3, p.stdout)
        self.assertLess(time.time() - t0, 30)
        self.assertIn("rank 1 exited with status 3", p.stdout)
        self.assertEqual(self.alive(), [])

    def test_sigterm_stops_every_rank(self):
        prog = self.rank_program("sleep 60\n")
        env = self.sb.env(FAKE_GPUS="2", PIDS=os.path.join(self.sb.tmp, "pids"), MASTER_PORT="29999")
        p = subprocess.Popen([self.launcher(), "2", prog], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        for _ in range(100):
            if len(os.listdir(os.path.join(self.sb.tmp, "pids"))) == 2:
                break
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
        self.assertEqual(p.returncode, 143)
        time.sleep(0.2)
        self.assertEqual(self.alive(), [])


# ----------------------------------------------------------------------------- the GPU tests' skip rule


class GpuExamplesSkipOnlyWithoutAGpu(ScriptTest):
    """tests/gpu_example.sh, in front of the examples' CTests, which CTest
    skips on the words 'no CUDA device can be used'."""

    def run_example(self, gpus, says, rc, **extra):
        prog = os.path.join(self.sb.tmp, "example.sh")
        write(prog, "#!/bin/sh\necho 'step 1 loss 2.0'\necho '%s'\nexit %d\n" % (says, rc), 0o755)
        env = self.sb.env(FAKE_GPUS=str(gpus), **extra)
        return subprocess.run([os.path.join(ROOT, "tests/gpu_example.sh"), prog], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=60)

    def test_without_a_gpu_the_examples_words_pass_through_and_ctest_skips(self):
        p = self.run_example(0, "device=cuda: no CUDA device can be used by this process", 1)
        self.assertEqual(p.returncode, 1)
        self.assertIn("no CUDA device can be used", p.stdout)
        self.assertIn("step 1 loss 2.0", p.stdout)

    def test_a_listed_gpu_that_cuda_cannot_use_fails_and_is_not_skipped(self):
        for rc in (1, 0):  # an example that exits 0 after saying it has no GPU fails too
            p = self.run_example(1, "device=cuda: no CUDA device can be used by this process", rc)
            self.assertNotEqual(p.returncode, 0, p.stdout)
            self.assertNotIn("no CUDA device can be used", p.stdout)
            self.assertIn("CUDA could not use a GPU that nvidia-smi lists (1 visible", p.stdout)
        p = self.run_example(1, "device=cuda: no CUDA device can be used by this process", 1, CUDA_VISIBLE_DEVICES="")
        self.assertIn("no CUDA device can be used", p.stdout)  # hidden on purpose: a skip
        p = self.run_example(0, "device=cuda: no CUDA device can be used by this process", 1, FSDP_REQUIRE_GPU="1")
        self.assertNotIn("no CUDA device can be used", p.stdout)

    def test_a_run_on_a_gpu_keeps_its_output_and_status(self):
        p = self.run_example(1, "loss halved: ok", 0)
        self.assertEqual(p.returncode, 0, p.stdout)
        self.assertIn("loss halved: ok", p.stdout)
        self.assertEqual(self.run_example(1, "loss did not fall", 3).returncode, 3)


class GpuTestsSkipOnlyWithoutAGpu(ScriptTest):
    """Each binary runs one test that starts with SKIP_WITHOUT_GPU. CUDA is
    made to find no device everywhere, a GPU machine included: the
    CUDA_VISIBLE_DEVICES UUID names no real GPU (the stand-in nvidia-smi
    lists it)."""

    def run_binary(self, path, filt, gpus, visible="GPU-00000000-1111-2222-3333-444444444444", **extra):
        env = self.sb.env(FAKE_GPUS=str(gpus), CUDA_VISIBLE_DEVICES=visible, **extra)
        return subprocess.run([path, "--gtest_filter=" + filt], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=120)

    def test_a_listed_gpu_that_cuda_cannot_use_fails_the_test(self):
        if not GTEST_BINARIES:
            self.skipTest("no GPU test binary given (--gtest-binary): this build has no CUDA")
        for path, filt in GTEST_BINARIES:
            p = self.run_binary(path, filt, gpus=1)
            self.assertNotEqual(p.returncode, 0, p.stdout)
            self.assertIn("nvidia-smi -L lists 1 GPU(s), but CUDA can use none", p.stdout)

    def test_without_a_listed_gpu_or_with_the_gpus_hidden_the_test_skips_saying_so(self):
        if not GTEST_BINARIES:
            self.skipTest("no GPU test binary given (--gtest-binary): this build has no CUDA")
        for path, filt in GTEST_BINARIES:
            for gpus, visible in ((0, "GPU-00000000-1111-2222-3333-444444444444"), (1, "")):
                p = self.run_binary(path, filt, gpus=gpus, visible=visible)
                self.assertEqual(p.returncode, 0, p.stdout)
                self.assertIn("[  SKIPPED ]", p.stdout)
                self.assertIn("no CUDA device can be used here", p.stdout)

    def test_with_fsdp_require_gpu_no_gpu_test_skips(self):
        if not GTEST_BINARIES:
            self.skipTest("no GPU test binary given (--gtest-binary): this build has no CUDA")
        for path, filt in GTEST_BINARIES:
            p = self.run_binary(path, filt, gpus=0, FSDP_REQUIRE_GPU="1")
            self.assertNotEqual(p.returncode, 0, p.stdout)
            self.assertIn("FSDP_REQUIRE_GPU=1", p.stdout)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--gtest-binary", action="append", default=[],
                        help="PATH:FILTER of a GPU test binary and one test of it that skips without a GPU")
    args, rest = parser.parse_known_args()
    for spec in args.gtest_binary:
        path, _, filt = spec.partition(":")
        GTEST_BINARIES.append((path, filt or "*"))
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
