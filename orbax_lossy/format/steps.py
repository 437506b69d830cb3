"""Step and item directories: ``<root>/<step dir>/<item>``, and Orbax's tmp-dir suffix."""

from __future__ import annotations

import os
import re

TMP_SUFFIX = ".orbax-checkpoint-tmp"
_TRAILING_DIGITS = re.compile(r"(\d+)$")


def final_path(directory: os.PathLike | str) -> str:
    """The path a directory will have after Orbax commits it (tmp suffixes removed)."""
    parts = os.fspath(directory).split(os.sep)
    return os.sep.join(p.split(TMP_SUFFIX)[0] for p in parts)


def step_of(item_dir: os.PathLike | str) -> int | None:
    """Step number of an item directory ``<root>/<step dir>/<item>``, if its name has one."""
    name = os.path.basename(os.path.dirname(os.path.normpath(os.fspath(item_dir))))
    m = _TRAILING_DIGITS.search(name)
    return int(m.group(1)) if m else None


def root_of(item_dir: os.PathLike | str) -> str:
    """The checkpoint root an item directory lives in."""
    return os.path.dirname(os.path.dirname(os.path.normpath(os.fspath(item_dir))))


def root_key(root: os.PathLike | str) -> str:
    """A canonical name of a root (absolute, normalised, tmp suffixes removed)."""
    return os.path.normpath(os.path.abspath(final_path(root)))


def step_directories(root: os.PathLike | str) -> dict[int, str]:
    """Committed-looking step directories under ``root`` by step number."""
    root = os.fspath(root)
    out: dict[int, str] = {}
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return out
    for name in names:
        if TMP_SUFFIX in name:
            continue
        m = _TRAILING_DIGITS.search(name)
        if m and os.path.isdir(os.path.join(root, name)):
            out[int(m.group(1))] = os.path.join(root, name)
    return out
