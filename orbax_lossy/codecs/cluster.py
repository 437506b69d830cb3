"""``cluster``: 1-D k-means (Lloyd) quantization, BitSnap's choice for optimizer states.

``2**bits - 1`` centroids are fitted on a deterministic strided sample of the value (or of the
delta, ``mode="delta"``; of ``log(value)`` with ``domain="log"``, for Adam's ``nu``); every
element takes its nearest centroid, symbol 0 is reserved for exact zeros; the side
``codebook`` holds the decoded values. Specification: ``docs/codecs.md``.
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

MODES = ("direct", "delta")
DOMAINS = ("linear", "log")


def strided_sample(x: jax.Array, size: int) -> jax.Array:
    """A deterministic strided subsample of the flattened ``x`` (at most ``size`` elements)."""
    flat = x.reshape(-1)
    stride = max(1, -(-flat.shape[0] // size))
    return flat[::stride]


def initial_centroids(xs: jax.Array, n_valid: jax.Array, k: int) -> jax.Array:
    """Sorted initial centroids for the first ``n_valid`` entries of the ascending ``xs``.

    ``k - k // 2`` sit at the sample's ``(i + 1/2)`` quantiles (the dense bulk), ``k // 2`` on
    a uniform grid from the smallest to the largest entry (the tails, which quantiles alone
    leave without a centroid: their elements would then get huge errors).
    """
    kq, ku = k - k // 2, k // 2
    pos = (jnp.arange(kq, dtype=jnp.float32) + 0.5) / kq * n_valid.astype(jnp.float32)
    idx = jnp.clip(jnp.floor(pos).astype(jnp.int32), 0, jnp.maximum(n_valid - 1, 0))
    lo, hi = xs[0], xs[jnp.maximum(n_valid - 1, 0)]
    grid = lo + (hi - lo) * jnp.linspace(0, 1, ku, dtype=xs.dtype) if ku else xs[:0]
    return jnp.sort(jnp.concatenate([xs[idx], grid]))


def midpoints(centroids: jax.Array) -> jax.Array:
    """The decision boundaries between consecutive sorted ``centroids``."""
    return (centroids[1:] + centroids[:-1]) * jnp.asarray(0.5, centroids.dtype)


def lloyd_sorted(xs: jax.Array, n_valid: jax.Array, k: int, iters: int) -> jax.Array:
    """1-D k-means on the first ``n_valid`` entries of the ascending ``xs``; sorted centroids.

    Entries past ``n_valid`` must sort last (``+inf``). Sums per cluster are differences of
    one prefix sum of the (centered) sample, so the fit is deterministic.
    """
    valid = jnp.arange(xs.shape[0]) < n_valid
    center = xs[jnp.maximum(n_valid // 2, 0)]
    centered = jnp.where(valid, xs - center, 0)
    prefix = jnp.concatenate([jnp.zeros((1,), xs.dtype), jnp.cumsum(centered)])
    xs_search = jnp.where(valid, xs, jnp.inf)

    def step(_, c):
        edges = jnp.searchsorted(xs_search, midpoints(c), side="right")
        lo = jnp.concatenate([jnp.zeros((1,), edges.dtype), edges])
        hi = jnp.concatenate([edges, n_valid.reshape(1).astype(edges.dtype)])
        hi = jnp.maximum(hi, lo)
        count = (hi - lo).astype(xs.dtype)
        total = prefix[hi] - prefix[lo]
        mean = total / jnp.maximum(count, 1) + center
        return jnp.sort(jnp.where(count > 0, mean, c))

    c0 = initial_centroids(xs_search, n_valid, k)
    return jax.lax.fori_loop(0, iters, step, c0)


#: up to this many decision boundaries, elements are assigned by counting the boundaries
#: below them (one vectorized pass) instead of a binary search (a loop over the leaf with
#: leaf-sized state on XLA:CPU)
COMPARE_ALL_MAX = 63


def assign(x: jax.Array, centroids: jax.Array) -> jax.Array:
    """Index of the nearest of the sorted ``centroids`` for every element (int32).

    ``searchsorted(midpoints, x, side="left")``. With few boundaries that are sorted in the
    total order ``searchsorted`` uses (always, unless a centroid is not finite), the index is
    the count of boundaries below ``x`` in that order, which is the same number.
    """
    mids = midpoints(centroids)
    search = lambda: jnp.searchsorted(mids, x, side="left").astype(jnp.int32)  # noqa: E731
    if mids.shape[0] > COMPARE_ALL_MAX or mids.shape[0] < 2:
        return search()
    count = lambda: jnp.searchsorted(  # noqa: E731
        mids, x, side="left", method="compare_all").astype(jnp.int32)
    return jax.lax.cond(total_order_ascending(mids), count, search)


def total_order_ascending(a: jax.Array) -> jax.Array:
    """Whether the 1-D float ``a`` has no NaN and is non-decreasing in the total order of
    ``jnp.sort`` (``-0.0`` before ``0.0``): the bits, as sign-magnitude integers."""
    sint = jnp.int64 if a.dtype.itemsize == 8 else jnp.int32
    raw = jax.lax.bitcast_convert_type(a.astype(jnp.promote_types(a.dtype, jnp.float32)), sint)
    key = jnp.where(raw < 0, raw ^ jnp.iinfo(sint).max, raw)  # monotone in the value
    return ~jnp.any(jnp.isnan(a)) & jnp.all(key[1:] >= key[:-1])


def coded_domain(x: jax.Array, domain: str) -> tuple[jax.Array, jax.Array]:
    """``(t, usable)``: the clustered quantity and where it is defined (else symbol 0)."""
    usable = (x > 0) if domain == "log" else (x != 0)
    t = jnp.log(jnp.where(usable, x, 1)) if domain == "log" else x
    return t, usable


def everywhere_usable(x: jax.Array, domain: str) -> jax.Array:
    """Whether every element of ``x`` is usable in ``domain`` (:func:`coded_domain`), as one
    float reduction: ``min(|x|) > 0`` (linear) or ``min(x) > 0`` (log); NaN gives False.

    XLA:CPU vectorizes a plain float minimum (2.5 ms for 22 M float32 elements on the 2-core
    benchmark machine) but not one over a masked operand (``min(where(x != 0, x, inf))``: 33
    ms), nor a reduction of comparisons (``any(x != 0)``: 7.5 ms)."""
    low = jnp.min(jnp.abs(x) if domain == "linear" else x, initial=0.0 if x.size == 0 else None)
    return low > 0


def fit_sample(t: jax.Array, usable: jax.Array, sample: int,
               all_usable: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(values, n_valid)``: what the centroids are fitted to, unsorted: the strided sample
    of ``t`` plus the leaf's extremes (global reductions, so the tails are seen), ``+inf``
    where not usable; and how many of them are usable.

    ``all_usable`` (:func:`everywhere_usable`) selects plain reductions of ``t`` for the
    extremes where every element is usable: the same values, without the masked reductions
    XLA:CPU runs as scalar loops (82-88 -> 22 ms for a 22 M-element leaf)."""
    big = jnp.asarray(jnp.inf, t.dtype)

    def masked() -> tuple[jax.Array, jax.Array, jax.Array]:
        return (jnp.min(jnp.where(usable, t, big), initial=big),
                jnp.max(jnp.where(usable, t, -big), initial=-big), jnp.any(usable))

    def plain() -> tuple[jax.Array, jax.Array, jax.Array]:  # all usable, so not empty
        # (the initial values only let an empty leaf trace this branch; it takes masked())
        return jnp.min(t, initial=big), jnp.max(t, initial=-big), jnp.asarray(True)

    low, high, some = jax.lax.cond(all_usable, plain, masked)
    s_t = jnp.concatenate([strided_sample(t, sample), jnp.stack([low, high])])
    s_ok = jnp.concatenate([strided_sample(usable, sample), some[None].repeat(2)])
    return jnp.where(s_ok, s_t, big), jnp.sum(s_ok.astype(jnp.int32))


