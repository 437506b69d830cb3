"""Small shared fixtures for the orbax_lossy tests."""

from __future__ import annotations

import numpy as np
import pytest


def _bits(x) -> np.ndarray:
    """The raw bit pattern of an array (PRNG keys as their key data)."""
    import jax

    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    a = np.ascontiguousarray(np.asarray(x))
    if a.dtype.kind in "biu":
        return a
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


@pytest.fixture
def assert_bitwise():
    """``assert_bitwise(actual, expected)``: same shape, dtype and bit pattern."""

    def check(actual, expected, msg: str = "") -> None:
        a, e = np.asarray(_bits(actual)), np.asarray(_bits(expected))
        assert a.shape == e.shape, f"{msg}: shape {a.shape} != {e.shape}"
        assert a.dtype == e.dtype, f"{msg}: dtype {a.dtype} != {e.dtype}"
        np.testing.assert_array_equal(a, e, err_msg=msg)

    return check
