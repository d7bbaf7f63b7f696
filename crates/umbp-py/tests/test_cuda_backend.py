"""The CUDA backend is in every build of the package (pyproject.toml's maturin features: the
wheel CI builds and a build from source alike), and it costs a machine without a GPU nothing:
the CUDA driver is opened only when a CUDA engine starts, and its absence is an `umbp.Error`
naming the library, not a crash. Runs anywhere: the GPU's own tests are in test_umbp.py."""

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import umbp

#: What a child process runs first: a restore on the simulated device, checked, so the
#: package's own paths all ran before the CUDA engine is asked for.
SIM_RESTORE = textwrap.dedent(
    """
    import sys
    import numpy as np, umbp

    engine = umbp.Engine("sim")
    dram = np.arange(1 << 20, dtype=np.uint8)
    with engine.register(dram) as tier, engine.alloc_device(128 << 10) as kv:
        obj = umbp.Object(tag=1, tier=tier, page_offsets=[3 << 16, 9 << 16], page_size=1 << 16,
                          size=128 << 10, ranges=[umbp.Range(0, 128 << 10, kv, 0)])
        engine.start_restore([obj]).wait(timeout=60)
        got = np.frombuffer(engine.read(kv, 0, 128 << 10), dtype=np.uint8)
        want = np.concatenate([dram[3 << 16 : 4 << 16], dram[9 << 16 : 10 << 16]])
        assert np.array_equal(got, want), "the simulated restore moved wrong bytes"
    """
)


def _child(code, **env):
    """Runs `code` in a fresh interpreter (a crash there is a failed assertion here)."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, **env),
    )
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def _driver_installed():
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def test_every_build_has_the_cuda_backend():
    assert umbp.CUDA is True, "this build lacks the CUDA backend: pyproject.toml's features?"


def test_a_cuda_engine_without_a_driver_says_so_and_the_process_goes_on():
    if _driver_installed():
        pytest.skip("a CUDA driver is installed here: the GPU tests in test_umbp.py cover it")
    out = _child(
        SIM_RESTORE
        + textwrap.dedent(
            """
            try:
                umbp.Engine("cuda")
            except umbp.Error as e:
                print("error:", e)
            else:
                sys.exit("Engine('cuda') started without a CUDA driver")
            # The failed start left nothing behind: the simulated engine still works.
            assert umbp.Engine("sim").device_kind == "sim"
            print("after: ok")
            """
        )
    )
    assert "error: libcuda cannot be loaded: no CUDA driver library" in out, out
    assert "after: ok" in out


def test_the_driver_is_opened_only_when_a_cuda_engine_starts(tmp_path):
    """A stand-in `libcuda.so` first on the loader's path (a copy of libm: it loads, and has
    none of the driver's functions). Importing the package and a restore on the simulated
    device never map it; `Engine("cuda")` opens that library, finds no driver API in it and
    raises. So a CPU-only user of the one wheel never loads CUDA, and a broken driver is an
    error, not a crash."""
    libm = next(
        (line.split()[-1] for line in open("/proc/self/maps") if "/libm.so" in line), None
    )
    if libm is None:
        pytest.skip("this interpreter maps no libm to copy as a stand-in driver")
    fake = tmp_path / "libcuda.so"
    shutil.copyfile(libm, fake)
    path = os.environ.get("LD_LIBRARY_PATH")
    out = _child(
        f"FAKE = {str(fake)!r}\n"
        "def mapped():\n"
        "    with open('/proc/self/maps') as f:\n"
        "        return FAKE in f.read()\n"
        + SIM_RESTORE
        + textwrap.dedent(
            """
            print("mapped after import and a restore:", mapped())
            try:
                umbp.Engine("cuda")
            except umbp.Error as e:
                print("error:", e)
            else:
                sys.exit("Engine('cuda') started on a driver without the driver API")
            print("mapped after Engine('cuda'):", mapped())
            """
        ),
        LD_LIBRARY_PATH=str(tmp_path) + (os.pathsep + path if path else ""),
    )
    assert "mapped after import and a restore: False" in out, out
    assert "error: libcuda cannot be loaded:" in out, out
    assert "mapped after Engine('cuda'): True" in out, out
