"""Device half of :class:`~orbax_lossy.policy.AdaptivePolicy`: one small jitted program per
leaf that reads the leaf (and its reference) once and returns global reductions.

Common statistics feed the codecs' analytic estimates; every candidate without one is
*measured*: its device encode runs in the same program. Keys: ``docs/adaptive.md``.
Everything is a global reduction of an SPMD program, so every process gets the same numbers.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.codecs.base import Codec, ErrorMeasure, sign_safe, work_dtype
from orbax_lossy.codecs.bitmask import as_words
from orbax_lossy.codecs.lc import bucket_table, exponent_buckets


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
    """Run ``codec`` on the leaf: symbol histograms, error, and the handler's guard."""
    ref = reference if codec.needs_reference else None
    enc = codec.device_encode(value, ref)
    wd = work_dtype(value.dtype)
    v, recon = value.astype(wd), enc.recon.astype(wd)
    alphabets = symbol_alphabets(codec)
    out: dict[str, Any] = {
        "err_sq": jnp.sum(jnp.square(recon - v)),
        "safe": jnp.all(jnp.isfinite(recon)) & sign_safe(value, enc.recon),
        "hist": {k: symbol_histogram(enc.fields[k], a) for k, a in alphabets.items()},
    }
    if measure == "elementwise":
        # elements that are 0 in the reference are left out: delta codecs store elements
        # born since the reference over-estimated on purpose (see docs/codecs.md, LC)
        where = None if ref is None else ref.astype(wd) != 0
        out["elem_rel"] = elementwise_rel_rms(v, recon, where)
    return out


@functools.partial(jax.jit, static_argnames=("measured", "measure"))
def leaf_statistics(
    value: jax.Array,
    reference: jax.Array | None,
    *,
    measured: tuple[Codec, ...] = (),
    measure: ErrorMeasure = "l2",
) -> dict[str, Any]:
    """Statistics of one float leaf, against its reference where it has one (a delta save).

    ``measured``: codecs run in full on the leaf (``"trials"``, in that order).
    """
    wd = work_dtype(value.dtype)
    v = value.astype(wd)
    finite = jnp.all(jnp.isfinite(v))
    if reference is not None:
        reference = reference.astype(value.dtype)
        finite &= jnp.all(jnp.isfinite(reference.astype(wd)))
    clean = jnp.where(finite, v, 0)
    st: dict[str, Any] = {
        "finite": finite,
        "value_sq": jnp.sum(jnp.square(clean)),
        "value_min": jnp.min(clean, initial=0),
        "value_hist": value_histogram(clean),
        "value_table": bucket_table(clean),
    }
    if reference is not None:
        r = reference.astype(wd)
        xor = (as_words(value) ^ as_words(reference)).reshape(-1)
        st["changed"] = jnp.sum((xor != 0).astype(jnp.int32))
        st["plane_nonzero"] = jnp.stack([
            jnp.sum((((xor >> (8 * j)) & 0xFF) != 0).astype(jnp.int32))
            for j in range(np.dtype(value.dtype).itemsize)
        ])
        st["delta_table"] = bucket_table(jnp.where(finite, v - r, 0))
        # positive now, <= 0 in the reference: LC must lift these into a kept positive
        # bucket (see docs/codecs.md), so it needs one
        st["born"] = jnp.sum(((r <= 0) & (v > 0)).astype(jnp.int32))
    safe_value = jnp.where(finite, value, jnp.zeros_like(value))
    st["trials"] = [measured_trial(c, safe_value, reference, measure) for c in measured]
    return st


def to_host(tree: Any) -> Any:
    """Fetch replicated statistics (identical on every process) to numpy."""

    def fetch(x: jax.Array) -> np.ndarray:
        if x.is_fully_addressable:
            return np.asarray(x)
        return np.asarray(x.addressable_data(0))

    return jax.tree_util.tree_map(fetch, tree)
