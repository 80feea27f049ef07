# test_install.py - the installed package carries its own libfsdp.so and loads it; FSDP_LIBRARY overrides it.
import os
import shutil
import subprocess
import sys

import pytest

import fsdp

PKG_DIR = os.path.dirname(os.path.abspath(fsdp.__file__))
PACKAGED = os.path.join(PKG_DIR, "libfsdp.so")


def _import_in_child(env_library, code="import fsdp; print(fsdp.LIB_PATH)"):
    env = {k: v for k, v in os.environ.items() if k != "FSDP_LIBRARY"}
    if env_library is not None:
        env["FSDP_LIBRARY"] = env_library
    # cwd / (not bindings/python): the child imports the installed package, as a user's script does.
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/", timeout=60)


def test_package_loads_its_own_library():
    assert os.path.isfile(PACKAGED), f"no libfsdp.so in the package at {PKG_DIR}; install it with pip install ./bindings/python"
    r = _import_in_child(None, "import fsdp; print(fsdp.LIB_PATH); print(fsdp.build_info())")
    assert r.returncode == 0, r.stderr
    path, info = r.stdout.splitlines()[:2]
    assert path == PACKAGED and "libfsdp" in info
    if os.environ.get("FSDP_LIBRARY") is None:  # this test process too
        assert fsdp.LIB_PATH == PACKAGED


def test_fsdp_library_overrides(tmp_path):
    lib = str(tmp_path / "libfsdp-elsewhere.so")
    shutil.copy(fsdp.LIB_PATH, lib)
    r = _import_in_child(lib)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == lib
    # Only that path when set: a missing one is an ImportError naming it, not a fallback to the package's.
    r = _import_in_child(str(tmp_path / "missing.so"))
    assert r.returncode != 0 and "ImportError" in r.stderr and "missing.so" in r.stderr, r.stderr


def test_a_library_that_is_not_libfsdp_is_refused(tmp_path):
    libz = next((p for p in ("/usr/lib/x86_64-linux-gnu/libz.so.1", "/lib/x86_64-linux-gnu/libz.so.1",
                             "/usr/lib64/libz.so.1") if os.path.exists(p)), None)
    if libz is None:
        pytest.skip("no libz.so.1 to load")
    r = _import_in_child(libz)
    assert r.returncode != 0 and "not libfsdp" in r.stderr, r.stderr


def test_a_call_an_older_library_lacks_raises_unsupported():
    """A libfsdp from FSDP_LIBRARY that predates a call still imports; the call raises, naming what is missing."""
    call = fsdp._lib._missing("fsdp_metrics_reduce", "/old/libfsdp.so")
    with pytest.raises(fsdp.Unsupported, match="fsdp_metrics_reduce is not in the libfsdp loaded from /old/libfsdp.so"):
        call(None, None, 0, 0)
