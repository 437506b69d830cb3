"""The handler's commit future, run on a persistent worker thread.

Orbax's ``CommitFutureAwaitingContractedSignals`` starts a new thread for every save, inside
``save()``: ``Thread.start`` waits until the new thread runs, which costs 1-4 ms of the
blocking path on a busy 2-core host (a quarter of a whole plain Orbax ``save()``).
:class:`PooledCommitFuture` does the same work, in the same order, on a thread of a
process-wide pool that outlives the save: it reads the awaitable signals of the current
operation synchronously (as Orbax's future does), then, on the worker, waits for them (the
step directory must exist before files are written), runs the commit coroutine in a fresh
event loop and returns its result; ``result()`` re-raises the commit's exception.

Where this Orbax version lacks the signal functions it needs, :func:`commit_future` falls back
to Orbax's own future.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import orbax.checkpoint as ocp

#: most commits running at once (a save of N lossy items runs N); more wait for a worker
MAX_COMMITS = 64

_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(MAX_COMMITS, "orbax_lossy_commit")
        return _POOL


def _signal_waiter() -> Callable[[], None] | None:
    """A function that waits (on the calling thread) for the awaitable signals Orbax has
    contracted for the current operation, captured now; None where this Orbax has no such
    contract API."""
    try:
        from orbax.checkpoint._src.futures import future as ocp_future
        from orbax.checkpoint._src.futures import synchronization
        from orbax.checkpoint._src.multihost import multihost
    except ImportError:  # pragma: no cover - other Orbax versions
        return None
    contract = getattr(ocp_future, "AwaitableSignalsContract", None)
    wait = getattr(ocp_future, "wait_for_signals", None)
    ids = getattr(synchronization, "OperationIdGenerator", None)
    timeout = getattr(multihost, "coordination_timeout", None)
    if contract is None or wait is None or ids is None or timeout is None:
        return None  # pragma: no cover - other Orbax versions
    try:
        operation_id = ids.get_current_operation_id()
        signals = contract.get_awaitable_signals_from_contract(operation_id=operation_id)
        timeout_secs = timeout()
    except TypeError:  # pragma: no cover - another signature in other Orbax versions
        return None

    def wait_for_contract() -> None:
        wait(signals, timeout_secs=timeout_secs, operation_id=operation_id)

    return wait_for_contract


def _run_in_new_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        asyncio.set_event_loop(None)
        loop.close()


class PooledCommitFuture(ocp.future.Future):
    """Orbax's ``CommitFutureAwaitingContractedSignals`` on a pooled worker thread."""

    def __init__(self, coro: Coroutine[Any, Any, Any],
                 wait_for_contract: Callable[[], None]) -> None:
        self._cancelled = threading.Event()
        self._coro = coro

        def run() -> Any:
            try:
                wait_for_contract()
                if self._cancelled.is_set():
                    raise concurrent.futures.CancelledError()
                return _run_in_new_loop(coro)
            finally:
                coro.close()  # never awaited when waiting failed: no "never awaited" warning

        self._future = _pool().submit(run)

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the commit; re-raises its exception (``TimeoutError`` after ``timeout``)."""
        return self._future.result(timeout=timeout)

    def cancel(self) -> None:
        """Skip the commit if it has not started writing yet."""
        self._cancelled.set()
        if self._future.cancel():  # it never started: close the coroutine it would have run
            self._coro.close()


def commit_future(coro: Coroutine[Any, Any, Any], name: str) -> ocp.future.Future:
    """The future Orbax waits on for a commit: pooled where the signal contract is
    available, else Orbax's own thread-per-save future."""
    wait_for_contract = _signal_waiter()
    if wait_for_contract is None:  # pragma: no cover - other Orbax versions
        return ocp.future.CommitFutureAwaitingContractedSignals(coro, name=name)
    return PooledCommitFuture(coro, wait_for_contract)
