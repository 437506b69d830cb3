"""``same``: a leaf that did not change since the reference is stored as "same as before".

The handler never plans this codec. It plans ``exact`` for a leaf, and when the encode program
finds the value bit-identical to the leaf's reference (``engine.device``: one comparison of the
bits, NaN payloads included), the save stores ``same`` instead: one all-zero symbol field (a
single zero run, a few bytes per chunk) and no lossless coding of the unchanged bytes. A
restore decodes the reference, i.e. the value stored by the chain's earlier links, so the leaf
round-trips bit for bit; retention keeps that earlier link as for any delta. Frozen layers
under ``lossless()`` or ``params_only()``, constant tables and counters that did not move cost
nothing after their first save.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.codecs.base import Arrays, CodecBase, Encoded, Field
from orbax_lossy.errors import CodecError


def bits_equal(value: jax.Array, reference: jax.Array) -> jax.Array:
    """Whether two arrays of one shape and dtype hold the same bits (traced, a scalar bool)."""
    if value.dtype == jnp.bool_:
        return jnp.all(value == reference)
    if jnp.issubdtype(value.dtype, jnp.inexact):
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}
        if jnp.issubdtype(value.dtype, jnp.complexfloating):
            return bits_equal(jnp.real(value), jnp.real(reference)) & bits_equal(
                jnp.imag(value), jnp.imag(reference))
        as_int = width[value.dtype.itemsize]
        return jnp.all(jax.lax.bitcast_convert_type(value, as_int)
                       == jax.lax.bitcast_convert_type(reference, as_int))
    return jnp.all(value == reference)


@dataclasses.dataclass(frozen=True)
class Same(CodecBase):
    """The leaf equals its reference: nothing is stored but a zero run; decodes to the
    reference."""

    codec_id: ClassVar[str] = "same"
    lossy: ClassVar[bool] = True  # as a codec: it returns the reference whatever the value
    needs_reference: ClassVar[bool] = True

    def side_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """Names and shapes of the side arrays (see :meth:`CodecBase.side_shapes`)."""
        return {}

    def fields(self) -> dict[str, Field]:
        """One field ``sym``, always 0 (entropy coded as a single zero run)."""
        return {"sym": Field.symbols(2)}

    def encode(self, value: jax.Array, reference: jax.Array | None) -> Encoded:
        """All-zero symbols; the reconstruction is the reference."""
        if reference is None:
            raise CodecError("codec 'same' needs a reference")
        return self.encoded({"sym": jnp.zeros(value.shape, jnp.uint8)}, {}, reference,
                            value.dtype)

    def decode(self, fields: Arrays, side: Arrays, reference: jax.Array | None,
               dtype: Any) -> jax.Array:
        """The reference, as ``dtype``."""
        if reference is None:
            raise CodecError("codec 'same' needs its reference to decode")
        return jnp.asarray(reference).astype(dtype)

    def error_bound(
        self, value: np.ndarray, reference: np.ndarray | None, encoded: Encoded
    ) -> np.ndarray:
        """``|value - reference|`` (0 where the handler uses it: unchanged leaves)."""
        assert reference is not None
        return np.abs(np.asarray(value, np.float64) - np.asarray(reference, np.float64))