def ascending(values: jax.Array) -> jax.Array:
    """``jnp.sort(values)`` along the last axis for floats, as a sort of integer keys.

    XLA:CPU's float sort calls its comparator per comparison (12.7 ms for 65 538 float32
    values on the 2-core benchmark machine); integers sort in 3.1 ms, keys included. Every
    float maps to the integer that orders it (the sign-magnitude bits made two's complement)
    and back. Bit for bit ``jnp.sort``'s result, except that NaNs come out as one canonical
    NaN (both sort them last) and a ``-0.0`` sorts before every ``0.0`` (``jnp.sort`` keeps
    their order): :func:`fit_sample`'s values hold no zero.
    """
    ints = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[values.dtype.itemsize]
    magnitude = jnp.asarray(jnp.iinfo(ints).max, ints)
    shift = jnp.asarray(8 * values.dtype.itemsize - 1, ints)
    bits = jax.lax.bitcast_convert_type(values, ints)
    keys = jnp.where(jnp.isnan(values), magnitude, bits ^ ((bits >> shift) & magnitude))
    keys = jax.lax.sort(keys, is_stable=False)
    return jax.lax.bitcast_convert_type(keys ^ ((keys >> shift) & magnitude), values.dtype)


def centroids_of_sorted(xs: jax.Array, n_valid: jax.Array, k: int, iters: int) -> jax.Array:
    """Sorted ``k`` centroids from :func:`fit_sample`'s values, sorted ascending."""
    centroids = lloyd_sorted(xs, n_valid, k, iters)
    return jnp.where(n_valid > 0, centroids, 0)


