"""The codec protocol and registry.

A codec is a frozen (hashable) dataclass with two halves, in the spirit of Optax's pure pairs:

* a **device half**, traced inside the one jitted program that encodes the whole tree:
  ``device_encode(value, reference) -> Encoded`` and
  ``device_decode(fields, side, reference, dtype) -> value``;
* a **host half**, run in the background commit thread, bytes in / bytes out:
  ``host_encode(field, array) -> bytes`` and ``host_decode(field, data, shape, dtype) -> array``.

``fields`` are arrays shaped like the leaf (they are cut into chunk-grid pieces on disk, and
restored onto any sharding); ``side`` holds small per-leaf arrays (a codebook, bucket
representatives) stored in the manifest. Like numcodecs, each codec has a stable
``codec_id`` and a ``config()``; the manifest records both so a reader needs only the
registry (``codec_from_config``) to decode.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple, Protocol

import jax
import numpy as np

from orbax_lossy.entropy import decode_symbols, encode_symbols
from orbax_lossy.errors import CodecError, FormatError


class Encoded(NamedTuple):
    fields: dict[str, jax.Array]
    side: dict[str, jax.Array]
    recon: jax.Array


class Codec(Protocol):
    """``needs_reference``: decoding needs the previous reconstruction (a delta codec; never
    used on base saves). ``lossy``: the reconstruction may differ from the value (the handler
    then guards it, see :func:`orbax_lossy.program.encode_tree`)."""

    codec_id: ClassVar[str]

    @property
    def needs_reference(self) -> bool: ...

    @property
    def lossy(self) -> bool: ...

    def config(self) -> dict[str, Any]: ...

    def field_dtypes(self, dtype: np.dtype) -> dict[str, np.dtype]: ...

    def device_encode(self, value: jax.Array, reference: jax.Array | None) -> Encoded: ...

    def device_decode(
        self,
        fields: dict[str, jax.Array],
        side: dict[str, jax.Array],
        reference: jax.Array | None,
        dtype: np.dtype,
    ) -> jax.Array: ...

    def host_encode(self, field: str, array: np.ndarray) -> bytes: ...

    def host_decode(
        self, field: str, data: bytes, shape: tuple[int, ...], dtype: np.dtype
    ) -> np.ndarray: ...


_REGISTRY: dict[str, type] = {}


def register_codec(cls: type) -> type:
    """Class decorator: make ``cls`` decodable from its ``codec_id``."""
    codec_id = cls.codec_id
    if codec_id in _REGISTRY and _REGISTRY[codec_id] is not cls:
        raise CodecError(f"codec id {codec_id!r} is registered twice")
    _REGISTRY[codec_id] = cls
    return cls


def codec_config(codec: Codec) -> dict[str, Any]:
    return {"id": codec.codec_id, **codec.config()}


def codec_from_config(config: dict[str, Any], where: str = "") -> Codec:
    """Instantiate a codec from the config stored in a manifest."""
    cfg = dict(config)
    codec_id = cfg.pop("id", None)
    cls = _REGISTRY.get(codec_id)  # type: ignore[arg-type]
    if cls is None:
        raise CodecError(f"{where}: unknown codec id {codec_id!r} (known: {sorted(_REGISTRY)})")
    try:
        return cls(**cfg)
    except (TypeError, ValueError) as e:
        raise CodecError(f"{where}: bad parameters {cfg!r} for codec {codec_id!r}: {e}") from e


def dataclass_config(codec: Any) -> dict[str, Any]:
    return {f.name: getattr(codec, f.name) for f in dataclasses.fields(codec)}


def encode_symbol_field(array: np.ndarray) -> bytes:
    """Host half of a uint8 symbol field (LC symbols, k-means indices, a bitmask)."""
    return encode_symbols(np.ascontiguousarray(array, dtype=np.uint8).reshape(-1))


def decode_symbol_field(data: bytes, shape: tuple[int, ...], alphabet: int) -> np.ndarray:
    """Inverse of :func:`encode_symbol_field`; every symbol must be below ``alphabet``.

    A symbol outside the alphabet would index past a codebook on device, where JAX clamps
    indices silently, so it is rejected here as corrupted data.
    """
    n = int(np.prod(shape, dtype=np.int64))
    out = decode_symbols(data, n).reshape(shape)
    if out.size and int(out.max()) >= alphabet:
        raise FormatError(f"symbol {int(out.max())} outside the alphabet of {alphabet} symbols")
    return out
