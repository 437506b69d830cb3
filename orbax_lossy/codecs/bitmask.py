"""``bitmask``: BitSnap-style bitmask sparsification of a leaf against its reference.

Between nearby checkpoints most elements of a low-precision leaf (bfloat16 weights) do not
change at all: the update is below half an ulp. This codec stores

* ``mask`` (uint8 0/1 per element): the element's bit pattern differs from the reference
  reconstruction's. Entropy coded with :func:`~orbax_lossy.entropy.encode_symbols`, whose
  zero-run mode makes an almost-empty mask cost far below one bit per element;
* exact mode (``bits=None``, the default): ``xor`` (unsigned int of the leaf's width), the
  element's bits XOR the reference's bits, hence 0 wherever the mask is 0. It is coded by byte
  planes (:mod:`~orbax_lossy.codecs.lossless`): a one-ulp change flips only low bits, so the
  high plane is almost all zeros and the low plane holds a few small bytes; the zeros of
  unchanged elements cost almost nothing. (XOR was measured smaller than storing the changed
  values themselves with zeros elsewhere, whose exponent plane is dense where changed.)
  ``recon == value`` bit for bit;
* quantized mode (``bits=b``): ``sym`` (uint8), LC-Checkpoint exponent symbols
  (:func:`~orbax_lossy.codecs.lc.promote`) of the changed elements' deltas, 0 elsewhere, with
  the ``2**b`` representatives as a side array. Unchanged elements stay bit-exact; changed ones
  decode to ``reference + rep[sym]``. (Without the mask this is plain LC; the mask costs
  ``H(p)`` bits per element extra, little when the change is sparse.)

Both per-element fields are shaped like the leaf, so they are cut into chunk-grid pieces and
restored onto any sharding like any other field. The codec needs a reference, so the handler
never uses it on a base save.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.codecs import lossless
from orbax_lossy.codecs.base import (
    Encoded,
    dataclass_config,
    decode_symbol_field,
    encode_symbol_field,
    register_codec,
)
from orbax_lossy.codecs.lc import dequantize, promote, work_dtype
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


@register_codec
@dataclasses.dataclass(frozen=True)
class Bitmask:
    """Bitmask sparsification: exact by default, ``bits`` quantizes the changed deltas."""

    bits: int | None = None

    codec_id: ClassVar[str] = "bitmask"
    needs_reference: ClassVar[bool] = True

    @property
    def lossy(self) -> bool:
        return self.bits is not None

    def __post_init__(self) -> None:
        if self.bits is not None and (
            not isinstance(self.bits, int) or isinstance(self.bits, bool) or not 1 <= self.bits <= 8
        ):
            raise CodecError(f"Bitmask bits must be None or an int in 1..8, got {self.bits!r}")

    def config(self) -> dict[str, Any]:
        return dataclass_config(self)

    def field_dtypes(self, dtype: np.dtype) -> dict[str, np.dtype]:
        if self.bits is None:
            return {"mask": np.dtype(np.uint8), "xor": word_dtype(dtype)}
        return {"mask": np.dtype(np.uint8), "sym": np.dtype(np.uint8)}

    # ------------------------------------------------------------------ device half

    def device_encode(self, value: jax.Array, reference: jax.Array | None) -> Encoded:
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

    def device_decode(self, fields, side, reference, dtype) -> jax.Array:
        reference = reference.astype(dtype)
        if self.bits is None:
            return from_words(as_words(reference) ^ fields["xor"], dtype)
        return self._quantized(fields, side, reference)

    @staticmethod
    def _quantized(fields: dict[str, jax.Array], side: dict[str, jax.Array], reference):
        wd = work_dtype(reference.dtype)
        moved = (reference.astype(wd) + dequantize(fields["sym"], side["rep"].astype(wd)))
        return jnp.where(fields["mask"] == 1, moved.astype(reference.dtype), reference)

    # ------------------------------------------------------------------ host half

    def host_encode(self, field: str, array: np.ndarray) -> bytes:
        if field == "xor":
            return lossless.encode_array(np.ascontiguousarray(array))
        return encode_symbol_field(array)

    def host_decode(
        self, field: str, data: bytes, shape: tuple[int, ...], dtype: np.dtype
    ) -> np.ndarray:
        if field == "xor":
            return lossless.decode_array(data, shape, dtype)
        alphabet = 2 if field == "mask" else 2 ** (self.bits or 8)
        return decode_symbol_field(data, shape, alphabet)
