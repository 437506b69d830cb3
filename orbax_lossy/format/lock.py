"""One writer per checkpoint root: ``<root>/.orbax-lossy.lock``.

Delta chains only work when one logical writer owns a root: a second writer's deltas and
retention decisions interleave with the first one's, and steps it reports as saved can end
unreadable. On its first save into a root a handler therefore takes a non-blocking exclusive
``fcntl.flock`` on ``<root>/.orbax-lossy.lock`` (recording pid, host and handler) and holds it
for its lifetime: until :func:`release` (the handler's ``close``) or until the handler is
garbage collected. A second handler, in this process or another one, saving into that root
gets a :class:`~orbax_lossy.errors.RootLockedError` naming the root and the holder. Within one
process the rule is per item: the handlers of one manager's several lossy items share the
root's lock, and only a second handler writing the *same* item is refused.

A multi-process run (``jax.distributed``, several processes writing one root as *one*
logical writer) takes the lock on its primary host only. ``flock`` is advisory and, on some
network filesystems, local to one machine: it stops accidents, not a determined second writer.

An object store (``gs://``, ``s3://``) has no file locks: there no lock file is written and no
other process is refused. The in-process rule (one handler per item) still holds, and Orbax's
own protocol still makes one primary host the only committer of a step; two *jobs* writing one
bucket prefix are not detected (``docs/object_stores.md``).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import weakref
from typing import Any

from orbax_lossy.errors import RootLockedError
from orbax_lossy.format.steps import is_remote, normpath, root_key, root_of

LOCK_NAME = ".orbax-lossy.lock"

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows: no lock, documented
    fcntl = None  # type: ignore[assignment]


class _Held:
    """An open, locked lock file of one root, and the items this process writes there."""

    def __init__(self, root: str, fd: int) -> None:
        self.root = root
        self.fd = fd
        self.items: dict[str, int] = {}  # item name -> id() of the handler writing it

    def close(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)  # closing the only descriptor releases the flock
            finally:
                self.fd = -1


_lock = threading.Lock()
_by_root: dict[str, _Held] = {}  # this process's locks, by canonical root
_by_handler: dict[int, set[tuple[str, str]]] = {}  # (root, item) held by each live handler


def _describe(fd: int) -> str:
    try:
        data = os.pread(fd, 4096, 0)
        info = json.loads(data.decode() or "{}")
        return f"pid {info.get('pid')} on host {info.get('host')!r}"
    except Exception:  # the holder's record is informative only
        return "another writer"


def _release_roots(owner: int) -> None:
    with _lock:
        for root, name in _by_handler.pop(owner, set()):
            held = _by_root.get(root)
            if held is None or held.items.get(name) != owner:
                continue
            del held.items[name]
            if not held.items:
                del _by_root[root]
                held.close()


def hold(handler: Any, item_dir: os.PathLike | str, primary: bool = True) -> None:
    """Make ``handler`` the only writer of item ``item_dir`` and this process the only writer
    of its root (idempotent; see the module docstring).

    In one process, several handlers may write one root (a manager with several lossy items,
    each with its own handler), but only one handler each item. Non-primary processes of a
    multi-process run take no lock (``primary=False``).
    """
    if not primary or fcntl is None:
        return
    item_dir = os.fspath(item_dir)
    key, name = root_key(root_of(item_dir)), os.path.basename(normpath(item_dir))
    owner = id(handler)
    with _lock:
        held = _by_root.get(key)
        current = None if held is None else held.items.get(name)
        if current == owner:
            return
        if current is not None:
            raise RootLockedError(
                f"item {name!r} of checkpoint root {key} already has a writer in this process "
                f"(another LossyCheckpointHandler, {current:#x}); two writers would interleave "
                "delta chains. Close the other manager (or reuse its handler) before saving "
                "here."
            )
        if held is None:
            held = _take(key, owner)
            _by_root[key] = held
        held.items[name] = owner
        first = owner not in _by_handler
        _by_handler.setdefault(owner, set()).add((key, name))
    if first:
        weakref.finalize(handler, _release_roots, owner)


def _take(key: str, owner: int) -> _Held:
    """Open and flock ``<key>/.orbax-lossy.lock`` (no other process may hold it).

    On an object store nothing is locked (no file is written): only this process's
    one-handler-per-item rule applies there.
    """
    if is_remote(key):
        return _Held(key, -1)
    path = os.path.join(key, LOCK_NAME)
    try:
        os.makedirs(key, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        raise RootLockedError(f"cannot create the writer lock {path} ({e}); orbax_lossy "
                              "needs a writable checkpoint root") from e
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
    return _Held(key, fd)


def release(handler: Any) -> None:
    """Release every item and root ``handler`` holds (its ``close``; also done on GC)."""
    _release_roots(id(handler))


def held_roots(handler: Any) -> set[str]:
    """The roots ``handler`` writes into (for tests and tools)."""
    with _lock:
        return {root for root, _ in _by_handler.get(id(handler), set())}


