"""What the save path asks of a leaf's dtype, answered once per dtype.

``save()`` classifies every leaf on the training thread (is it a PRNG key, a float, a dtype
the lossless coder can write?), several times over. numpy's and JAX's dtype predicates cost
1-5 us each (``np.dtype.name`` builds its string on every access), which at 360 leaves was
about a millisecond of every ``save()``; a model has a handful of dtypes.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@functools.cache
def _kind(dtype: Any) -> str:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return "rng"
    return "float" if jnp.issubdtype(dtype, jnp.floating) else "other"


def kind(dtype: Any) -> str:
    """``"rng"`` for a typed PRNG key dtype, ``"float"`` for a floating-point one, else
    ``"other"`` (integers, bool, complex)."""
    try:
        return _kind(dtype)
    except TypeError:  # unhashable
        return _kind.__wrapped__(dtype)


@functools.cache
def _name(dtype: Any) -> str | None:
    try:
        return np.dtype(dtype).name
    except TypeError:  # not a numpy dtype (a PRNG key dtype)
        return None


def name(dtype: Any) -> str | None:
    """``np.dtype(dtype).name``, or None where numpy has no such dtype."""
    try:
        return _name(dtype)
    except TypeError:  # unhashable
        return _name.__wrapped__(dtype)


@functools.cache
def _writable(dtype: Any) -> bool:
    from orbax_lossy.codecs.lossless import _DTYPE_CODES  # on first use, as before

    return _name(dtype) in _DTYPE_CODES


def writable(dtype: Any) -> bool:
    """Whether the lossless coder stores arrays of ``dtype`` (a PRNG key dtype: no; its key
    data is)."""
    try:
        return _writable(dtype)
    except TypeError:  # unhashable: not a dtype
        return False
