"""``lc``: LC-Checkpoint (Chen et al., ICML 2020) exponent-based delta quantization.

Device half (pure JAX, traced into the tree-wide jitted program):

1. ``delta = value - reference`` in float32 (float64 for float64 leaves), where the reference
   is the *reconstruction* of the previous checkpoint (closed loop, Algorithm 1 of the paper).
2. Every non-zero element falls in a bucket keyed by its sign and base-2 exponent ``e``
   (``2**(e-1) <= |delta| < 2**e``, from ``frexp``).
3. Priority promotion: keep the buckets whose exponent is at least ``e_min``, the smallest
   exponent such that the kept buckets fit in ``2**bits - 1`` non-zero symbols; symbol 0 means
   "no change". Because the cut is by exponent, every dropped element is smaller in magnitude
   than the lower edge of every kept bucket. (With ``bits=1`` there is one non-zero symbol; if
   the top exponent holds both signs, the bucket with more elements is kept and the bound
   holds per sign.)
4. Each kept bucket decodes to the paper's representative ``(max + min) / 2`` of the
   magnitudes in it, with the bucket's sign. The midrange (rather than the mean) is what makes
   the relative error of every kept element strictly below 50%, and the sign never flips.
5. ``recon = (reference + rep[symbol]).astype(dtype)``; restore runs the same expression.
6. In a non-negative leaf (Adam's ``nu``), an element that is positive now but ``<= 0`` in the
   reference is never dropped: it takes the smallest kept positive bucket's symbol, so it
   decodes positive (over-estimating a second moment makes that element's step smaller, the
   safe direction; dropping it would decode 0 and make the step huge); an element whose
   quantized decrease would overshoot to ``<= 0`` keeps its positive reference (symbol 0).
   Both are choices of the encoder; the decode expression is unchanged.

``mode="direct"`` applies the same quantizer to the value itself instead of a delta (the issue's
"moments through LC, direct or delta"): priority promotion then keeps the ``2**bits - 1``
largest-exponent buckets of the value and sends every smaller element to 0 - magnitude pruning
with a bound, in the spirit of ExCP's momentum shrinking. It needs no reference, so it can be
used on base saves; it suits signed leaves such as Adam's first moment, never a second moment
(a positive element pruned to 0 is refused by the handler's guard, which then stores the leaf
exactly).

``domain="log"`` (delta mode, ``bits >= 2``; for non-negative leaves such as Adam's ``nu``)
quantizes ``log(value / reference)`` instead of the difference: buckets, promotion and
midrange as above, on the log-ratio, so a dropped element keeps its reference within a
relative error ``exp(2**e_min) - 1`` and every element has the same *relative* precision
(a second moment spans many decades; a linear delta drops the small ones). The side table
holds the factors ``exp(rep)`` (``factor[0] == 1``) and decode is one multiply,
``min(reference * factor[symbol], max)``, the same IEEE expression on every backend. The top
symbol is reserved for elements that are positive now but ``<= 0`` in the reference (no
ratio): they decode to the largest such value (``side["born"]``); the next save corrects them.
An element that drops to exactly 0 keeps its reference (the guard accepts it: the value is
not positive).

Statistics are **per leaf** (not per block): a leaf's deltas share one scale regime, the
representative table costs ``2**bits`` floats per leaf instead of per block, and - most
important for sharded arrays - the bucket choice is one global reduction per leaf, so every
process and every shard agree on the alphabet without any host round trip. The scope is
recorded in the manifest (``"stats": "leaf"``).

Non-finite deltas (NaN/Inf) are never quantized: the handler stores such a leaf exactly for
that save (see ``handler.py``), so no garbage is ever written.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.codecs.base import (
    Encoded,
    dataclass_config,
    decode_symbol_field,
    encode_symbol_field,
    register_codec,
)
from orbax_lossy.errors import CodecError


def work_dtype(dtype: Any) -> jnp.dtype:
    """The float type deltas are computed in: float64 stays, everything else is float32."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def _exponent_range(dtype: jnp.dtype) -> tuple[int, int]:
    info = jnp.finfo(dtype)
    # frexp exponents span [minexp - nmant + 1, maxexp] (denormals included).
    return int(info.minexp) - int(info.nmant) + 1, int(info.maxexp)


def exponent_buckets(delta: jax.Array) -> tuple[jax.Array, int]:
    """Bucket id of every element: ``2 * (e - e_lo) + (delta < 0)``; zeros get ``-1``."""
    lo, hi = _exponent_range(delta.dtype)
    _, e = jnp.frexp(delta)
    bucket = 2 * (e.astype(jnp.int32) - lo) + (delta < 0).astype(jnp.int32)
    # Zeros and subnormals are "no change": XLA flushes subnormals on CPU/GPU, so a bucket
    # of them could not be represented faithfully.
    bucket = jnp.where(jnp.abs(delta) < jnp.finfo(delta.dtype).tiny, -1, bucket)
    return bucket, 2 * (hi - lo + 1)


