"""``exact``: the leaf is stored bit for bit (byte-plane entropy coding, see ``lossless``).

Used for base snapshots of float leaves and always for integer, bool, PRNG-key and step
leaves. The reconstruction is the value itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.codecs import lossless
from orbax_lossy.codecs.base import Encoded, register_codec


@register_codec
@dataclasses.dataclass(frozen=True)
class Exact:
    """Lossless storage of a leaf of any dtype."""

    codec_id: ClassVar[str] = "exact"
    needs_reference: ClassVar[bool] = False
    lossy: ClassVar[bool] = False

    def config(self) -> dict[str, Any]:
        return {}

    def field_dtypes(self, dtype: np.dtype) -> dict[str, np.dtype]:
        return {"raw": np.dtype(dtype)}

    def device_encode(self, value: jax.Array, reference: jax.Array | None) -> Encoded:
        # A fresh buffer (not the caller's), so the reference survives donation of `value`.
        recon = jnp.copy(value)
        return Encoded(fields={"raw": value}, side={}, recon=recon)

    def device_decode(self, fields, side, reference, dtype) -> jax.Array:
        return fields["raw"].astype(dtype)

    def host_encode(self, field: str, array: np.ndarray) -> bytes:
        return lossless.encode_array(array)

    def host_decode(
        self, field: str, data: bytes, shape: tuple[int, ...], dtype: np.dtype
    ) -> np.ndarray:
        return lossless.decode_array(data, shape, dtype)
