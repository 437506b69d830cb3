"""Validation of values read from a manifest: types, required keys, ranges and limits.

Every check raises :class:`~orbax_lossy.FormatError` naming the file (and leaf) it came from;
:mod:`orbax_lossy.format.manifest` builds its typed dataclasses with these functions only.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from orbax_lossy.errors import FormatError
from orbax_lossy.treepaths import EMPTY_NODE_KINDS, StoredPath

#: the manifest file of an item directory
MANIFEST_NAME = "manifest.msgpack"
# Limits no writer reaches; a manifest past them is damaged or hostile.
MAX_LEAVES = 1 << 20
MAX_RANK = 64
MAX_ELEMENTS = 1 << 46
MAX_SIDE_BYTES = 1 << 20  # per leaf; codecs store at most a few kB (representatives, codebooks)
MAX_SIDE_ARRAYS = 16
MAX_CHUNK_BYTES = 1 << 30
MAX_SHARDING_CHARS = 1 << 20


def fail(where: str, message: str) -> FormatError:
    """A FormatError about ``where``."""
    return FormatError(f"{where}: {message}")


def get(d: Any, key: str, types: type | tuple[type, ...], where: str, default: Any = ...) -> Any:
    """``d[key]`` checked to be of ``types`` (``default`` when absent, else required)."""
    if not isinstance(d, dict):
        raise fail(where, f"expected a map, found {type(d).__name__}")
    if key not in d:
        if default is ...:
            raise fail(where, f"required key {key!r} is missing")
        return default
    value = d[key]
    if value is None and default is None:
        return None
    bad_bool = isinstance(value, bool) and bool not in (types if isinstance(types, tuple)
                                                        else (types,))
    if not isinstance(value, types) or bad_bool:
        raise fail(where, f"key {key!r} has type {type(value).__name__}")
    return value


def dtype_of(name: Any, where: str) -> np.dtype:
    """A dtype named in a manifest."""
    if not isinstance(name, str):
        raise fail(where, f"dtype {name!r} is not a string")
    try:
        return _named_dtype(name)
    except TypeError as e:
        raise fail(where, f"unknown dtype {name!r}") from e


@functools.lru_cache(maxsize=64)
def _named_dtype(name: str) -> np.dtype:
    """The dtype of ``name`` (cached: a manifest names a few dtypes thousands of times)."""
    import jax.numpy as jnp  # jnp knows bfloat16 and the float8 types

    return np.dtype(jnp.dtype(name))


def shape_of(value: Any, where: str, what: str = "shape") -> tuple[int, ...]:
    """A shape (or chunk) within the limits."""
    if not isinstance(value, list) or len(value) > MAX_RANK:
        raise fail(where, f"{what} {str(value)[:100]} is not a list of at most {MAX_RANK} dims")
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in value):
        raise fail(where, f"{what} {value} has a non-integer or negative dimension")
    if math.prod(value) > MAX_ELEMENTS:
        raise fail(where, f"impossible {what} {value}")
    return tuple(value)


def steps_of(value: list, where: str) -> tuple[int, ...]:
    """A list of step numbers."""
    if len(value) > MAX_LEAVES or any(
        isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in value
    ):
        raise fail(where, "extra dependencies are not a list of steps")
    return tuple(value)


def sharding_string(value: str | None, where: str) -> str | None:
    """A serialized sharding within the size limit."""
    if value is not None and len(value) > MAX_SHARDING_CHARS:
        raise fail(where, "sharding description is larger than any writer produces")
    return value


def empty_nodes_of(value: list, where: str) -> tuple[tuple[StoredPath, str], ...]:
    """The empty-node table of a header."""
    if len(value) > MAX_LEAVES:
        raise fail(where, "more empty nodes than any writer produces")
    out = []
    for entry in value:
        if (not isinstance(entry, list) or len(entry) != 2
                or entry[1] not in EMPTY_NODE_KINDS):
            raise fail(where, f"malformed empty node {str(entry)[:100]}")
        out.append((path_of(entry[0], where), entry[1]))
    return tuple(out)


def path_of(value: Any, where: str) -> StoredPath:
    """A stored key path."""
    if not isinstance(value, list):
        raise fail(where, "leaf path is not a list")
    out = []
    for entry in value:
        if (not isinstance(entry, list) or len(entry) != 2 or entry[0] not in ("d", "s", "a", "i")
                or not isinstance(entry[1], (str, int)) or isinstance(entry[1], bool)):
            raise fail(where, f"malformed leaf path entry {str(entry)[:100]}")
        out.append((entry[0], entry[1]))
    return tuple(out)