def promote(
    delta: jax.Array, bits: int, lift: jax.Array | None = None, reserve: int = 0
) -> tuple[jax.Array, jax.Array]:
    """Exponent quantization with priority promotion.

    Returns ``(symbols uint8 shaped like delta, representatives [2**bits])`` where
    ``representatives[0] == 0``. ``delta`` must be finite. ``lift`` (bool, shaped like
    ``delta``) marks positive elements that must not be dropped: those that would get symbol 0
    get the symbol of the smallest kept positive bucket instead (when there is one).
    ``reserve`` top symbols are left unused (needs ``2**bits - 1 - reserve >= 1``).
    """
    n_symbols = 2**bits - reserve
    flat = delta.reshape(-1)
    bucket, n_buckets = exponent_buckets(flat)
    seg = jnp.where(bucket < 0, n_buckets, bucket)  # zeros go to a dropped extra segment
    mag = jnp.abs(flat)
    counts = jax.ops.segment_sum(jnp.ones_like(seg), seg, num_segments=n_buckets + 1)[:-1]
    big = jnp.asarray(jnp.inf, mag.dtype)
    max_mag = jax.ops.segment_max(mag, seg, num_segments=n_buckets + 1)[:-1]
    min_mag = jax.ops.segment_min(jnp.where(bucket < 0, big, mag), seg, n_buckets + 1)[:-1]

    present = (counts > 0).reshape(-1, 2)  # [exponent, sign]
    per_exponent = present.sum(axis=1)
    from_top = jnp.cumsum(per_exponent[::-1])[::-1]  # buckets with exponent >= e
    keep = present & (from_top <= n_symbols - 1)[:, None]
    # bits=1 with both signs at the top exponent: keep the fuller of the two buckets.
    top = jnp.max(jnp.where(per_exponent > 0, jnp.arange(per_exponent.shape[0]), -1))
    counts2 = counts.reshape(-1, 2)
    fuller = jnp.where(counts2[top, 1] > counts2[top, 0], 1, 0)
    fallback = (
        jnp.zeros_like(keep).at[top, fuller].set(True) & present & (top >= 0)
    )
    keep = jnp.where(jnp.any(keep), keep, fallback).reshape(-1)

    rank = jnp.cumsum(keep[::-1].astype(jnp.int32))[::-1]  # kept buckets with id >= this one
    symbol_of_bucket = jnp.where(keep, rank, 0)
    midrange = (max_mag + min_mag) * jnp.asarray(0.5, mag.dtype)
    signed = jnp.where(jnp.arange(n_buckets) % 2 == 1, -midrange, midrange)
    reps = jnp.zeros((2**bits,), mag.dtype).at[symbol_of_bucket].max(
        jnp.where(keep, jnp.abs(signed), 0)
    )
    sign_of_symbol = jnp.zeros((2**bits,), jnp.bool_).at[symbol_of_bucket].max(
        keep & (jnp.arange(n_buckets) % 2 == 1)
    )
    reps = jnp.where(sign_of_symbol, -reps, reps)
    symbols = jnp.where(bucket < 0, 0, symbol_of_bucket[jnp.maximum(bucket, 0)])
    if lift is not None:
        positive_kept = keep & (jnp.arange(n_buckets) % 2 == 0)
        lowest = jnp.argmax(positive_kept)  # smallest exponent first: the lowest kept bucket
        lifted = lift.reshape(-1) & (symbols == 0) & jnp.any(positive_kept)
        symbols = jnp.where(lifted, symbol_of_bucket[lowest], symbols)
    return symbols.astype(jnp.uint8).reshape(delta.shape), reps


def dequantize(symbols: jax.Array, reps: jax.Array) -> jax.Array:
    return reps[symbols.astype(jnp.int32)]


