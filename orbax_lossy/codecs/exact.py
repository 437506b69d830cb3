"""``exact``: the leaf is stored bit for bit (byte-plane entropy coding, see ``lossless``).

Used for base snapshots of float leaves and always for integer, bool, PRNG-key and step
leaves. The reconstruction is the value itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.codecs import base
from orbax_lossy.codecs.base import Arrays, CodecBase, Encoded, Field


@dataclasses.dataclass(frozen=True)
class Exact(CodecBase):
    """Lossless storage of a leaf of any dtype."""

    codec_id: ClassVar[str] = "exact"
    lossy: ClassVar[bool] = False

    def side_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """Names and shapes of the side arrays (see :meth:`CodecBase.side_shapes`)."""
        return {}

    def fields(self) -> dict[str, Field]:
        """One field ``raw``: the leaf itself, byte-plane coded."""
        return {"raw": Field.lossless()}

    def encode(self, value: jax.Array, reference: jax.Array | None) -> Encoded:
        """The value as field ``raw``; the reconstruction is a copy of it."""
        # A fresh buffer (not the caller's), so the reference survives donation of `value`.
        return Encoded(fields={"raw": value}, side={}, recon=jnp.copy(value))

    def decode(self, fields: Arrays, side: Arrays, reference: jax.Array | None,
               dtype: Any) -> jax.Array:
        """Field ``raw`` as ``dtype``."""
        return fields["raw"].astype(dtype)

    def has_estimate(self, measure: base.ErrorMeasure) -> bool:
        """Always: the estimate is analytic for every measure (no error)."""
        return True

    def estimate(self, stats: Mapping[str, Any], n: int, dtype: np.dtype) -> base.Estimate:
        """``H(sign, exponent) + mantissa bits``, at most the raw width."""
        raw = 8.0 * np.dtype(dtype).itemsize
        mantissa = int(jnp.finfo(dtype).nmant)
        return base.Estimate(min(raw, base.order0_entropy(stats["value_hist"]) + mantissa), 0.0)
