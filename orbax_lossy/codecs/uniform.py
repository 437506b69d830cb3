"""``uniform``: uniform scalar quantization of a leaf between its minimum and maximum.

``2**bits`` levels ``lo + i * step``, ``step = (hi - lo) / (2**bits - 1)``, from the leaf's
own range (direct: no reference); every element rounds to the nearest level, so
``|x - x̂| <= step / 2`` (plus the rounding of the reconstruction to the leaf dtype). The
side ``codebook`` holds the decoded levels (its first and last entries are the leaf's minimum
and maximum), so decode is one gather, bit-identical on every backend. A natural candidate
for Adam's first moment. Walked through in ``docs/codecs.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.codecs.base import Arrays, CodecBase, Encoded, Field, rounding_slack, work_dtype
from orbax_lossy.codecs.lookup import table_lookup
from orbax_lossy.errors import CodecError


def uniform_levels(lo: jax.Array, hi: jax.Array, bits: int) -> jax.Array:
    """The ``2**bits`` levels from ``lo`` to ``hi`` (both exact), evenly spaced."""
    top = 2**bits - 1
    step = (hi - lo) / top
    levels = lo + jnp.arange(top + 1, dtype=lo.dtype) * step
    return levels.at[-1].set(hi)


def quantize(x: jax.Array, levels: jax.Array) -> jax.Array:
    """Index of the nearest of the evenly spaced ``levels`` for every element (uint8)."""
    lo, hi = levels[0], levels[-1]
    top = levels.shape[0] - 1
    scaled = jnp.where(hi > lo, (x - lo) * (top / jnp.where(hi > lo, hi - lo, 1)), 0)
    return jnp.clip(jnp.round(scaled), 0, top).astype(jnp.uint8)


@dataclasses.dataclass(frozen=True)
class Uniform(CodecBase):
    """Uniform quantizer with ``2**bits`` levels over the leaf's ``[min, max]``."""

    bits: int = 8

    codec_id: ClassVar[str] = "uniform"
    lossy: ClassVar[bool] = True
    needs_reference: ClassVar[bool] = False

    def side_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """Names and shapes of the side arrays (see :meth:`CodecBase.side_shapes`)."""
        return {"codebook": (2**self.bits,)}

    def __post_init__(self) -> None:
        if not isinstance(self.bits, int) or isinstance(self.bits, bool) or not (
            1 <= self.bits <= 8
        ):
            raise CodecError(f"Uniform bits must be an int in 1..8, got {self.bits!r}")

    def fields(self) -> dict[str, Field]:
        """One field ``sym``: the level index of every element (``2**bits`` symbols)."""
        return {"sym": Field.symbols(2**self.bits)}

    def encode(self, value: jax.Array, reference: jax.Array | None) -> Encoded:
        """Nearest-level symbols and the ``codebook`` of levels over ``[min, max]``."""
        if not jnp.issubdtype(value.dtype, jnp.floating):
            raise CodecError(f"Uniform codes floating-point leaves, got {value.dtype}")
        x = value.astype(work_dtype(value.dtype))
        levels = uniform_levels(jnp.min(x), jnp.max(x), self.bits)
        fields, side = {"sym": quantize(x, levels)}, {"codebook": levels}
        return self.encoded(fields, side, reference, value.dtype)

    def decode(self, fields: Arrays, side: Arrays, reference: jax.Array | None,
               dtype: Any) -> jax.Array:
        """The ``codebook`` level of every symbol, as ``dtype``."""
        return table_lookup(fields["sym"], side["codebook"]).astype(dtype)

    @classmethod
    def examples(cls) -> tuple[Uniform, ...]:
        """1, 4 and 8 bits."""
        return (Uniform(1), Uniform(4), Uniform(8))

    def error_bound(
        self, value: np.ndarray, reference: np.ndarray | None, encoded: Encoded
    ) -> np.ndarray:
        """``(max - min) / (2 * (2**bits - 1))`` per element, plus rounding.

        The levels and the scaled value are computed in float32 (float64 for float64 leaves):
        a few units of roundoff of ``max(|min|, |max|)`` more.
        """
        levels = np.asarray(encoded.side["codebook"], np.float64)
        lo, hi = levels[0], levels[-1]
        eps = float(jnp.finfo(work_dtype(value.dtype)).eps)
        bound = (hi - lo) / (2 * (2**self.bits - 1)) + 4 * eps * max(abs(lo), abs(hi))
        return rounding_slack(np.full(np.shape(value), bound), value, encoded.recon, value.dtype)
