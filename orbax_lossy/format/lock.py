"""One writer per checkpoint root: ``<root>/.orbax-lossy.lock``.

Delta chains only work when one logical writer owns a root: a second writer's deltas and
retention decisions interleave with the first one's, and steps it reports as saved can end
unreadable. On its first save into a root a handler therefore takes a non-blocking exclusive
``fcntl.flock`` on ``<root>/.orbax-lossy.lock`` (recording pid, host and handler) and holds it
for its lifetime: until :func:`release` (the handler's ``close``) or until the handler is
garbage collected. A second handler, in this process or another one, saving into that root
gets a :class:`~orbax_lossy.errors.RootLockedError` naming the root and the holder.

A multi-process run (``jax.distributed``, several processes writing one root as *one*
logical writer) takes the lock on its primary host only. ``flock`` is advisory and, on some
network filesystems, local to one machine: it stops accidents, not a determined second writer.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import weakref
from typing import Any

from orbax_lossy.errors import RootLockedError
from orbax_lossy.format.steps import root_key

LOCK_NAME = ".orbax-lossy.lock"

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows: no lock, documented
    fcntl = None  # type: ignore[assignment]


class _Held:
    """An open, locked lock file of one root."""

    def __init__(self, root: str, fd: int, owner: int) -> None:
        self.root = root
        self.fd = fd
        self.owner = owner  # id() of the handler holding it

    def close(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)  # closing the only descriptor releases the flock
            finally:
                self.fd = -1


_lock = threading.Lock()
_by_root: dict[str, _Held] = {}  # this process's locks, by canonical root
_by_handler: dict[int, set[str]] = {}  # roots held by each live handler (by id)


def _describe(fd: int) -> str:
    try:
        data = os.pread(fd, 4096, 0)
        info = json.loads(data.decode() or "{}")
        return (f"pid {info.get('pid')} on host {info.get('host')!r} "
                f"(handler {info.get('handler')})")
    except Exception:  # the holder's record is informative only
        return "another writer"


def _release_roots(owner: int) -> None:
    with _lock:
        for root in _by_handler.pop(owner, set()):
            held = _by_root.get(root)
            if held is not None and held.owner == owner:
                del _by_root[root]
                held.close()


def hold(handler: Any, root: os.PathLike | str, primary: bool = True) -> None:
    """Make ``handler`` the only writer of ``root`` (idempotent; see the module docstring).

    Non-primary processes of a multi-process run take no lock (``primary=False``).
    """
    if not primary or fcntl is None:
        return
    key = root_key(root)
    owner = id(handler)
    with _lock:
        held = _by_root.get(key)
        if held is not None:
            if held.owner == owner:
                return
            raise RootLockedError(
                f"checkpoint root {key} already has a writer in this process (another "
                f"LossyCheckpointHandler, handler {held.owner:#x}); two writers would "
                "interleave delta chains. Close the other manager (or reuse its handler) "
                "before saving here."
            )
        os.makedirs(key, exist_ok=True)
        path = os.path.join(key, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _describe(fd)
            os.close(fd)
            raise RootLockedError(
                f"checkpoint root {key} is locked by {holder} ({path}); only one writer may "
                "save into a root. Stop the other writer, or save into another directory."
            ) from e
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "handler": f"{owner:#x}"}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        _by_root[key] = _Held(key, fd, owner)
        first = owner not in _by_handler
        _by_handler.setdefault(owner, set()).add(key)
    if first:
        weakref.finalize(handler, _release_roots, owner)
        _release_on_close(handler, owner)


def _release_on_close(handler: Any, owner: int) -> None:
    """Make ``handler.close()`` (called by Orbax's ``CheckpointManager.close``) release.

    A handler class that calls :func:`release` in its own ``close`` sets
    ``releases_writer_lock = True`` and is left alone.
    """
    if getattr(type(handler), "releases_writer_lock", False):
        return
    ref = weakref.ref(handler)
    cls_close = type(handler).close

    def close(*args: Any, **kwargs: Any) -> Any:
        _release_roots(owner)
        h = ref()
        return None if h is None else cls_close(h, *args, **kwargs)

    with contextlib.suppress(AttributeError):  # a slotted handler: released on GC only
        handler.close = close


def release(handler: Any) -> None:
    """Release every root ``handler`` holds (its ``close``; also done when it is collected)."""
    _release_roots(id(handler))


def held_roots(handler: Any) -> set[str]:
    """The roots ``handler`` holds (for tests and tools)."""
    with _lock:
        return set(_by_handler.get(id(handler), set()))
