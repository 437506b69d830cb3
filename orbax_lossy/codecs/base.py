"""The codec contract, the base class every built-in codec derives from, and the registry.

A codec is a frozen dataclass with a stable ``codec_id``: a device half it writes itself
(``encode``/``decode``, traced into the jitted save and restore programs) and a host half
(bytes in, bytes out) that :class:`CodecBase` derives from the declared :meth:`fields`.
Subclassing registers the class, so a manifest's ``{"id": ..., **config}`` decodes through
:func:`codec_from_config` alone. Third-party codecs register through the entry-point group
``orbax_lossy.codecs``. How to write one: ``docs/codecs.md``.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import importlib.metadata
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, NamedTuple, Protocol, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.codecs import lossless
from orbax_lossy.entropy import decode_symbols, encode_symbols
from orbax_lossy.errors import CodecError, FormatError

#: entry-point group through which installed packages provide codec classes
ENTRY_POINT_GROUP = "orbax_lossy.codecs"

#: named arrays of one encoded leaf: its per-element ``fields`` or its per-leaf ``side`` arrays
Arrays: TypeAlias = dict[str, jax.Array]


class Encoded(NamedTuple):
    """What a device encode returns: per-element ``fields`` (shaped like the leaf), small
    per-leaf ``side`` arrays (stored in the manifest) and the reconstruction ``recon``."""

    fields: Arrays
    side: Arrays
    recon: jax.Array


class Estimate(NamedTuple):
    """A codec's price on one leaf: bits per element and relative errors (see docs/adaptive.md)."""

    bits_per_element: float
    #: ``||recon - value|| / ||value||``; ``inf`` when the handler's guard would refuse it
    rel_error: float
    #: ``||recon - value|| / ||value - reference||`` (delta codecs), else 0
    progress_error: float = 0.0


class Codec(Protocol):
    """What the handler and the policies use of a codec.

    ``needs_reference``: decoding needs the previous reconstruction (a delta codec; never used
    on base saves). ``lossy``: the reconstruction may differ from the value (the handler then
    guards it). ``fields`` are arrays shaped like the leaf, cut into chunk-grid pieces on disk;
    ``side`` holds small per-leaf arrays stored in the manifest.
    """

    codec_id: ClassVar[str]

    @property
    def needs_reference(self) -> bool:
        """Whether decoding needs the previous reconstruction (a delta codec)."""
        ...

    @property
    def lossy(self) -> bool:
        """Whether the reconstruction may differ from the value."""
        ...

    def config(self) -> dict[str, Any]:
        """The codec's parameters as stored in the manifest (without the ``id`` key)."""
        ...

    def field_dtypes(self, dtype: np.dtype) -> dict[str, np.dtype]:
        """The dtype of every per-element field for a leaf of ``dtype``, by field name."""
        ...

    def device_encode(self, value: jax.Array, reference: jax.Array | None) -> Encoded:
        """Encode one leaf on device (traced into the jitted save program)."""
        ...

    def device_decode(self, fields: Arrays, side: Arrays, reference: jax.Array | None,
                      dtype: np.dtype) -> jax.Array:
        """Decode one leaf on device (traced); reproduces the encode's ``recon`` exactly."""
        ...

    def host_encode(self, field: str, array: np.ndarray) -> bytes:
        """The stored bytes of one chunk of the per-element ``field``."""
        ...

    def host_decode(
        self, field: str, data: bytes, shape: tuple[int, ...], dtype: np.dtype
    ) -> np.ndarray:
        """Inverse of :meth:`host_encode`: the chunk of ``field`` of ``shape`` and ``dtype``."""
        ...


#: how a policy measures a lossy codec's error on a leaf (see docs/adaptive.md)
ErrorMeasure = Literal["l2", "elementwise"]

#: a field's dtype: fixed, ``None`` for the leaf's own dtype, or a function of the leaf dtype
FieldDtype = np.dtype | Callable[[np.dtype], np.dtype] | None


