"""Compiling a restore's decode programs ahead of their first call, on a background thread.

A new process's first restore compiles every decode program it needs (one per class of leaf
and window plan, :func:`device.decode_links`); each took 40-60 ms on XLA:CPU, and called
from the restoring thread they ran one after another, between the reads of the windows (5
programs, 233 ms of a 64 MB 9-delta restore). As soon as a restore knows its chain, it
submits the programs it has not compiled yet (:func:`submit`) from abstract arguments
(``jax.jit(...).lower(...).compile()``), to one worker, so compiling overlaps reading and
entropy decoding; the restoring thread waits for a program (:func:`wait`) just before it calls
it and calls the compiled program itself, so a decode program compiled ahead is never
compiled again on the restoring thread. (Calling the jitted function instead relied on JAX's
caches to find the executable compiled ahead; a fresh-clone CI once recorded one compile on
the restoring thread during a first restore, program not recorded, not reproduced since.)

A program that fails to compile ahead is compiled (and its error raised) by the real call.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

#: at most this many signatures are remembered (the oldest are forgotten, as compiled
#: programs: the real call then looks up JAX's own cache)
MAX_REMEMBERED = 4096

_LOCK = threading.Lock()
_SUBMITTED: OrderedDict[Hashable, concurrent.futures.Future] = OrderedDict()
_SPECULATIVE: set[Hashable] = set()  # keys of _SUBMITTED no restore has asked for yet
_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="orbax_lossy_compile")
    return _POOL


def submit(key: Hashable, compile_program: Callable[[], object],
           speculative: bool = False) -> None:
    """Compile ``compile_program()`` on the background workers, once per ``key`` per process.

    ``speculative``: submitted before any restore asked for it (a manager's compiling
    ahead); a restore that needs other programs cancels those not started yet
    (:func:`keep_only`), so they never queue in front of its own."""
    with _LOCK:
        if key in _SUBMITTED:
            _SUBMITTED.move_to_end(key)
            return
        _SUBMITTED[key] = _pool().submit(compile_program)
        if speculative:
            _SPECULATIVE.add(key)
        while len(_SUBMITTED) > MAX_REMEMBERED:
            _SPECULATIVE.discard(_SUBMITTED.popitem(last=False)[0])


def keep_only(keys: set[Hashable]) -> None:
    """Cancel the speculative programs outside ``keys`` that have not started compiling
    (they are forgotten, so a later restore that needs one submits it again)."""
    with _LOCK:
        for key in [k for k in _SPECULATIVE if k not in keys]:
            if _SUBMITTED[key].cancel():
                del _SUBMITTED[key]
            _SPECULATIVE.discard(key)
        _SPECULATIVE.difference_update(keys)


def wait(key: Hashable) -> object | None:
    """Wait until the program of ``key`` (if submitted) is compiled, and return it (a
    ``jax.stages.Compiled``), or None where it was not submitted or failed to compile (the
    real call compiles it again and raises)."""
    with _LOCK:
        future = _SUBMITTED.get(key)
    if future is None:
        return None
    concurrent.futures.wait([future])
    if future.cancelled() or future.exception() is not None:
        return None
    return future.result()


def submitted() -> bool:
    """Whether this process has submitted any program (it has restored before)."""
    with _LOCK:
        return bool(_SUBMITTED)
