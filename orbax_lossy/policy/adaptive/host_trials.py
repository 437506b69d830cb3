"""Whole-leaf measured trials of :class:`~orbax_lossy.policy.AdaptivePolicy` on the CPU
encode kernels.

Second moments are priced by their elementwise relative error, which a sample cannot see (a
few elements far below their reference dominate it), so their delta candidates are measured
on the whole leaf. As one XLA program per leaf those trials were most of an adaptive save's
cost on CPU: six full LC encodes per second-moment leaf, all live at once (64 MB state: 1.2 s
of a 1.4 s plan, and 1.3 states of extra memory). Where :func:`cpu_encode.host_kernel`
accepts the leaf, each trial here is the save's own encode kernel (LC's widths of one domain
sharing its statistics pass) followed by one numba pass for the norms and the symbol counts,
one kernel kind per core at a time: the same statistics as
:func:`~orbax_lossy.policy.adaptive.statistics.measured_trial`, in float64.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from numba import njit

from orbax_lossy.codecs.base import Codec
from orbax_lossy.codecs.lc import LC
from orbax_lossy.engine import cpu_encode
from orbax_lossy.policy.adaptive.statistics import symbol_alphabets
from orbax_lossy.threads import core_pool


@njit(nogil=True, cache=True, error_model="numpy")
def trial_norms(value, reference, recon, symbols, counts):
    """``(||value||^2, ||recon - value||^2, ||value - reference||^2, sum of squared relative
    errors, elements counted)`` in one pass, and every symbol counted into ``counts`` (256
    zeros); the relative error counts elements that are nonzero in the value and in the
    reference (as ``elementwise_rel_rms`` with ``where=reference != 0``)."""
    value_sq = 0.0
    err_sq = 0.0
    delta_sq = 0.0
    rel_sq = 0.0
    count = 0
    for i in range(value.size):
        v = np.float64(value[i])
        r = np.float64(reference[i])
        e = np.float64(recon[i]) - v
        value_sq += v * v
        err_sq += e * e
        delta_sq += (v - r) * (v - r)
        counted = (v != 0) & (r != 0)
        q = e / (v if counted else 1.0)
        rel_sq += q * q if counted else 0.0
        count += 1 if counted else 0
        counts[symbols[i]] += 1
    return value_sq, err_sq, delta_sq, rel_sq, count


def eligible(codec: Codec, value: Any, reference: Any) -> bool:
    """Whether ``codec``'s whole-leaf trial runs here (a delta codec the kernels encode)."""
    return (codec.needs_reference and reference is not None
            and cpu_encode.host_kernel(value, reference, codec) is not None)


def trial_of(codec: Codec, encoded: dict[str, Any], value: jax.Array,
             reference: jax.Array) -> dict[str, Any]:
    """The elementwise-measure trial (numpy results, keys as ``measured_trial``) from
    ``codec``'s encode of the whole leaf. A leaf the save's guard would store exactly (not
    finite, or a sign the codec breaks) is an unsafe trial."""
    v = np.asarray(value).reshape(-1)
    r = np.asarray(reference).reshape(-1)
    recon = np.asarray(encoded["recon"]).reshape(-1)
    (name, alphabet), = symbol_alphabets(codec).items()  # LC and Step: one symbol field
    counts = np.zeros(256, np.int64)
    value_sq, err_sq, delta_sq, rel_sq, count = trial_norms(
        v, r, recon, encoded["fields"][name].reshape(-1), counts)
    return {
        "value_sq": np.float64(value_sq),
        "err_sq": np.float64(err_sq),
        "delta_sq": np.float64(delta_sq),
        "safe": np.bool_(bool(encoded["safe"])),
        "hist": {name: counts[:alphabet].astype(np.int32)},
        "elem_rel": np.float64(math.sqrt(rel_sq / max(count, 1))),
    }


def _group_trials(codecs: Sequence[Codec], value: jax.Array,
                  reference: jax.Array) -> list[dict[str, Any]]:
    """The trials of codecs of one kernel kind, in order: LC widths share one statistics
    pass (:func:`cpu_encode.encode_lc_widths`)."""
    kind = cpu_encode.host_kernel(value, reference, codecs[0])
    assert kind is not None
    if all(isinstance(c, LC) for c in codecs):
        encoded: Iterator[dict[str, Any]] = cpu_encode.encode_lc_widths(
            value, reference, [c for c in codecs if isinstance(c, LC)], kind)
    else:
        encoded = (cpu_encode.encode(value, reference, c, kind) for c in codecs)
    return [trial_of(c, out, value, reference) for c, out in zip(codecs, encoded, strict=True)]


def whole_leaf_trials(codecs: Sequence[Codec], value: jax.Array,
                      reference: jax.Array) -> list[dict[str, Any]]:
    """The trial of every codec (each :func:`eligible`), in order: codecs of one kernel kind
    together (one statistics pass for LC's widths), the kinds one per core at a time."""
    groups: dict[Any, list[int]] = {}
    for i, c in enumerate(codecs):
        kind = cpu_encode.host_kernel(value, reference, c)
        groups.setdefault(kind if isinstance(c, LC) else (kind, i), []).append(i)
    # their own workers: a trial's kernels may wait on the kernel pool's ranges
    futures = {tuple(members): core_pool("trial").submit(
        _group_trials, [codecs[i] for i in members], value, reference)
        for members in groups.values()}
    out: dict[int, dict[str, Any]] = {}
    for members, future in futures.items():
        out.update(zip(members, future.result(), strict=True))
    return [out[i] for i in range(len(codecs))]
