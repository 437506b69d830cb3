"""What the save path asks of a leaf's dtype, answered once per dtype.

``save()`` classifies every leaf on the training thread (is it a PRNG key, a float, a dtype
the lossless coder can write?), several times over. numpy's and JAX's dtype predicates cost
1-5 us each (``np.dtype.name`` builds its string on every access), which at 360 leaves was
about a millisecond of every ``save()``; a model has a handful of dtypes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")


def _per_dtype(question: Callable[[Any], T]) -> Callable[[Any], T]:
    """``question`` cached by its (hashable) argument; an unhashable one is asked directly."""
    cached = functools.cache(question)

    @functools.wraps(question)
    def ask(dtype: Any) -> T:
        try:
            return cached(dtype)
        except TypeError:  # unhashable
            return question(dtype)

    return ask


@_per_dtype
def kind(dtype: Any) -> str:
    """``"rng"`` for a typed PRNG key dtype, ``"float"`` for a floating-point one, else
    ``"other"`` (integers, bool, complex)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return "rng"
    return "float" if jnp.issubdtype(dtype, jnp.floating) else "other"


@_per_dtype
def name(dtype: Any) -> str | None:
    """``np.dtype(dtype).name``, or None where numpy has no such dtype."""
    try:
        return np.dtype(dtype).name
    except TypeError:  # not a numpy dtype (a PRNG key dtype, an arbitrary object)
        return None


@_per_dtype
def writable(dtype: Any) -> bool:
    """Whether the lossless coder stores arrays of ``dtype`` (a PRNG key dtype: no; its key
    data is)."""
    from orbax_lossy.codecs.lossless import _DTYPE_CODES  # on first use, as before

    return name(dtype) in _DTYPE_CODES
