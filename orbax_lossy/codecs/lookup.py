"""Symbols decoded through a codec's table on device: ``table[symbols]``, bit for bit.

XLA:CPU lowers a gather to a scalar loop per element. A table of at most
:data:`SELECT_MAX_ENTRIES` entries (an LC or 4-bit cluster codec's) is looked up by a tree of
selects on the symbol's bits instead, which XLA vectorises: the decode program of 9 LC(3)
links over one 5.6 M-element float32 leaf ran in 12.2 ms with gathers and 6.5 ms with selects
on the 2-core benchmark machine (fastest of 7; medians 26.6 and 9.8 ms). Either way the
result is an entry of the table itself, so decodes and the saver's reconstruction agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: tables of at most this many entries are looked up by selects (a tree of ``entries - 1``
#: selects per element), larger ones by a gather
SELECT_MAX_ENTRIES = 16


def table_lookup(symbols: jax.Array, table: jax.Array) -> jax.Array:
    """``table[symbols]`` for a 1-D ``table`` and integer ``symbols`` (out-of-range symbols
    clamped to the table, as JAX's gather clamps them)."""
    size = table.shape[0]
    if not 2 <= size <= SELECT_MAX_ENTRIES:
        return table[symbols.astype(jnp.int32)]
    symbols = jnp.minimum(symbols, jnp.asarray(size - 1, symbols.dtype))
    depth = (size - 1).bit_length()
    # padded to a power of two with the last entry, which clamped symbols select anyway
    entries = [table[i] for i in range(size)] + [table[size - 1]] * (2**depth - size)
    for bit in range(depth):
        chosen = (symbols & jnp.asarray(1 << bit, symbols.dtype)) != 0
        entries = [jnp.where(chosen, entries[2 * i + 1], entries[2 * i])
                   for i in range(len(entries) // 2)]
    return entries[0]
