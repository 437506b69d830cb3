"""Device half of :class:`~orbax_lossy.policy.AdaptivePolicy`: one small jitted program per
leaf shape that reads the leaf (and its reference) once and returns global reductions.

A leaf with more than ``sample`` elements is priced on a deterministic strided sample of its
flattened global array (:func:`sample_stride`: the same positions on every process), so the
plan's cost does not grow with the leaf. What a sample can miss (a non-finite element, a
newborn second-moment element) the save program's guard still catches on the whole leaf.
Common statistics feed the codecs' analytic estimates; every candidate without one is
*measured*: its device encode runs on the sample in the same program. Keys:
``docs/adaptive.md``. Everything is a global reduction of an SPMD program, so every process
gets the same numbers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.codecs.base import Codec, ErrorMeasure, sign_safe, work_dtype
from orbax_lossy.codecs.bitmask import as_words
from orbax_lossy.codecs.lc import bucket_table, exponent_buckets

#: Statistics and trials read at most this many elements of a leaf (a strided sample of
#: bigger leaves): bits per element and relative errors are intensive, so a sample of 2**16
#: elements prices them to a fraction of a percent, at a cost independent of the leaf's size.
DEFAULT_SAMPLE = 1 << 16

#: Measured trials (each a full device encode: Cluster sorts its input for k-means) read a
#: smaller strided sample of at most this many elements.
DEFAULT_TRIAL_SAMPLE = 1 << 13


def sample_stride(n: int, sample: int) -> int:
    """Stride of the sample of a leaf of ``n`` elements: 1 (the whole leaf) if ``n <= sample``
    or ``sample <= 0``; else the smallest stride ``>= ceil(n / sample)`` that is coprime with
    ``n``, so the sample's positions fall on every residue of every trailing dimension (each
    column of a matrix, each position of a head) instead of aliasing with the layout."""
    if sample <= 0 or n <= sample:
        return 1
    stride = -(-n // sample)
    while math.gcd(stride, n) != 1:
        stride += 1
    return stride


def sample_size(n: int, sample: int) -> int:
    """Elements in the sample of a leaf of ``n`` elements (:func:`sample_stride`)."""
    return -(-n // sample_stride(n, sample))


def strided(x: jax.Array, stride: int) -> jax.Array:
    """The flattened ``x`` at positions ``0, stride, 2 * stride, ...`` (global positions)."""
    flat = x.reshape(-1)
    return flat if stride == 1 else flat[::stride]


def value_histogram(value: jax.Array) -> jax.Array:
    """Counts of the (sign, exponent) buckets of ``value``, zeros in the last bin."""
    bucket, n_buckets = exponent_buckets(value.reshape(-1))
    seg = jnp.where(bucket < 0, n_buckets, bucket)
    return jax.ops.segment_sum(jnp.ones_like(seg), seg, num_segments=n_buckets + 1)


def elementwise_rel_rms(
    value: jax.Array, recon: jax.Array, where: jax.Array | None = None
) -> jax.Array:
    """RMS over the non-zero elements (within ``where``) of ``(recon - value) / value``.

    The error measure of second moments: Adam scales each element's step by
    ``1 / sqrt(nu)``, so what matters is every element's relative error, which an L2 error
    relative to the whole leaf (dominated by its largest elements) does not see. 0 if no
    element counts.
    """
    nonzero = value != 0 if where is None else (value != 0) & where
    rel = jnp.where(nonzero, (recon - value) / jnp.where(nonzero, value, 1), 0)
    count = jnp.maximum(jnp.sum(nonzero.astype(jnp.float32)), 1)
    return jnp.sqrt(jnp.sum(jnp.square(rel)) / count)


def symbol_histogram(symbols: jax.Array, alphabet: int) -> jax.Array:
    """Count of every symbol below ``alphabet`` (int32, shape ``[alphabet]``)."""
    return jnp.zeros((alphabet,), jnp.int32).at[symbols.reshape(-1).astype(jnp.int32)].add(1)


def symbol_alphabets(codec: Codec) -> dict[str, int]:
    """Alphabet of every symbol field the codec declares (none for a codec without
    ``fields()``; its fields are then priced at their raw width)."""
    declared = getattr(codec, "fields", None)
    if declared is None:
        return {}
    return {name: f.alphabet for name, f in declared().items() if f.coder == "symbols"}


def measured_trial(
    codec: Codec, value: jax.Array, reference: jax.Array | None, measure: ErrorMeasure
) -> dict[str, Any]:
    """Run ``codec`` on the leaf (or a sample): symbol histograms, error, and the handler's
    guard; ``value_sq`` and ``delta_sq``, the norms its errors are relative to."""
    ref = reference if codec.needs_reference else None
    enc = codec.device_encode(value, ref)
    wd = work_dtype(value.dtype)
    v, recon = value.astype(wd), enc.recon.astype(wd)
    alphabets = symbol_alphabets(codec)
    out: dict[str, Any] = {
        "value_sq": jnp.sum(jnp.square(v)),
        "err_sq": jnp.sum(jnp.square(recon - v)),
        "safe": jnp.all(jnp.isfinite(recon)) & sign_safe(value, enc.recon),
        "hist": {k: symbol_histogram(enc.fields[k], a) for k, a in alphabets.items()},
    }
    if ref is not None:
        out["delta_sq"] = jnp.sum(jnp.square(v - ref.astype(wd)))
    if measure == "elementwise":
        # elements that are 0 in the reference are left out: delta codecs store elements
        # born since the reference over-estimated on purpose (see docs/codecs.md, LC)
        where = None if ref is None else ref.astype(wd) != 0
        out["elem_rel"] = elementwise_rel_rms(v, recon, where)
    return out


def largest(high: jax.Array, low: jax.Array) -> jax.Array:
    """``[largest positive element, largest magnitude of a negative one]`` (0 where none) of
    an array whose maximum is ``high`` and minimum ``low`` (plain reductions: a masked one is
    several times slower on XLA:CPU)."""
    zero = jnp.zeros((), high.dtype)
    return jnp.stack([jnp.maximum(high, zero), jnp.maximum(-low, zero)])


def _leaf_sample(
    value: jax.Array, reference: jax.Array | None, *, sample: int, trial_sample: int,
    extremes: bool = True,
) -> dict[str, Any]:
    """The strided samples of a leaf (first program of :func:`leaf_statistics`, one per leaf
    shape): ``value``/``reference`` at the positions :func:`sample_stride` gives for
    ``sample``, ``trial_value``/``trial_reference`` for ``trial_sample``. Positions in the
    flattened global array: the same on every process.

    A sampled leaf is also read once in full, in fused max-reductions (no leaf-sized
    temporaries): ``top``, the :func:`largest` elements of the value and of the delta (LC keeps
    the largest buckets, and a sample rarely holds the few elements above its own largest);
    and (``extremes``: there are measured trials) what the trial sample gets appended:
    ``direct_extremes``, the leaf's largest, smallest and smallest positive values (for direct
    codecs, which fit their range to them: Cluster's k-means does), and on delta saves
    ``delta_extremes``, two (value, reference) pairs carrying the leaf's largest and smallest
    delta (for delta codecs, which keep their largest buckets).
    """
    n = math.prod(value.shape)
    wd = work_dtype(value.dtype)
    if reference is not None:
        reference = reference.astype(value.dtype)
    out: dict[str, Any] = {}
    for prefix, size in (("", sample), ("trial_", trial_sample)):
        stride = sample_stride(n, size)
        out[prefix + "value"] = strided(value, stride)
        out[prefix + "reference"] = None if reference is None else strided(reference, stride)
    v = value.reshape(-1).astype(wd)
    big = jnp.asarray(jnp.inf, wd)
    high, low = jnp.max(v, initial=-big), jnp.min(v, initial=big)
    if sample_stride(n, sample) > 1:
        out["top"] = {"value": largest(high, low)}
        if reference is not None:
            d = v - reference.reshape(-1).astype(wd)
            out["top"]["delta"] = largest(jnp.max(d, initial=-big), jnp.min(d, initial=big))
    if extremes and sample_stride(n, trial_sample) > 1:
        # appended to the trial sample: a sample rarely holds the extremes a codec fits to
        smallest = jnp.min(jnp.where(v > 0, v, big), initial=big)
        ext = jnp.stack([high, low, smallest])
        out["direct_extremes"] = jnp.where(jnp.isfinite(ext), ext, 0).astype(value.dtype)
        if reference is not None:
            d = v - reference.reshape(-1).astype(wd)
            top_v = jnp.maximum(high, 0)
            up, down = jnp.max(d, initial=-big), jnp.min(d, initial=big)
            pairs = jnp.stack([jnp.stack([top_v + jnp.maximum(up, 0), top_v]),
                               jnp.stack([top_v, top_v - jnp.minimum(down, 0)])])
            pairs = jnp.where(jnp.isfinite(pairs), pairs, 0).astype(value.dtype)
            out["delta_extremes"] = pairs  # [pair, (value, reference)]
    return out


def with_top(table: Mapping[str, Any], top: Any, dtype: Any, scale: int) -> dict[str, Any]:
    """``table`` (a fetched bucket table of a sample) in units of the whole leaf (counts and
    sums times ``scale``, the stride) with the buckets the leaf has above the sample's
    largest, per sign: every exponent from the sample's largest up to the leaf's
    (:func:`largest`) is taken as holding one element of representative magnitude
    ``0.75 * 2**e`` (the largest magnitude itself in the top bucket), so that LC's kept
    buckets replay as on the whole leaf. Host side, numpy."""
    info = np.finfo(dtype)
    lo = int(info.minexp) - int(info.nmant) + 1
    out: dict[str, Any] = {k: np.array(v, np.float64) for k, v in table.items()}
    out["count"] = np.asarray(table["count"], np.int64) * scale
    out["sum"] *= scale
    out["sumsq"] *= scale
    count = out["count"].reshape(-1, 2)
    for sign in (0, 1):
        t = float(top[sign])
        if not (t > 0 and math.isfinite(t)):
            continue
        e_top = int(np.frexp(t)[1])
        present = np.nonzero(count[:, sign] > 0)[0]
        e_from = int(present[-1]) + lo + 1 if present.size else e_top
        for e in range(e_from, e_top + 1):
            b = 2 * (e - lo) + sign
            if 0 <= b < out["count"].shape[0] and out["count"][b] == 0:
                rep = t if e == e_top else 0.75 * 2.0**e
                out["count"][b] = 1
                out["sum"][b], out["sumsq"][b] = rep, rep * rep
                out["max"][b] = out["min"][b] = rep
    return out


@functools.partial(jax.jit, static_argnames=("measured", "measure"))
def sample_statistics(
    samples: dict[str, Any], whole: tuple[jax.Array, jax.Array] | None = None, *,
    measured: tuple[Codec, ...], measure: ErrorMeasure
) -> dict[str, Any]:
    """Statistics of the samples :func:`leaf_sample` took (second program of
    :func:`leaf_statistics`, one per sample length: its cost does not grow with the leaf)."""
    sv, sref = samples["value"], samples["reference"]
    wd = work_dtype(sv.dtype)
    v = sv.astype(wd)
    finite = jnp.all(jnp.isfinite(v))
    if sref is not None:
        finite &= jnp.all(jnp.isfinite(sref.astype(wd)))
    clean = jnp.where(finite, v, 0)
    st: dict[str, Any] = {"finite": finite, "value_min": jnp.min(clean, initial=0)}
    if "top" in samples:
        st["top"] = samples["top"]
    if sref is not None:
        # positive now, <= 0 in the reference: LC must lift these into a kept positive
        # bucket (see docs/codecs.md), so it needs one
        st["born"] = jnp.sum(((sref.astype(wd) <= 0) & (v > 0)).astype(jnp.int32))
    st.update({
        "value_sq": jnp.sum(jnp.square(clean)),
        "value_hist": value_histogram(clean),
        "value_table": bucket_table(clean),
    })
    if sref is not None:
        r = sref.astype(wd)
        xor = as_words(sv) ^ as_words(sref)
        st["changed"] = jnp.sum((xor != 0).astype(jnp.int32))
        st["plane_nonzero"] = jnp.stack([
            jnp.sum((((xor >> (8 * j)) & 0xFF) != 0).astype(jnp.int32))
            for j in range(np.dtype(sv.dtype).itemsize)
        ])
        st["delta_table"] = bucket_table(jnp.where(finite, v - r, 0))
    st["trials"] = []
    if not measured:
        return st
    tv, tref = samples["trial_value"], samples["trial_reference"]
    safe_value = jnp.where(finite, tv, jnp.zeros_like(tv))
    trials = []
    for c in measured:
        cv, cref = safe_value, tref
        if c.needs_reference and whole is not None:
            # the elementwise error of a delta codec is dominated by rare elements (a value
            # far below its reference) that no sample holds: measured on the whole leaf
            wv = whole[0].reshape(-1)
            cv = jnp.where(finite & jnp.all(jnp.isfinite(wv)), wv, jnp.zeros_like(wv))
            cref = whole[1].reshape(-1).astype(wv.dtype)
        elif c.needs_reference and "delta_extremes" in samples:
            pairs = jnp.where(finite, samples["delta_extremes"], 0)
            cv = jnp.concatenate([cv, pairs[:, 0]])
            cref = jnp.concatenate([tref, pairs[:, 1]])
        elif "direct_extremes" in samples:
            ext = jnp.where(finite, samples["direct_extremes"], 0)
            cv = jnp.concatenate([cv, ext])
            cref = None if tref is None else jnp.concatenate([tref, ext])
        trials.append(measured_trial(c, cv, cref, measure))
    st["trials"] = trials
    return st


def leaf_statistics(
    value: jax.Array,
    reference: jax.Array | None,
    *,
    measured: tuple[Codec, ...] = (),
    measure: ErrorMeasure = "l2",
    sample: int = DEFAULT_SAMPLE,
    trial_sample: int = DEFAULT_TRIAL_SAMPLE,
) -> dict[str, Any]:
    """Statistics of one float leaf, against its reference where it has one (a delta save).

    ``measured``: codecs run in full on the trial sample (``"trials"``, in that order).
    ``sample``: at most this many elements are read (:func:`sample_stride`; ``<= 0``: the whole
    leaf); every statistic is the sample's (:func:`sample_size` elements).
    ``trial_sample``: the same for the measured trials (each returns the norms of what it
    ran on).

    Two programs, dispatched without waiting: :func:`leaf_sample` and
    :func:`sample_statistics` (a strided read of the whole leaf fused into every consumer of
    the sample made a single program ~10x slower on XLA:CPU).
    """
    samples = leaf_sample(value, reference, sample=sample, trial_sample=trial_sample,
                          extremes=bool(measured))
    whole = None
    on_host: dict[int, dict[str, Any]] = {}
    if (reference is not None and measure == "elementwise"
            and any(c.needs_reference for c in measured)
            and sample_stride(math.prod(value.shape), trial_sample) > 1):
        # the whole-leaf trials run on the CPU encode kernels where they can (host_trials.py)
        from orbax_lossy.policy.adaptive import host_trials  # (it imports this module)

        chosen = [i for i, c in enumerate(measured) if host_trials.eligible(c, value, reference)]
        on_host = dict(zip(chosen, host_trials.whole_leaf_trials(
            [measured[i] for i in chosen], value, reference), strict=True))
        if any(c.needs_reference for i, c in enumerate(measured) if i not in on_host):
            whole = (value, reference)
    stats = sample_statistics(samples, whole, measured=tuple(
        c for i, c in enumerate(measured) if i not in on_host), measure=measure)
    if on_host:  # the trials in the order of ``measured``
        on_device = iter(stats["trials"])
        stats = {**stats, "trials": [on_host[i] if i in on_host else next(on_device)
                                     for i in range(len(measured))]}
    return stats


@functools.cache
def _sampler(replicated: jax.sharding.Sharding | None) -> Any:
    return jax.jit(_leaf_sample, static_argnames=("sample", "trial_sample", "extremes"),
                   out_shardings=replicated)


def leaf_sample(
    value: jax.Array, reference: jax.Array | None, *, sample: int, trial_sample: int,
    extremes: bool = True,
) -> dict[str, Any]:
    """:func:`_leaf_sample`, its samples replicated on the leaf's devices (small; the
    statistics program then runs on whole samples, not on shards of them)."""
    sharding = getattr(value, "sharding", None)
    replicated = None
    if sharding is not None and len(sharding.device_set) > 1:
        devices = sorted(sharding.device_set, key=lambda d: d.id)
        replicated = jax.sharding.NamedSharding(
            jax.sharding.Mesh(np.array(devices), ("d",)), jax.sharding.PartitionSpec())
    return _sampler(replicated)(value, reference, sample=sample, trial_sample=trial_sample,
                                extremes=extremes)


#: statistics that are counts or sums over the sample (scaled to the leaf by :func:`completed`)
EXTENSIVE = ("value_sq", "value_hist", "changed", "plane_nonzero", "born")


def completed(
    stats: Mapping[str, Any], dtype: Any, n: int, sample: int
) -> tuple[Mapping[str, Any], int]:
    """``(statistics, elements)`` to price a leaf of ``n`` elements with.

    For a sampled leaf, the fetched sample statistics in units of the leaf: counts and sums
    times the stride, priced on ``stride * sample_size`` elements (intensive results are
    unchanged), with the leaf's largest buckets merged into the bucket tables
    (:func:`with_top`), each as one element of the leaf. Unchanged for a leaf read whole.
    """
    top = stats.get("top")
    if not top or not bool(stats["finite"]):
        return stats, sample_size(n, sample)
    stride = sample_stride(n, sample)
    wd = work_dtype(dtype)
    out = dict(stats)
    for key in EXTENSIVE:
        if key in stats:
            x = np.asarray(stats[key])
            out[key] = x * (stride if np.issubdtype(x.dtype, np.integer) else float(stride))
    out["value_table"] = with_top(stats["value_table"], top["value"], wd, stride)
    if "delta" in top:
        out["delta_table"] = with_top(stats["delta_table"], top["delta"], wd, stride)
    return out, stride * sample_size(n, sample)


def to_host(tree: Any) -> Any:
    """Fetch replicated statistics (identical on every process) to numpy."""

    def fetch(x: jax.Array | np.ndarray | np.generic) -> np.ndarray:
        if not isinstance(x, jax.Array):  # computed on the host (whole-leaf trials)
            return np.asarray(x)
        if x.is_fully_addressable:
            return np.asarray(x)
        return np.asarray(x.addressable_data(0))

    return jax.tree_util.tree_map(fetch, tree)
