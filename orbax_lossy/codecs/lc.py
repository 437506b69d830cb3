"""``lc``: LC-Checkpoint (Chen et al., ICML 2020) exponent-based delta quantization.

Every non-zero element of the delta (``mode="delta"``) or of the value (``mode="direct"``)
falls in a (sign, base-2 exponent) bucket; priority promotion keeps the largest-exponent
buckets that fit in ``2**bits - 1`` symbols, each decoding to its midrange; symbol 0 is
"no change". ``domain="log"`` codes ``log(value / reference)`` for non-negative leaves.
Statistics are per leaf. Specification and guarantees: ``docs/codecs.md``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.codecs.base import (
    CodecBase,
    Encoded,
    ErrorMeasure,
    Estimate,
    Field,
    all_nonnegative,
    order0_entropy,
    rounding_slack,
    work_dtype,
)
from orbax_lossy.codecs.lookup import table_lookup
from orbax_lossy.errors import CodecError

__all__ = ["LC", "bucket_table", "dequantize", "promote", "table_estimate", "work_dtype"]

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


def segment_ids(x: jax.Array) -> tuple[jax.Array, int]:
    """Bucket id of every element of the flat ``x`` as a segment id: ``n_buckets`` for zeros
    and subnormals (and non-finite elements), else the id :func:`exponent_buckets` gives,
    read from the exponent bits (no ``frexp``).

    Returns ``(ids, n_buckets)``; ids are int16 where they fit.
    """
    lo, hi = _exponent_range(x.dtype)
    info = jnp.finfo(x.dtype)
    n_buckets = 2 * (hi - lo + 1)
    uint = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
    raw = jax.lax.bitcast_convert_type(x, uint)
    field = (raw >> int(info.nmant)) & ((1 << int(info.nexp)) - 1)  # biased exponent
    sign = (raw >> (8 * x.dtype.itemsize - 1)).astype(jnp.int32)
    # frexp's exponent of a normal number is field - (maxexp - 2)
    bucket = 2 * (field.astype(jnp.int32) + (2 - hi - lo)) + sign
    normal = (field > 0) & (field < (1 << int(info.nexp)) - 1)
    ids = jnp.where(normal, bucket, n_buckets)
    return ids.astype(jnp.int16 if n_buckets < 2**15 else jnp.int32), n_buckets


#: Rows of bucket slots that :func:`_bucket_extremes` spreads neighbouring elements over.
EXTREME_ROWS = 4


def _bucket_extremes(
    flat: jax.Array, seg: jax.Array, n_buckets: int
) -> tuple[jax.Array, jax.Array]:
    """Per bucket id below ``n_buckets``, the maximum and minimum of ``flat`` (``-inf`` and
    ``inf`` for an empty bucket; id ``n_buckets`` is dropped).

    Neighbouring elements mostly share a bucket, so a scatter into one row of slots updates
    the slot its previous element just wrote: element ``i`` goes to row ``i % EXTREME_ROWS``
    instead, and the rows are reduced after (the same maxima and minima, exactly).
    """
    slots = n_buckets + 1
    if flat.size < 4 * EXTREME_ROWS * slots:
        return (jax.ops.segment_max(flat, seg, num_segments=slots)[:-1],
                jax.ops.segment_min(flat, seg, num_segments=slots)[:-1])
    row = jax.lax.iota(jnp.int32, flat.size) % EXTREME_ROWS
    ids = seg.astype(jnp.int32) + row * slots
    top = jax.ops.segment_max(flat, ids, num_segments=EXTREME_ROWS * slots)
    bottom = jax.ops.segment_min(flat, ids, num_segments=EXTREME_ROWS * slots)
    return (top.reshape(EXTREME_ROWS, slots).max(axis=0)[:-1],
            bottom.reshape(EXTREME_ROWS, slots).min(axis=0)[:-1])


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
    # Two scatters of the signed delta over the bucket ids (zeros go to a dropped extra
    # segment): a positive bucket's magnitudes span [min, max] of its deltas, a negative
    # one's [-max, -min]. XLA:CPU materializes a scatter's operands, so both scatters share
    # the delta and the ids (|delta| and an inf-masked copy of it were two more leaf-sized
    # temporaries). A bucket's elements are >= tiny > 0 in magnitude, so it is present
    # exactly when its maximum magnitude is (an empty segment's maximum is -inf).
    seg, n_buckets = segment_ids(flat)
    top_of, bottom_of = _bucket_extremes(flat, seg, n_buckets)
    negative = jnp.arange(n_buckets) % 2 == 1
    max_mag = jnp.where(negative, -bottom_of, top_of)
    min_mag = jnp.where(negative, -top_of, bottom_of)
    dtype = flat.dtype

    present = (max_mag > 0).reshape(-1, 2)  # [exponent, sign]
    per_exponent = present.sum(axis=1)
    from_top = jnp.cumsum(per_exponent[::-1])[::-1]  # buckets with exponent >= e
    keep = present & (from_top <= n_symbols - 1)[:, None]
    if n_symbols <= 2:
        # One symbol besides 0 and both signs at the top exponent: keep the fuller bucket
        # (with more symbols the top exponent's buckets always fit, so keep is never empty).
        top = jnp.max(jnp.where(per_exponent > 0, jnp.arange(per_exponent.shape[0]), -1))
        negatives = jnp.sum((seg == 2 * top + 1).astype(jnp.int32))
        positives = jnp.sum((seg == 2 * top).astype(jnp.int32))
        fuller = jnp.where(negatives > positives, 1, 0)
        fallback = (
            jnp.zeros_like(keep).at[top, fuller].set(True) & present & (top >= 0)
        )
        keep = jnp.where(jnp.any(keep), keep, fallback)
    keep = keep.reshape(-1)

    rank = jnp.cumsum(keep[::-1].astype(jnp.int32))[::-1]  # kept buckets with id >= this one
    symbol_of_bucket = jnp.where(keep, rank, 0)
    midrange = (max_mag + min_mag) * jnp.asarray(0.5, dtype)
    signed = jnp.where(negative, -midrange, midrange)
    reps = jnp.zeros((2**bits,), dtype).at[symbol_of_bucket].max(
        jnp.where(keep, jnp.abs(signed), 0)
    )
    sign_of_symbol = jnp.zeros((2**bits,), jnp.bool_).at[symbol_of_bucket].max(
        keep & negative
    )
    reps = jnp.where(sign_of_symbol, -reps, reps)
    # the dropped segment (zeros) is symbol 0; a uint8 table: no int32 symbol temporary
    # Written by a scatter, so computed once: XLA fuses a computed table into the per-element
    # gather and redoes its arithmetic for every element otherwise.
    table = jnp.zeros((n_buckets + 1,), jnp.uint8).at[jnp.arange(n_buckets)].set(
        symbol_of_bucket.astype(jnp.uint8), unique_indices=True, indices_are_sorted=True
    )
    symbols = table[seg]
    if lift is not None:
        positive_kept = keep & ~negative
        lowest = jnp.argmax(positive_kept)  # smallest exponent first: the lowest kept bucket
        lifted = lift.reshape(-1) & (symbols == 0) & jnp.any(positive_kept)
        symbols = jnp.where(lifted, table[lowest], symbols)
    return symbols.reshape(delta.shape), reps


def dequantize(symbols: jax.Array, reps: jax.Array) -> jax.Array:
    """Decode symbols to their bucket representatives (``reps[symbol]``)."""
    return table_lookup(symbols, reps)


def bucket_table(x: jax.Array) -> dict[str, jax.Array]:
    """Per (sign, exponent) bucket of ``x``: count, sum, sum of squares, max and min magnitude.

    The statistics from which :func:`table_estimate` replays :func:`promote` on the host.
    """
    flat = x.reshape(-1)
    bucket, n_buckets = exponent_buckets(flat)
    seg = jnp.where(bucket < 0, n_buckets, bucket)
    mag = jnp.abs(flat)
    n = n_buckets + 1
    big = jnp.asarray(jnp.inf, mag.dtype)
    return {
        "count": jax.ops.segment_sum(jnp.ones_like(seg), seg, num_segments=n)[:-1],
        "sum": jax.ops.segment_sum(mag, seg, num_segments=n)[:-1],
        "sumsq": jax.ops.segment_sum(jnp.square(mag), seg, num_segments=n)[:-1],
        "max": jax.ops.segment_max(mag, seg, num_segments=n)[:-1],
        "min": jax.ops.segment_min(jnp.where(bucket < 0, big, mag), seg, num_segments=n)[:-1],
    }


def kept_buckets(counts: np.ndarray, bits: int, reserve: int = 0) -> np.ndarray:
    """Which (sign, exponent) buckets :func:`promote` keeps, from the bucket counts (numpy;
    ``reserve`` as in :func:`promote`)."""
    n_symbols = 2**bits - reserve
    present = (counts > 0).reshape(-1, 2)
    per_exponent = present.sum(axis=1)
    from_top = np.cumsum(per_exponent[::-1])[::-1]
    keep = present & (from_top <= n_symbols - 1)[:, None]
    if not keep.any() and present.any():
        top = int(np.max(np.nonzero(per_exponent > 0)[0]))
        c2 = counts.reshape(-1, 2)
        keep[top, 1 if c2[top, 1] > c2[top, 0] else 0] = True
    return keep.reshape(-1)


def table_estimate(table: Mapping[str, np.ndarray], n: int, bits: int) -> tuple[float, float]:
    """``(bits per element, ||error||^2)`` of :func:`promote` on ``n`` elements, from the table.

    The error is computed, not bounded: a dropped bucket contributes its sum of squares, a
    kept bucket with representative ``m = (max + min) / 2`` contributes
    ``sum(x^2) - 2 m sum(x) + count m^2`` (clamped at 0; float32 sums make it accurate to
    about a percent, so a 2% margin is added).
    """
    counts = np.asarray(table["count"], np.int64)
    total = np.asarray(table["sum"], np.float64)
    sumsq = np.asarray(table["sumsq"], np.float64)
    present = counts > 0
    mid = np.where(
        present,
        (np.where(present, np.asarray(table["max"], np.float64), 0)
         + np.where(present, np.asarray(table["min"], np.float64), 0)) / 2,
        0.0,
    )
    keep = kept_buckets(counts, bits)
    kept_err = np.maximum(sumsq - 2 * mid * total + counts * np.square(mid), 0.0)
    err_sq = 1.02 * float(sumsq[~keep].sum() + kept_err[keep].sum())
    symbol_counts = np.append(counts[keep], n - counts[keep].sum())
    return order0_entropy(symbol_counts), err_sq


def promote_bound(
    x: np.ndarray, symbols: np.ndarray, reps: np.ndarray, lifted: np.ndarray | None = None
) -> np.ndarray:
    """Elementwise bound of :func:`promote` on ``x`` (exact arithmetic): a kept element
    decodes within 50% of itself, a dropped one to 0; a lifted one within its representative."""
    x = np.asarray(x, np.float64)
    kept = np.asarray(symbols) > 0
    bound = np.where(kept, 0.5 * np.abs(x), np.abs(x))
    if lifted is not None:
        rep = np.abs(np.asarray(reps, np.float64)[np.asarray(symbols, np.int64)])
        bound = np.where(lifted & kept, np.maximum(bound, rep), bound)
    return bound


@dataclasses.dataclass(frozen=True)
class LC(CodecBase):
    """LC-Checkpoint delta codec with a ``2**bits`` symbol alphabet (zero included)."""

    bits: int = 3
    stats: str = "leaf"
    mode: str = "delta"
    domain: str = "linear"

    codec_id: ClassVar[str] = "lc"
    lossy: ClassVar[bool] = True

    def side_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """Names and shapes of the side arrays (see :meth:`CodecBase.side_shapes`)."""
        if self.domain == "log":
            return {"factor": (2**self.bits,), "born": (1,)}
        return {"rep": (2**self.bits,)}

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
        """A delta (``mode="delta"``) is decoded against the previous reconstruction."""
        return self.mode == "delta"

    def fields(self) -> dict[str, Field]:
        """One uint8 symbol field with an alphabet of ``2**bits`` (Huffman coded on host)."""
        return {"sym": Field.symbols(2**self.bits)}

    def encode(self, value: jax.Array, reference: jax.Array | None) -> Encoded:
        """Quantize ``value`` (or its delta to ``reference``) into kept exponent buckets."""
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
        nonnegative = all_nonnegative(v)
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
        """Log domain: quantize ``log(value / reference)`` (docs/codecs.md)."""
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
        return Encoded(fields, side, self.decode(fields, side, reference, value.dtype))

    def decode(
        self,
        fields: dict[str, jax.Array],
        side: dict[str, jax.Array],
        reference: jax.Array | None,
        dtype: Any,
    ) -> jax.Array:
        """Bucket representatives of the symbols (plus the reference for deltas)."""
        wd = work_dtype(dtype)
        if self.needs_reference and reference is None:
            raise CodecError(f"{self}: a delta needs its reference to decode")
        if self.domain == "log":
            assert reference is not None
            ref = reference.astype(wd)
            scaled = ref * table_lookup(fields["sym"], side["factor"].astype(wd))
            scaled = jnp.minimum(scaled, jnp.asarray(float(jnp.finfo(dtype).max), wd))
            born = fields["sym"] == 2**self.bits - 1
            return jnp.where(born, side["born"].astype(wd)[0], scaled).astype(dtype)
        reps = side["rep"].astype(wd)
        if self.mode == "direct":
            return dequantize(fields["sym"], reps).astype(dtype)
        assert reference is not None
        return (reference.astype(wd) + dequantize(fields["sym"], reps)).astype(dtype)

    # ------------------------------------------------------------------ pricing

    def has_estimate(self, measure: ErrorMeasure) -> bool:
        """An analytic size/error estimate exists for the linear domain and L2 error."""
        return self.domain == "linear" and measure == "l2"

    def estimate(self, stats: Mapping[str, Any], n: int, dtype: np.dtype) -> Estimate:
        """Replays the promotion on the leaf's bucket table (``value_table`` or
        ``delta_table``); error doubled for leaves narrower than float32 (rounding of the
        reconstruction at most doubles it). ``inf`` where the guard would refuse the result."""
        nonnegative = float(stats["value_min"]) >= 0
        if self.mode == "direct":
            if nonnegative:  # pruning a non-negative leaf zeroes positive elements
                return Estimate(8.0, math.inf)
            table = stats["value_table"]
        else:
            table = stats["delta_table"]
            positive_kept = kept_buckets(np.asarray(table["count"]), self.bits).reshape(-1, 2)
            if nonnegative and int(stats["born"]) > 0 and not positive_kept[:, 0].any():
                return Estimate(8.0, math.inf)  # newborn elements would decode to 0
        bpe, err_sq = table_estimate(table, n, self.bits)
        err = (2.0 if np.dtype(dtype).itemsize < 4 else 1.0) * math.sqrt(err_sq)
        norm = math.sqrt(max(float(stats["value_sq"]), 0.0))
        rel = err / norm if norm > 0 else (0.0 if err_sq == 0 else math.inf)
        if not self.needs_reference:
            return Estimate(bpe, rel)
        moved = math.sqrt(max(float(np.sum(table["sumsq"])), 0.0))
        return Estimate(bpe, rel, err / moved if moved > 0 else (0.0 if err_sq == 0 else math.inf))

    # ------------------------------------------------------------------ conformance

    @classmethod
    def examples(cls) -> tuple[LC, ...]:
        """Configurations the conformance suite runs."""
        return (LC(1), LC(3), LC(8), LC(3, mode="direct"), LC(2, domain="log"),
                LC(4, domain="log"))

    def error_bound(
        self, value: np.ndarray, reference: np.ndarray | None, encoded: Encoded
    ) -> np.ndarray:
        """Largest elementwise error the bucket rule allows (checked by the conformance suite)."""
        v = np.asarray(value, np.float64)
        r = np.zeros_like(v) if reference is None else np.asarray(reference, np.float64)
        sym = np.asarray(encoded.fields["sym"])
        if self.domain == "log":
            both = (v > 0) & (r > 0)
            t = np.log(np.where(both, v, 1)) - np.log(np.where(both, r, 1))
            kept = both & (sym > 0) & (sym < 2**self.bits - 1)
            # the log-ratio itself is computed with an error of a few ulps of the logs
            eps = float(jnp.finfo(work_dtype(value.dtype)).eps)
            tol = 4 * eps * (np.abs(np.log(np.where(both, v, 1)))
                             + np.abs(np.log(np.where(both, r, 1))) + 2)
            bound = np.where(kept, v * np.expm1(0.5 * np.abs(t) + tol), np.abs(v - r))
            born = float(np.asarray(encoded.side["born"])[0])
            bound = np.where(sym == 2**self.bits - 1, np.abs(born - v), bound)
        else:
            lifted = (r <= 0) & (v > 0) & bool(np.all(v >= 0)) if self.mode == "delta" else None
            bound = promote_bound(v - r, sym, np.asarray(encoded.side.get("rep", 0)), lifted)
        return rounding_slack(bound, value, encoded.recon, value.dtype)