def fit_centroids(
    t: jax.Array, usable: jax.Array, k: int, iters: int, sample: int, all_usable: jax.Array
) -> jax.Array:
    """Sorted ``k`` centroids of the usable ``t``: Lloyd on the strided sample + extremes."""
    values, n_valid = fit_sample(t, usable, sample, all_usable)
    return centroids_of_sorted(ascending(values), n_valid, k, iters)


def symbols_of(t: jax.Array, usable: jax.Array, centroids: jax.Array) -> jax.Array:
    """uint8 symbols: 0 where not usable, else 1 + the nearest centroid's index."""
    return jnp.where(usable, assign(t, centroids) + 1, 0).astype(jnp.uint8)


def fit_codebook(
    x: jax.Array, bits: int, domain: str, iters: int, sample: int, dtype: Any
) -> tuple[jax.Array, jax.Array]:
    """``(symbols uint8 shaped like x, codebook [2**bits] of decoded values)`` for ``x``.

    ``x`` is the coded quantity in the work dtype (value or delta); see docs/codecs.md.
    """
    t, usable = coded_domain(x, domain)
    centroids = fit_centroids(t, usable, 2**bits - 1, iters, sample,
                              everywhere_usable(x, domain))
    return symbols_of(t, usable, centroids), codebook_values(centroids, domain, dtype, x.dtype)


def codebook_values(centroids: jax.Array, domain: str, dtype: Any, wd: Any) -> jax.Array:
    """Decoded value of every symbol (``[0] == 0``), clamped to the leaf dtype's finite range."""
    info = jnp.finfo(dtype)
    hi = jnp.asarray(float(info.max), wd)
    if domain == "log":
        vals = jnp.clip(jnp.exp(centroids), jnp.asarray(float(info.tiny), wd), hi)
    else:
        vals = jnp.clip(centroids, -hi, hi)
    return jnp.concatenate([jnp.zeros((1,), wd), vals.astype(wd)])