@register_codec
@dataclasses.dataclass(frozen=True)
class LC:
    """LC-Checkpoint delta codec with a ``2**bits`` symbol alphabet (zero included)."""

    bits: int = 3
    stats: str = "leaf"
    mode: str = "delta"
    domain: str = "linear"

    codec_id: ClassVar[str] = "lc"
    lossy: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not isinstance(self.bits, int) or isinstance(self.bits, bool) or not (
            1 <= self.bits <= 8
        ):
            raise CodecError(f"LC bits must be an int in 1..8, got {self.bits!r}")
        if self.stats != "leaf":
            raise CodecError(f"LC statistics scope {self.stats!r} is not supported")
        if self.mode not in ("delta", "direct"):
            raise CodecError(f"LC mode must be 'delta' or 'direct', got {self.mode!r}")
        if self.domain not in ("linear", "log"):
            raise CodecError(f"LC domain must be 'linear' or 'log', got {self.domain!r}")
        if self.domain == "log" and (self.mode != "delta" or self.bits < 2):
            raise CodecError("LC domain='log' codes ratios to a reference: mode='delta', bits >= 2")

    @property
    def needs_reference(self) -> bool:
        return self.mode == "delta"

    def config(self) -> dict[str, Any]:
        return dataclass_config(self)

    def field_dtypes(self, dtype: np.dtype) -> dict[str, np.dtype]:
        return {"sym": np.dtype(np.uint8)}

    def device_encode(self, value: jax.Array, reference: jax.Array | None) -> Encoded:
        if not jnp.issubdtype(value.dtype, jnp.floating):
            raise CodecError(f"LC codes floating-point leaves, got {value.dtype}")
        wd = work_dtype(value.dtype)
        if self.mode == "direct":
            symbols, reps = promote(value.astype(wd), self.bits)
            recon = dequantize(symbols, reps).astype(value.dtype)
            return Encoded(fields={"sym": symbols}, side={"rep": reps}, recon=recon)
        if reference is None:
            raise CodecError("LC mode='delta' needs a reference")
        if self.domain == "log":
            return self._encode_log(value, reference)
        ref = reference.astype(wd)
        v = value.astype(wd)
        delta = v - ref
        # A non-negative leaf (a second moment) must stay positive where it is positive: an
        # element that became positive on a zero reference ("newborn") is never dropped.
        nonnegative = jnp.all(v >= 0)
        symbols, reps = promote(delta, self.bits, lift=(ref <= 0) & (v > 0) & nonnegative)
        # ... and an element whose quantized decrease would overshoot to <= 0 keeps its
        # (positive) reference instead: symbol 0, the same decode expression.
        trial = (ref + dequantize(symbols, reps)).astype(value.dtype)
        overshoot = nonnegative & (ref > 0) & ((trial < 0) | ((trial <= 0) & (v > 0)))
        symbols = jnp.where(overshoot, jnp.zeros_like(symbols), symbols)
        # symbol 0 decodes to ref + 0.0, which is ref itself where ref > 0
        recon = jnp.where(overshoot, ref.astype(value.dtype), trial)
        return Encoded(fields={"sym": symbols}, side={"rep": reps}, recon=recon)

    def _encode_log(self, value: jax.Array, reference: jax.Array) -> Encoded:
        """Log domain: quantize ``log(value / reference)``; see the module docstring."""
        wd = work_dtype(value.dtype)
        v, r = value.astype(wd), reference.astype(wd)
        both = (v > 0) & (r > 0)
        born = (r <= 0) & (v > 0)
        ratio = jnp.log(jnp.where(both, v, 1)) - jnp.log(jnp.where(both, r, 1))
        symbols, log_reps = promote(jnp.where(both, ratio, 0), self.bits, reserve=1)
        symbols = jnp.where(born, jnp.uint8(2**self.bits - 1), symbols)
        factor = jnp.exp(log_reps).at[0].set(1).at[-1].set(1)
        # one value for every newborn element: the largest (over-estimating a second moment
        # makes the step smaller); the next save corrects it as an ordinary ratio
        newborn = jnp.max(jnp.where(born, v, 0), initial=0).reshape(1)
        side = {"factor": factor, "born": newborn}
        fields = {"sym": symbols}
        return Encoded(fields, side, self.device_decode(fields, side, reference, value.dtype))

    def device_decode(self, fields, side, reference, dtype) -> jax.Array:
        wd = work_dtype(dtype)
        if self.domain == "log":
            ref = reference.astype(wd)
            scaled = ref * side["factor"].astype(wd)[fields["sym"].astype(jnp.int32)]
            scaled = jnp.minimum(scaled, jnp.asarray(float(jnp.finfo(dtype).max), wd))
            born = fields["sym"] == 2**self.bits - 1
            return jnp.where(born, side["born"].astype(wd)[0], scaled).astype(dtype)
        reps = side["rep"].astype(wd)
        if self.mode == "direct":
            return dequantize(fields["sym"], reps).astype(dtype)
        return (reference.astype(wd) + dequantize(fields["sym"], reps)).astype(dtype)

    def host_encode(self, field: str, array: np.ndarray) -> bytes:
        return encode_symbol_field(array)

    def host_decode(
        self, field: str, data: bytes, shape: tuple[int, ...], dtype: np.dtype
    ) -> np.ndarray:
        return decode_symbol_field(data, shape, 2**self.bits)
