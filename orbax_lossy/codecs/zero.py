"""``zero``: store nothing of a leaf; it decodes to zeros (a leaf rebuilt after restore).

For optimizer state that training rebuilds by itself, e.g. Adam's first moment: an EMA of
gradients with ``beta1 = 0.9`` forgets any error within tens of steps, so restarting it from
zero after a restore costs a few steps of momentum (measured in ``docs/whole_state.md``).
The codec keeps one all-zero symbol field (a zero run: a few bytes per chunk) so that it uses
the ordinary field machinery. Direct: it needs no reference and may be used on base saves.
Never use it on a leaf whose value matters: the handler's guard refuses it on non-negative
leaves with positive elements (a second moment) and stores those exactly instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.codecs.base import Arrays, CodecBase, Encoded, ErrorMeasure, Estimate, Field


@dataclasses.dataclass(frozen=True)
class Zero(CodecBase):
    """The leaf is not stored: every element decodes to 0."""

    codec_id: ClassVar[str] = "zero"
    lossy: ClassVar[bool] = True
    needs_reference: ClassVar[bool] = False

    def side_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """Names and shapes of the side arrays (see :meth:`CodecBase.side_shapes`)."""
        return {}

    def fields(self) -> dict[str, Field]:
        """One field ``sym``, always 0 (entropy coded as a single zero run)."""
        return {"sym": Field.symbols(2)}

    def encode(self, value: jax.Array, reference: jax.Array | None) -> Encoded:
        """All-zero symbols; the reconstruction is zeros of the leaf's dtype."""
        fields = {"sym": jnp.zeros(value.shape, jnp.uint8)}
        return self.encoded(fields, {}, reference, value.dtype)

    def decode(self, fields: Arrays, side: Arrays, reference: jax.Array | None,
               dtype: Any) -> jax.Array:
        """Zeros shaped like the field, as ``dtype``."""
        return jnp.zeros(fields["sym"].shape, dtype)

    def has_estimate(self, measure: ErrorMeasure) -> bool:
        """Analytic for the ``l2`` measure (relative error 1 on any non-zero leaf)."""
        return measure == "l2"

    def estimate(self, stats: Mapping[str, Any], n: int, dtype: np.dtype) -> Estimate:
        """0 bits; error 1 (0 on an all-zero leaf); ``inf`` on a non-negative leaf."""
        if float(stats["value_min"]) >= 0 and float(stats["value_sq"]) > 0:
            return Estimate(0.0, float("inf"))
        return Estimate(0.0, 1.0 if float(stats["value_sq"]) > 0 else 0.0)

    def error_bound(
        self, value: np.ndarray, reference: np.ndarray | None, encoded: Encoded
    ) -> np.ndarray:
        """``|value|``: every element decodes to 0."""
        return np.abs(np.asarray(value, np.float64))
