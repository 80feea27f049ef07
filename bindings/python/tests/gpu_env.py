# gpu_env.py - whether the GPU tests can run here, and how one that cannot says so: a skip naming the reason,
# or a failure where nvidia-smi lists a GPU that CUDA cannot use (the rule of tests/gpu_presence.h), and for
# every reason with FSDP_REQUIRE_GPU=1 (tools/gpu-check.sh on a machine with a GPU). Shared by test_cuda.py and
# the adapters' device=cuda cases.
import os
import subprocess

import pytest

import fsdp


def gpus_listed():
    """How many GPUs `nvidia-smi -L` lists (0 without it, or when CUDA_VISIBLE_DEVICES is "" or -1: hidden on
    purpose), as tests/gpu_presence.h counts them for the C++ GPU tests."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and (visible == "" or visible.startswith("-")):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _gpu_problem():
    """(why the GPU tests cannot run, whether that is a failure) or (None, False)."""
    if "cuda" not in fsdp.build_info():
        return "this libfsdp has no CUDA device (fsdp_build_info)", False
    try:
        fsdp.Context(fsdp.Config(device="cuda:0")).close()
    except fsdp.FsdpError as e:
        why = f"no CUDA device can be used here ({e.status_name}: {e.message})"
        listed = gpus_listed()
        if listed:  # a GPU is there but CUDA cannot use it (an old driver, missing device files): fail, not skip
            return f"nvidia-smi -L lists {listed} GPU(s), but {why}", True
        return why, False
    return None, False


PROBLEM, PROBLEM_FAILS = _gpu_problem()


def not_run(why, fails=False):
    """Skips, saying why; fails instead where a GPU is listed but unusable, and for every reason with
    FSDP_REQUIRE_GPU=1 (tools/gpu-check.sh on a machine with a GPU)."""
    if fails or os.environ.get("FSDP_REQUIRE_GPU") == "1":
        pytest.fail(f"GPU test could not run: {why}")
    pytest.skip(f"GPU test not run: {why}")


def need_gpu():
    """Inside a test: skips (or fails, see not_run) unless libfsdp can use cuda:0 here."""
    if PROBLEM is not None:
        not_run(PROBLEM, PROBLEM_FAILS)


def need_jax_gpu(jax):
    """need_gpu(), and a jax with a CUDA backend."""
    need_gpu()
    try:
        jax.devices("gpu")
    except RuntimeError as e:
        not_run(f"this jax has no CUDA backend ({e})")


def need_torch_gpu(torch):
    """need_gpu(), and a torch that sees a GPU."""
    need_gpu()
    if not torch.cuda.is_available():
        not_run(f"torch {torch.__version__} sees no GPU (a CPU-only build, or no device)")
