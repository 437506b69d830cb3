"""``bitmask``: BitSnap-style bitmask sparsification of a leaf against its reference.

Between nearby checkpoints most elements of a low-precision leaf do not change at all. The
codec stores a ``mask`` of changed elements (bit patterns differ from the reference) and
either their bits XOR the reference's (``bits=None``: exact, byte-plane coded) or LC
exponent symbols of their deltas (``bits=b``). Specification: ``docs/codecs.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.codecs.base import (
    Arrays,
    CodecBase,
    Encoded,
    ErrorMeasure,
    Estimate,
    Field,
    binary_entropy,
    rounding_slack,
    work_dtype,
)
from orbax_lossy.codecs.lc import LC, dequantize, promote, promote_bound
from orbax_lossy.errors import CodecError


def word_dtype(dtype: Any) -> np.dtype:
    """The unsigned integer type with the same width as ``dtype``."""
    itemsize = np.dtype(jnp.dtype(dtype)).itemsize
    if itemsize not in (1, 2, 4, 8):
        raise CodecError(f"bitmask codec does not support dtype {dtype} ({itemsize} bytes)")
    return np.dtype(f"uint{8 * itemsize}")


def as_words(x: jax.Array) -> jax.Array:
    """Bit pattern of ``x`` as unsigned integers of the same width (bool as uint8)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(x, jnp.dtype(word_dtype(x.dtype)))


def from_words(words: jax.Array, dtype: Any) -> jax.Array:
    """Inverse of :func:`as_words`."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return words.astype(jnp.bool_)
    return jax.lax.bitcast_convert_type(words, dtype)


def changed_mask(value: jax.Array, reference: jax.Array) -> jax.Array:
    """uint8 1 where the bit patterns of ``value`` and ``reference`` differ, else 0."""
    return (as_words(value) != as_words(reference.astype(value.dtype))).astype(jnp.uint8)


@dataclasses.dataclass(frozen=True)
class Bitmask(CodecBase):
    """Bitmask sparsification: exact by default, ``bits`` quantizes the changed deltas."""

    bits: int | None = None

    codec_id: ClassVar[str] = "bitmask"
    needs_reference: ClassVar[bool] = True

    def side_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """Names and shapes of the side arrays (see :meth:`CodecBase.side_shapes`)."""
        return {} if self.bits is None else {"rep": (2**self.bits,)}

    @property
    def lossy(self) -> bool:
        """Lossy only when ``bits`` quantizes the changed deltas."""
        return self.bits is not None

    def __post_init__(self) -> None:
        if self.bits is not None and (
            not isinstance(self.bits, int) or isinstance(self.bits, bool) or not 1 <= self.bits <= 8
        ):
            raise CodecError(f"Bitmask bits must be None or an int in 1..8, got {self.bits!r}")

    def fields(self) -> dict[str, Field]:
        """A 2-symbol ``mask``, then the ``xor`` words (exact) or LC symbols ``sym``."""
        if self.bits is None:
            return {"mask": Field.symbols(2), "xor": Field.lossless(word_dtype)}
        return {"mask": Field.symbols(2), "sym": Field.symbols(2**self.bits)}

    # ------------------------------------------------------------------ device half

    def encode(self, value: jax.Array, reference: jax.Array | None) -> Encoded:
        """Mask the changed elements; keep their bits XOR the reference's, or quantized deltas."""
        if reference is None:
            raise CodecError("the bitmask codec needs a reference")
        reference = reference.astype(value.dtype)
        mask = changed_mask(value, reference)
        if self.bits is None:
            xor = as_words(value) ^ as_words(reference)
            # Rebuilt from the stored field (not `value`): a fresh buffer, bit-equal to value.
            recon = from_words(as_words(reference) ^ xor, value.dtype)
            return Encoded(fields={"mask": mask, "xor": xor}, side={}, recon=recon)
        wd = work_dtype(value.dtype)
        delta = jnp.where(mask == 1, value.astype(wd) - reference.astype(wd), 0)
        symbols, reps = promote(delta, self.bits)
        fields = {"mask": mask, "sym": symbols}
        side = {"rep": reps}
        return Encoded(fields=fields, side=side, recon=self._quantized(fields, side, reference))

    def decode(self, fields: Arrays, side: Arrays, reference: jax.Array | None,
               dtype: Any) -> jax.Array:
        """The reference, with the changed elements XORed back or moved by their deltas."""
        if reference is None:
            raise CodecError("the bitmask codec needs a reference")
        reference = reference.astype(dtype)
        if self.bits is None:
            return from_words(as_words(reference) ^ fields["xor"], dtype)
        return self._quantized(fields, side, reference)

    @staticmethod
    def _quantized(fields: Arrays, side: Arrays, reference: jax.Array) -> jax.Array:
        wd = work_dtype(reference.dtype)
        moved = (reference.astype(wd) + dequantize(fields["sym"], side["rep"].astype(wd)))
        return jnp.where(fields["mask"] == 1, moved.astype(reference.dtype), reference)

    # ------------------------------------------------------------------ pricing

    def has_estimate(self, measure: ErrorMeasure) -> bool:
        """Exact: for any measure; quantized: for the ``l2`` measure only."""
        return self.bits is None or measure == "l2"

    def estimate(self, stats: Mapping[str, Any], n: int, dtype: np.dtype) -> Estimate:
        """Exact: ``H2(p) + sum_j (H2(q_j) + 8 q_j)`` with ``p`` the changed fraction and
        ``q_j`` the non-zero fraction of XOR byte plane ``j``. Quantized: ``H2(p)`` plus LC's
        estimate (unchanged elements have a zero delta, which LC codes as symbol 0 too)."""
        p = float(stats["changed"]) / n
        if self.bits is None:
            q = np.asarray(stats["plane_nonzero"], np.float64) / n
            return Estimate(binary_entropy(p) + sum(binary_entropy(x) + 8 * x for x in q), 0.0)
        lc = LC(self.bits).estimate(stats, n, dtype)
        return lc._replace(bits_per_element=binary_entropy(p) + lc.bits_per_element)

    # ------------------------------------------------------------------ conformance

    @classmethod
    def examples(cls) -> tuple[Bitmask, ...]:
        """Exact and 3-bit."""
        return (Bitmask(), Bitmask(3))

    def error_bound(
        self, value: np.ndarray, reference: np.ndarray | None, encoded: Encoded
    ) -> np.ndarray:
        """0 when exact; else LC's promotion bound on the changed elements, plus rounding."""
        changed = np.asarray(encoded.fields["mask"]) == 1
        if self.bits is None:
            return np.zeros(np.shape(value))
        x = np.asarray(value, np.float64) - np.asarray(reference, np.float64)
        bound = promote_bound(
            x, np.asarray(encoded.fields["sym"]), np.asarray(encoded.side["rep"])
        )
        return rounding_slack(np.where(changed, bound, 0), value, encoded.recon, value.dtype)