@dataclasses.dataclass(frozen=True)
class Field:
    """Declaration of one per-element field: its dtype and its host coder.

    ``coder="symbols"``: uint8 symbols below ``alphabet``, Huffman coded
    (:func:`encode_symbol_field`); ``coder="lossless"``: the byte-plane coder
    (:mod:`~orbax_lossy.codecs.lossless`) for any dtype.
    """

    coder: Literal["symbols", "lossless"]
    dtype: FieldDtype = None
    alphabet: int = 0

    @staticmethod
    def symbols(alphabet: int) -> Field:
        """A uint8 symbol field with symbols below ``alphabet`` (2..256), Huffman coded."""
        if not 2 <= alphabet <= 256:
            raise CodecError(f"a symbol field's alphabet must be in 2..256, got {alphabet}")
        return Field("symbols", np.dtype(np.uint8), alphabet)

    @staticmethod
    def lossless(dtype: FieldDtype = None) -> Field:
        """A field of ``dtype`` (default: the leaf's) stored by the byte-plane coder."""
        return Field("lossless", dtype)

    def dtype_for(self, leaf_dtype: Any) -> np.dtype:
        """This field's dtype for a leaf of ``leaf_dtype``."""
        if self.dtype is None:
            return np.dtype(leaf_dtype)
        if isinstance(self.dtype, np.dtype):
            return self.dtype
        return np.dtype(self.dtype(np.dtype(leaf_dtype)))


_REGISTRY: dict[str, type] = {}


def register_codec(cls: type) -> type:
    """Make ``cls`` decodable from its ``codec_id`` (automatic for :class:`CodecBase`)."""
    codec_id = getattr(cls, "codec_id", None)
    if not isinstance(codec_id, str) or not codec_id:
        raise CodecError(f"{cls.__qualname__} has no codec_id")
    known = _REGISTRY.get(codec_id)
    if known is not None and known is not cls:
        raise CodecError(
            f"codec id {codec_id!r} is registered twice ({known.__module__}.{known.__qualname__}"
            f" and {cls.__module__}.{cls.__qualname__})"
        )
    _REGISTRY[codec_id] = cls
    return cls


def registered_codecs() -> Mapping[str, type]:
    """The registered codec classes by id (built-ins and entry points loaded so far)."""
    return dict(_REGISTRY)


def _load_entry_point(codec_id: str) -> type | None:
    """Load and register the codec class an installed package declares for ``codec_id``."""
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name != codec_id:
            continue
        cls = ep.load()
        if getattr(cls, "codec_id", None) != codec_id:
            raise CodecError(f"entry point {ep.value!r} does not define codec {codec_id!r}")
        return register_codec(cls)
    return None


def codec_config(codec: Codec) -> dict[str, Any]:
    """The config stored in a manifest: ``{"id": codec_id, **codec.config()}``."""
    return {"id": codec.codec_id, **codec.config()}


def codec_from_config(config: Mapping[str, Any], where: str = "") -> Codec:
    """Instantiate a codec from the config stored in a manifest."""
    cfg = dict(config)
    codec_id = cfg.pop("id", None)
    cls = _REGISTRY.get(codec_id) if isinstance(codec_id, str) else None
    if cls is None and isinstance(codec_id, str):
        cls = _load_entry_point(codec_id)
    if cls is None:
        raise CodecError(f"{where}: unknown codec id {codec_id!r} (known: {sorted(_REGISTRY)})")
    try:
        if hasattr(cls, "from_config"):
            return cls.from_config(cfg)
        return cls(**cfg)
    except (TypeError, ValueError) as e:
        raise CodecError(f"{where}: bad parameters {cfg!r} for codec {codec_id!r}: {e}") from e


def dataclass_config(codec: Any) -> dict[str, Any]:
    """The dataclass fields of ``codec`` by name (the default :meth:`CodecBase.config`)."""
    return {f.name: getattr(codec, f.name) for f in dataclasses.fields(codec)}


@functools.lru_cache(maxsize=1024)
def _field_dtypes(codec: CodecBase, dtype: np.dtype) -> dict[str, np.dtype]:
    """:meth:`CodecBase.field_dtypes`, once per codec and dtype (a restore asks for every
    leaf of every link several times; codecs are frozen dataclasses)."""
    return {name: f.dtype_for(dtype) for name, f in codec.fields().items()}


