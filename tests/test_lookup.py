"""``codecs.lookup.table_lookup``: a select tree for small tables, a gather for large ones,
and in both cases exactly ``table[symbols]`` (JAX's gather clamps out-of-range indices)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orbax_lossy.codecs.lookup import SELECT_MAX_ENTRIES, table_lookup


@pytest.mark.parametrize("size", [2, 3, 5, 8, 13, 16, 17, 256])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lookup_is_the_gather_bit_for_bit(size, dtype) -> None:
    rng = np.random.default_rng(size)
    # every symbol value a uint8 can hold, out-of-range ones included, and signed zeros / NaN
    symbols = jnp.asarray(np.concatenate([np.arange(256), rng.integers(0, 256, 4096)]),
                          jnp.uint8).reshape(-1, 64)
    values = rng.standard_normal(size).astype(np.float32)
    values[0], values[-1] = -0.0, np.nan
    table = jnp.asarray(values, dtype)
    looked = jax.jit(table_lookup)(symbols, table)
    expected = table[symbols.astype(jnp.int32)]
    assert looked.dtype == table.dtype and looked.shape == symbols.shape
    np.testing.assert_array_equal(np.asarray(looked).view(np.uint16 if dtype == jnp.bfloat16
                                                          else np.uint32),
                                  np.asarray(expected).view(np.uint16 if dtype == jnp.bfloat16
                                                            else np.uint32))


def test_small_tables_compile_without_a_gather() -> None:
    """A table of up to SELECT_MAX_ENTRIES entries lowers to selects (XLA:CPU runs a gather
    as a scalar loop), a larger one to a gather."""
    symbols = jnp.zeros((1024,), jnp.uint8)

    def hlo(size: int) -> str:
        return jax.jit(table_lookup).lower(symbols, jnp.zeros((size,), jnp.float32)).as_text()

    assert "gather" not in hlo(SELECT_MAX_ENTRIES) and "select" in hlo(SELECT_MAX_ENTRIES)
    assert "gather" in hlo(SELECT_MAX_ENTRIES + 1)
