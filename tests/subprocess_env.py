"""The environment of the subprocesses that tests start."""

from __future__ import annotations

import os

from orbax_lossy.handler import jax_cache_hangs_multiprocess

# Two CPU processes under jax.distributed hang in the first programs they load from a shared
# persistent compilation cache on some jax versions (docs/performance.md, "jax 0.12.1,
# several CPU processes"): two-process runs compile instead.
_CACHE_VARIABLES = (
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
)


def cpu_env(*, processes: int = 1) -> dict[str, str]:
    """This process's environment for a CPU-only child: without ``XLA_FLAGS`` (a script
    sets its own device count) and, for the processes of a multi-process run on a jax whose
    loaded executables hang there, without the persistent compilation cache."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    if processes > 1 and jax_cache_hangs_multiprocess():
        for name in _CACHE_VARIABLES:
            env.pop(name, None)
    return env
