"""The per-dtype answers of orbax_lossy.dtypes equal the numpy/JAX predicates they cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orbax_lossy import dtypes
from orbax_lossy.codecs.lossless import _DTYPE_CODES

DTYPES = [np.float32, np.float16, jnp.bfloat16, np.float64, np.int8, np.int32, np.uint64,
          np.bool_, np.complex64]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_numeric_dtypes(dtype):
    expected = "float" if jnp.issubdtype(dtype, jnp.floating) else "other"
    for spelled in (dtype, np.dtype(dtype), np.dtype(dtype).name):  # twice: cached answers
        assert dtypes.kind(spelled) == expected
        assert dtypes.kind(spelled) == expected
        assert dtypes.name(spelled) == np.dtype(dtype).name
        assert dtypes.writable(spelled) == (np.dtype(dtype).name in _DTYPE_CODES)


def test_key_dtype_and_non_dtypes():
    key_dtype = jax.random.key(0).dtype
    assert dtypes.kind(key_dtype) == "rng"
    assert dtypes.name(key_dtype) is None
    assert not dtypes.writable(key_dtype)  # its key data is written, not the keys
    assert not dtypes.writable(object)
    assert not dtypes.writable([1, 2])  # unhashable: not a dtype, no exception
    assert dtypes.name("not a dtype") is None