class CodecBase(abc.ABC):
    """Base class of a codec; subclasses are frozen dataclasses and register on definition.

    A subclass declares ``codec_id``, ``lossy``, ``needs_reference`` (class attributes or
    properties), :meth:`fields`, and writes :meth:`encode` and :meth:`decode`. Config,
    equality and the host half come from here. ``class C(CodecBase, register=False)`` defines
    a codec without registering it (an entry point registers it when it is loaded).
    Optional hooks: :meth:`has_estimate`/:meth:`estimate` (an analytic price for
    :class:`~orbax_lossy.policy.AdaptivePolicy`, which otherwise measures the codec by running
    it), :meth:`error_bound` and :meth:`examples` (the conformance suite).
    """

    codec_id: ClassVar[str]

    def __init_subclass__(cls, register: bool = True, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if register and "codec_id" in cls.__dict__:
            register_codec(cls)

    # Read-only here, so that a subclass may declare either a class attribute or a property.
    @property
    def lossy(self) -> bool:
        """Whether the reconstruction may differ from the value (default: True)."""
        return True

    @property
    def needs_reference(self) -> bool:
        """Whether decoding needs the previous reconstruction (default: False)."""
        return False

    def side_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """Names and shapes of the side arrays :meth:`encode` writes for a leaf whose work
        dtype is float32 (their dtype, whatever the leaf's size), or None: unknown without
        tracing the encode (a restore checks every stored leaf's side arrays against them;
        tracing an encode, k-means or LC's promotion, took ~50 ms per codec in a fresh
        process). ``tests/test_codec_conformance.py`` checks every codec's answer against
        the traced encode."""
        return None

    # ------------------------------------------------------------------ configuration

    def config(self) -> dict[str, Any]:
        """The codec's parameters (its dataclass fields), stored in the manifest."""
        return dataclass_config(self)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> CodecBase:
        """Inverse of :meth:`config` (without the ``id`` key)."""
        return cls(**config)

    # ------------------------------------------------------------------ declared fields

    @abc.abstractmethod
    def fields(self) -> dict[str, Field]:
        """The per-element fields the device encode returns, by name."""

    def field_dtypes(self, dtype: np.dtype) -> dict[str, np.dtype]:
        """The dtype of every declared field for a leaf of ``dtype``, by field name."""
        try:
            return dict(_field_dtypes(self, np.dtype(dtype)))
        except TypeError:  # an unhashable codec or dtype: computed each time
            return {name: f.dtype_for(dtype) for name, f in self.fields().items()}

    def _field(self, name: str) -> Field:
        spec = self.fields().get(name)
        if spec is None:
            raise FormatError(f"codec {self.codec_id!r} has no field {name!r}")
        return spec

    # ------------------------------------------------------------------ device half

    @abc.abstractmethod
    def encode(self, value: jax.Array, reference: jax.Array | None) -> Encoded:
        """Device encode (traced): fields, side arrays and the reconstruction."""

    @abc.abstractmethod
    def decode(self, fields: Arrays, side: Arrays, reference: jax.Array | None,
               dtype: Any) -> jax.Array:
        """Device decode (traced): must reproduce ``encode``'s ``recon`` bit for bit."""

    def encoded(self, fields: Arrays, side: Arrays, reference: jax.Array | None,
                dtype: Any) -> Encoded:
        """``Encoded(fields, side, recon)`` with ``recon`` from :meth:`decode` itself, so the
        reconstruction is what a restore computes by construction."""
        return Encoded(fields, side, self.decode(fields, side, reference, dtype))

    def device_encode(self, value: jax.Array, reference: jax.Array | None) -> Encoded:
        """:meth:`encode` in a named scope ``orbax_lossy.<codec_id>.encode``."""
        with jax.named_scope(f"orbax_lossy.{self.codec_id}.encode"):
            return self.encode(value, reference)

    def device_decode(self, fields: Arrays, side: Arrays, reference: jax.Array | None,
                      dtype: Any) -> jax.Array:
        """:meth:`decode` in a named scope ``orbax_lossy.<codec_id>.decode``."""
        with jax.named_scope(f"orbax_lossy.{self.codec_id}.decode"):
            return self.decode(fields, side, reference, dtype)

    # ------------------------------------------------------------------ host half

    def host_encode(self, field: str, array: np.ndarray) -> bytes:
        """Bytes of one chunk of ``field``: Huffman-coded symbols or the byte-plane coder."""
        if self._field(field).coder == "symbols":
            return encode_symbol_field(array)
        return lossless.encode_array(np.ascontiguousarray(array))

    def host_decode(
        self, field: str, data: bytes, shape: tuple[int, ...], dtype: np.dtype
    ) -> np.ndarray:
        """Inverse of :meth:`host_encode`; symbols outside the alphabet are a FormatError."""
        spec = self._field(field)
        if spec.coder == "symbols":
            return decode_symbol_field(data, shape, spec.alphabet)
        return lossless.decode_array(data, shape, dtype)

    # ------------------------------------------------------------------ pricing (optional)

    def has_estimate(self, measure: ErrorMeasure) -> bool:
        """Whether :meth:`estimate` prices this codec for the error ``measure``."""
        return False

    def estimate(self, stats: Mapping[str, Any], n: int, dtype: np.dtype) -> Estimate:
        """Analytic price from the policy's leaf statistics (keys: docs/adaptive.md); only
        called when :meth:`has_estimate` is true, otherwise the policy runs a measured trial."""
        raise CodecError(f"codec {self.codec_id!r} has no analytic estimate (has_estimate is "
                         "False): price it with a measured trial")

    # ------------------------------------------------------------------ conformance

    @classmethod
    def examples(cls) -> tuple[CodecBase, ...]:
        """A few configurations the conformance suite runs (``tests/test_codec_conformance``)."""
        return (cls(),)

    def error_bound(
        self, value: np.ndarray, reference: np.ndarray | None, encoded: Encoded
    ) -> np.ndarray | None:
        """Elementwise bound on ``|recon - value|`` this codec guarantees (``None``: none)."""
        return None


# --------------------------------------------------------------------------- shared helpers


def work_dtype(dtype: Any) -> jnp.dtype:
    """The float type codecs compute in: float64 stays, everything else is float32."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def rounding_slack(
    bound: jax.Array | np.ndarray,
    value: jax.Array | np.ndarray,
    recon: jax.Array | np.ndarray,
    dtype: Any,
) -> np.ndarray:
    """Widen an exact-arithmetic error bound by the rounding of a reconstruction.

    Computing in the work dtype adds a few units of roundoff of the operands; rounding the
    result to a narrower leaf dtype at most doubles the error (the value itself is a
    candidate of that rounding).
    """
    eps = float(jnp.finfo(work_dtype(dtype)).eps)
    narrow = np.dtype(dtype).itemsize < np.dtype(work_dtype(dtype)).itemsize
    scale = np.maximum(np.abs(np.asarray(value, np.float64)), np.abs(np.asarray(recon, np.float64)))
    slack = np.asarray(bound, np.float64) + 8 * eps * scale
    return 2 * slack if narrow else slack


def sign_safe(value: jax.Array, recon: jax.Array) -> jax.Array:
    """False when ``value`` is non-negative but ``recon`` is not, or zeroes a positive element.

    A non-negative leaf (Adam's second moment) must decode non-negative, and positive wherever
    the value is positive: Adam divides by ``sqrt(nu) + eps``.
    """
    if not jnp.issubdtype(value.dtype, jnp.floating) or value.size == 0:
        return jnp.ones((), jnp.bool_)
    # Given both non-negative, sign(value) - sign(recon) is 1 exactly where value > 0 and
    # recon is +-0; a NaN makes a min or max NaN, which compares False.
    kept = all_nonnegative(recon) & (jnp.max(jnp.sign(value) - jnp.sign(recon)) < 1)
    return ~all_nonnegative(value) | kept


def all_nonnegative(x: jax.Array) -> jax.Array:
    """``jnp.all(x >= 0)`` of a floating-point ``x`` (NaN counts as negative), as a float
    minimum: XLA:CPU vectorizes a reduction of floats, not one of comparisons (measured at
    64 MB float32: 2.3 ms against 7.9 ms; ``sign_safe`` 3x faster)."""
    if x.size == 0:
        return jnp.ones((), jnp.bool_)
    return jnp.min(x) >= 0


def order0_entropy(counts: np.ndarray) -> float:
    """Order-0 entropy in bits per symbol of a histogram."""
    c = np.asarray(counts, np.float64)
    c = c[c > 0]
    total = c.sum()
    if total <= 0:
        return 0.0
    p = c / total
    return float(-(p * np.log2(p)).sum())


def binary_entropy(p: float) -> float:
    """Entropy in bits of a two-symbol source with probability ``p``."""
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return float(-p * math.log2(p) - (1 - p) * math.log2(1 - p))


def encode_symbol_field(array: np.ndarray) -> bytes:
    """Host half of a uint8 symbol field (LC symbols, k-means indices, a bitmask)."""
    return encode_symbols(np.ascontiguousarray(array, dtype=np.uint8).reshape(-1))


def decode_symbol_field(data: bytes, shape: tuple[int, ...], alphabet: int) -> np.ndarray:
    """Inverse of :func:`encode_symbol_field`; every symbol must be below ``alphabet``.

    A symbol outside the alphabet would index past a codebook on device, where JAX clamps
    indices silently, so it is rejected here as corrupted data.
    """
    n = math.prod(shape)  # (per piece: math.prod takes 3 us less than np.prod)
    return decode_symbols(data, n, alphabet).reshape(shape)
