"""Small shared fixtures for the orbax_lossy tests."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

# One persistent XLA compilation cache for the whole test session, shared with the
# subprocesses the tests start (examples, multi-process runs, the CLI demo): they compile the
# same programs, as a user's later processes would (docs/performance.md recommends the same).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="orbax_lossy_jax_cache_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    if "jax" in sys.modules:  # imported before this file: configure it directly as well
        import jax

        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# The background warm-up (numba's kernels at a handler's creation, decode programs at a
# manager's) pays off when a job builds its state before restoring; a test restores at once,
# and the threads of hundreds of managers only compete with the tests' own work. Off for
# the session and its subprocesses; tests/test_restore_warm.py turns it on where it tests it.
os.environ.setdefault("ORBAX_LOSSY_WARMUP", "0")


def _bits(x) -> np.ndarray:
    """The raw bit pattern of an array (PRNG keys as their key data)."""
    import jax

    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    a = np.ascontiguousarray(np.asarray(x))
    if a.dtype.kind in "biu":
        return a
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


@pytest.fixture
def assert_bitwise():
    """``assert_bitwise(actual, expected)``: same shape, dtype and bit pattern."""

    def check(actual, expected, msg: str = "") -> None:
        a, e = np.asarray(_bits(actual)), np.asarray(_bits(expected))
        assert a.shape == e.shape, f"{msg}: shape {a.shape} != {e.shape}"
        assert a.dtype == e.dtype, f"{msg}: dtype {a.dtype} != {e.dtype}"
        np.testing.assert_array_equal(a, e, err_msg=msg)

    return check


@pytest.fixture
def run_cpu_script():
    """``run(args, timeout)``: ``python *args`` in a fresh CPU-only process (without this
    process's ``XLA_FLAGS``, so a script can set its own device count); returns its stdout
    and fails the test with its stderr when it exits non-zero."""

    def run(args: list[str], timeout: float = 300) -> str:
        from subprocess_env import cpu_env

        proc = subprocess.run([sys.executable, *args], env=cpu_env(), capture_output=True,
                              text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stdout

    return run
