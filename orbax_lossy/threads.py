"""How many host threads the library's coders may use."""

from __future__ import annotations

import concurrent.futures
import os
import threading


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS reports one, so a
    container or ``taskset`` limit is respected; else ``os.cpu_count()``), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


_POOLS: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def core_pool(name: str) -> concurrent.futures.ThreadPoolExecutor:
    """The process-wide pool named ``name``: one worker per available core, threads named
    ``orbax_lossy_<name>_<k>``, created on first use. Each kind of work that waits on
    another kind gets its own name, so no worker waits for work queued behind it."""
    with _POOLS_LOCK:
        pool = _POOLS.get(name)
        if pool is None:
            pool = _POOLS[name] = concurrent.futures.ThreadPoolExecutor(
                available_cores(), thread_name_prefix=f"orbax_lossy_{name}")
        return pool
