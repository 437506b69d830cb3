"""Step and item directories: ``<root>/<step dir>/<item>``, and Orbax's tmp-dir suffix.

Paths are strings: local paths, or URIs (``gs://bucket/dir``, ``s3://bucket/dir``) that Orbax
hands the handler as ``epath.Path``. Local paths keep the plain OS calls (``os.listdir``,
``os.path``); a URI goes through ``etils.epath`` (imported only then) and is normalised
lexically, with the bucket as its first component, since ``os.path.abspath`` and
``os.path.normpath`` would turn ``s3://b/x`` into ``<cwd>/s3:/b/x``. See
``docs/object_stores.md``.
"""

from __future__ import annotations

import os
import posixpath
import re
from typing import Any

TMP_SUFFIX = ".orbax-checkpoint-tmp"
_TRAILING_DIGITS = re.compile(r"(\d+)$")
# ``scheme://``: what epath hands to its remote backends (gs, s3, az, hf); any other scheme
# is passed to epath as well, which refuses what it cannot serve rather than writing to a
# local folder called ``scheme:``.
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


# --------------------------------------------------------------------------- path strings


def is_remote(path: os.PathLike | str) -> bool:
    """Whether ``path`` is a URI (``gs://``, ``s3://``...) rather than a local path."""
    return _URI.match(os.fspath(path)) is not None


def _split(path: str) -> tuple[str, str]:
    """``("s3://", "/bucket/dir")`` of a URI, ``("", path)`` of a local path."""
    m = _URI.match(path)
    return ("", path) if m is None else (m.group(0), "/" + path[m.end():])


def normpath(path: os.PathLike | str) -> str:
    """``os.path.normpath`` that keeps a URI's ``scheme://`` (the bucket stays first)."""
    scheme, rest = _split(os.fspath(path))
    if not scheme:
        return os.path.normpath(rest)
    return scheme + posixpath.normpath(rest).lstrip("/")


def abspath(path: os.PathLike | str) -> str:
    """``os.path.abspath`` of a local path; a URI (always absolute) normalised."""
    path = os.fspath(path)
    return normpath(path) if is_remote(path) else os.path.abspath(path)


def dirname(path: os.PathLike | str) -> str:
    """``os.path.dirname`` that keeps a URI's ``scheme://`` (the bucket's parent is ``s3://``)."""
    scheme, rest = _split(os.fspath(path))
    if not scheme:
        return os.path.dirname(rest)
    return scheme + posixpath.dirname(rest).lstrip("/")


def relpath(path: os.PathLike | str, start: os.PathLike | str) -> str:
    """``os.path.relpath`` of two local paths, or of two URIs of one scheme."""
    (scheme, rest), (start_scheme, start_rest) = _split(os.fspath(path)), _split(os.fspath(start))
    if scheme != start_scheme:
        raise ValueError(f"no relative path from {os.fspath(start)} to {os.fspath(path)}")
    if not scheme:
        return os.path.relpath(rest, start_rest)
    return posixpath.relpath(rest, start_rest)


def inside(path: os.PathLike | str, root: os.PathLike | str) -> bool:
    """Whether normalised ``path`` is ``root`` or lies under it (lexically)."""
    (scheme, rest), (root_scheme, root_rest) = _split(os.fspath(path)), _split(os.fspath(root))
    if scheme != root_scheme:
        return False
    try:
        common = os.path.commonpath if not scheme else posixpath.commonpath
        return common([rest, root_rest]) == root_rest
    except ValueError:  # one absolute, one relative
        return False


def final_path(directory: os.PathLike | str) -> str:
    """The path a directory will have after Orbax commits it (tmp suffixes removed)."""
    parts = os.fspath(directory).split(os.sep)
    return os.sep.join(p.split(TMP_SUFFIX)[0] for p in parts)


def step_of(item_dir: os.PathLike | str) -> int | None:
    """Step number of an item directory ``<root>/<step dir>/<item>``, if its name has one."""
    name = os.path.basename(dirname(normpath(item_dir)))
    m = _TRAILING_DIGITS.search(name)
    return int(m.group(1)) if m else None


def root_of(item_dir: os.PathLike | str) -> str:
    """The checkpoint root an item directory lives in."""
    return dirname(dirname(normpath(item_dir)))


def root_key(root: os.PathLike | str) -> str:
    """A canonical name of a root (absolute, normalised, tmp suffixes removed)."""
    return abspath(final_path(root))


# --------------------------------------------------------------------------- directories


def as_epath(path: os.PathLike | str) -> Any:
    """``epath.Path(path)`` (etils is imported on the first call, so only for URIs)."""
    from etils import epath

    return epath.Path(path)


def exists(path: os.PathLike | str) -> bool:
    """Whether ``path`` exists (``os.path.exists``: a dangling local symlink does not)."""
    path = os.fspath(path)
    return bool(as_epath(path).exists()) if is_remote(path) else os.path.exists(path)


def lexists(path: os.PathLike | str) -> bool:
    """Whether ``path`` exists (``os.path.lexists``: a dangling local symlink does)."""
    path = os.fspath(path)
    return bool(as_epath(path).exists()) if is_remote(path) else os.path.lexists(path)


def is_file(path: os.PathLike | str) -> bool:
    """Whether ``path`` is a file (an object, in an object store)."""
    path = os.fspath(path)
    if not is_remote(path):
        return os.path.isfile(path)
    try:
        return not as_epath(path).stat().is_directory
    except FileNotFoundError:
        return False


def listdir(path: os.PathLike | str) -> list[str]:
    """Names in directory ``path`` (FileNotFoundError / NotADirectoryError when it is none)."""
    path = os.fspath(path)
    if not is_remote(path):
        return os.listdir(path)
    return [child.name for child in as_epath(path).iterdir()]


def remove(path: os.PathLike | str) -> None:
    """Delete file ``path``."""
    path = os.fspath(path)
    if is_remote(path):
        as_epath(path).unlink()
    else:
        os.remove(path)


def step_directories(root: os.PathLike | str) -> dict[int, str]:
    """Committed-looking step directories under ``root`` by step number."""
    root = os.fspath(root)
    out: dict[int, str] = {}
    remote = is_remote(root)
    try:
        names = listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return out
    for name in names:
        if TMP_SUFFIX in name:
            continue
        m = _TRAILING_DIGITS.search(name)
        if not m:
            continue
        path = os.path.join(root, name)
        if as_epath(path).is_dir() if remote else os.path.isdir(path):
            out[int(m.group(1))] = path
    return out
