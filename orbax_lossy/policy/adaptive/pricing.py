"""Host half of :class:`~orbax_lossy.policy.AdaptivePolicy`: price every candidate, pick one.

A codec is priced by its own analytic estimate (``has_estimate``/``estimate``) or, for any
other codec, from its measured trial. The choice is a pure, deterministic function of the
statistics (numpy, fixed tie order), so every process makes the same plan. The rule:
``docs/adaptive.md``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from orbax_lossy.codecs.base import Codec, ErrorMeasure, Estimate, order0_entropy


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A priced codec: estimated bits per element, error relative to the value and, for delta
    codecs, relative to the delta (``progress_error``)."""

    codec: Codec
    bits_per_element: float
    rel_error: float
    progress_error: float = 0.0


def is_analytic(codec: Codec, measure: ErrorMeasure) -> bool:
    """Whether ``codec`` prices itself for ``measure`` (else it is measured)."""
    has_estimate = getattr(codec, "has_estimate", None)
    return has_estimate is not None and bool(has_estimate(measure))


def _ratio(err: float, norm: float) -> float:
    return err / norm if norm > 0 else (0.0 if err == 0 else math.inf)


def measured_estimate(
    codec: Codec,
    trial: Mapping[str, Any],
    stats: Mapping[str, Any],
    dtype: np.dtype,
    measure: ErrorMeasure,
) -> Estimate:
    """Price from a measured trial: order-0 entropy of every symbol field, the raw width of
    any other field; the error in ``measure``; ``inf`` if the guard would refuse the result.
    Errors are relative to the norms of what the trial ran on (its ``value_sq`` and
    ``delta_sq``; else the leaf's ``value_sq`` and ``delta_table``)."""
    hists = trial["hist"]
    bits = sum(order0_entropy(hists[name]) if name in hists else 8.0 * np.dtype(fd).itemsize
               for name, fd in codec.field_dtypes(dtype).items())
    if not bool(trial["safe"]):
        return Estimate(bits, math.inf, math.inf)
    err = math.sqrt(max(float(trial["err_sq"]), 0.0))
    if measure == "elementwise":
        rel = float(trial["elem_rel"])
    else:
        rel = _ratio(err, math.sqrt(max(float(trial.get("value_sq", stats["value_sq"])), 0.0)))
    if not codec.needs_reference:
        return Estimate(bits, rel)
    moved_sq = trial.get("delta_sq")
    if moved_sq is None:
        moved_sq = np.sum(stats["delta_table"]["sumsq"])
    moved = math.sqrt(max(float(moved_sq), 0.0))
    return Estimate(bits, rel, _ratio(err, moved))


def price(
    codecs: Sequence[Codec],
    stats: Mapping[str, Any],
    n: int,
    dtype: np.dtype,
    measure: ErrorMeasure,
) -> list[Candidate]:
    """Every codec priced, in the given order; ``stats["trials"]`` holds, in order, the
    measured trials of the codecs that are not analytic."""
    trials = iter(stats["trials"])
    out = []
    for codec in codecs:
        if is_analytic(codec, measure):
            est = codec.estimate(stats, n, dtype)  # type: ignore[attr-defined]
        else:
            est = measured_estimate(codec, next(trials), stats, dtype, measure)
        out.append(Candidate(codec, *est))
    return out


def choose(
    cands: Sequence[Candidate],
    budget: float,
    lossy_ok: bool,
    slack: float,
    cheap_bits: float,
    progress_budget: float = math.inf,
) -> Codec:
    """Steps 2 and 3 of the rule (docs/adaptive.md): the cheapest lossless candidate unless an
    admissible lossy one is cheaper by more than ``slack``; ties go to the earlier one."""
    lossless = min((c for c in cands if not c.codec.lossy), key=lambda c: c.bits_per_element)
    admissible = [
        c for c in cands
        if c.codec.lossy and lossy_ok and c.rel_error <= budget
        and c.progress_error <= progress_budget
    ] if budget > 0 else []
    if not admissible or lossless.bits_per_element <= cheap_bits:
        return lossless.codec
    lossy = min(admissible, key=lambda c: c.bits_per_element)
    if lossless.bits_per_element <= slack * lossy.bits_per_element:
        return lossless.codec
    return lossy.codec