@dataclasses.dataclass(frozen=True)
class Cluster(CodecBase):
    """k-means quantization with ``2**bits - 1`` centroids plus an exact-zero code."""

    bits: int = 8
    domain: str = "linear"
    mode: str = "direct"
    iters: int = 16
    sample: int = 1 << 16

    codec_id: ClassVar[str] = "cluster"
    lossy: ClassVar[bool] = True

    def side_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """Names and shapes of the side arrays (see :meth:`CodecBase.side_shapes`)."""
        return {"codebook": (2**self.bits,)}

    @property
    def needs_reference(self) -> bool:
        """Only ``mode="delta"`` needs the previous reconstruction."""
        return self.mode == "delta"

    def __post_init__(self) -> None:
        if not isinstance(self.bits, int) or isinstance(self.bits, bool) or not (
            1 <= self.bits <= 8
        ):
            raise CodecError(f"Cluster bits must be an int in 1..8, got {self.bits!r}")
        if self.domain not in DOMAINS:
            raise CodecError(f"Cluster domain must be one of {DOMAINS}, got {self.domain!r}")
        if self.mode not in MODES:
            raise CodecError(f"Cluster mode must be one of {MODES}, got {self.mode!r}")
        if self.domain == "log" and self.mode == "delta":
            raise CodecError("Cluster domain='log' codes values, not deltas (use mode='direct')")
        if not isinstance(self.iters, int) or not 0 <= self.iters <= 1000:
            raise CodecError(f"Cluster iters must be an int in 0..1000, got {self.iters!r}")
        if not isinstance(self.sample, int) or self.sample < 2**self.bits:
            raise CodecError(f"Cluster sample must be an int >= 2**bits, got {self.sample!r}")

    def fields(self) -> dict[str, Field]:
        """One field ``sym``: 0 for exact zeros, else 1 + the nearest centroid's index."""
        return {"sym": Field.symbols(2**self.bits)}

    def _base(self, reference: jax.Array | None, wd: Any) -> jax.Array | None:
        if self.mode == "direct":
            return None
        if reference is None:
            raise CodecError("Cluster mode='delta' needs a reference")
        return reference.astype(wd)

    def encode(self, value: jax.Array, reference: jax.Array | None) -> Encoded:
        """Fit the centroids to the value (or delta) and code every element's nearest."""
        if not jnp.issubdtype(value.dtype, jnp.floating):
            raise CodecError(f"Cluster codes floating-point leaves, got {value.dtype}")
        wd = work_dtype(value.dtype)
        base = self._base(reference, wd)
        x = value.astype(wd) if base is None else value.astype(wd) - base
        symbols, codebook = fit_codebook(
            x, self.bits, self.domain, self.iters, self.sample, value.dtype
        )
        fields, side = {"sym": symbols}, {"codebook": codebook}
        return self.encoded(fields, side, reference, value.dtype)

    def decode(self, fields: Arrays, side: Arrays, reference: jax.Array | None,
               dtype: Any) -> jax.Array:
        """The ``codebook`` value of every symbol (plus the reference in delta mode)."""
        wd = work_dtype(dtype)
        decoded = table_lookup(fields["sym"], side["codebook"].astype(wd))
        base = self._base(reference, wd)
        return (decoded if base is None else base + decoded).astype(dtype)

    @classmethod
    def examples(cls) -> tuple[Cluster, ...]:
        """Direct linear, direct log and delta configurations, kept small for speed."""
        return (Cluster(4, iters=4, sample=512), Cluster(8, domain="log", iters=8, sample=512),
                Cluster(3, mode="delta", iters=4, sample=512))

    def error_bound(
        self, value: np.ndarray, reference: np.ndarray | None, encoded: Encoded
    ) -> np.ndarray:
        """Nearest codeword: no centroid is closer (in the coded domain) than the chosen one."""
        v = np.asarray(value, np.float64)
        base = 0.0 if reference is None else np.asarray(reference, np.float64)
        x = v - base
        book = np.asarray(encoded.side["codebook"], np.float64)[1:]
        if self.domain == "log":
            t = np.log(np.where(x > 0, x, 1))[..., None]
            gap = np.min(np.abs(t - np.log(book)), axis=-1)
            eps = float(np.finfo(np.float32).eps)
            tol = 4 * eps * (np.abs(t[..., 0]) + 1)
            bound = np.where(x > 0, x * np.expm1(gap + tol), np.abs(x))
        else:
            bound = np.where(x != 0, np.min(np.abs(x[..., None] - book), axis=-1), 0)
        return rounding_slack(bound, value, encoded.recon, value.dtype)
