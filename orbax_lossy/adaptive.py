"""``AdaptivePolicy``: a per-leaf, per-save codec choice from measured statistics (BitSnap).

On every save, one small jitted program per leaf shape (:func:`leaf_statistics`) reads the
float leaves (and, on delta saves, their references) once and returns, per leaf, a handful of
global reductions:

* ``finite``: value (and reference) are finite; ``value_sq`` = ||value||^2, ``value_min``
  (clamped at 0: only its sign is used);
* ``value_hist``: histogram of the values' (sign, exponent) buckets (entropy of exponents);
* ``lc_direct``: the LC bucket table of the value (count, sum, sum of squares, max and min
  magnitude per (sign, exponent) bucket);
* for each cluster candidate: the k-means centroids the codec would fit (same function, same
  sample), the squared error and the symbol histogram on the strided sample;
* on delta saves also ``changed`` (elements that differ bitwise from the reference),
  ``plane_nonzero[j]`` (non-zero bytes of plane ``j`` of ``value XOR reference``), ``lc``
  (the bucket table of the delta) and ``born`` (elements positive now, ``<= 0`` in the
  reference).

Statistics are global reductions computed by SPMD programs, so every process receives the
same numbers; the rule below is a pure, deterministic function of them (numpy on the host, no
randomness, fixed tie-break order), so every process makes the same plan.

Which leaves are priced: integer, bool and PRNG-key leaves are always exact; a leaf whose
statistics are not finite is exact. On a **delta** save every float leaf with a reference is
priced. On a **base** save only optimizer leaves (``first_moment``, ``second_moment``,
``optimizer``) with a non-zero budget are priced, against direct codecs only; parameters stay
lossless on bases (the chain's anchor).

1. Price every candidate in estimated bits per element and compute or estimate its relative
   error ``||recon - value|| / ||value||`` (the handler's ``rel_error``):

   * ``exact`` (:class:`~orbax_lossy.codecs.exact.Exact`): ``H(sign, exponent) + mantissa
     bits``, error 0;
   * ``bitmask`` (:class:`~orbax_lossy.codecs.bitmask.Bitmask`, exact; delta saves):
     ``H2(p) + sum_j (H2(q_j) + 8 q_j)`` with ``p`` the changed fraction and ``q_j`` the
     non-zero fraction of XOR byte plane ``j``; error 0;
   * ``lc`` (:class:`~orbax_lossy.codecs.lc.LC`, each ``bits`` in ``lc_bits``; delta saves;
     for a non-negative leaf with ``born > 0`` only when a positive bucket is kept, into which
     LC lifts the newborn elements): the order-0 entropy of the symbols the promotion would
     produce (replayed on the bucket table) and its error computed from per-bucket sums
     (dropped buckets contribute their sum of squares, a kept bucket ``sum (x - m)^2`` with
     its midrange ``m``), times 2 for leaves narrower than float32 (rounding of the
     reconstruction to the leaf dtype at most doubles the error); for second moments the
     elementwise error (below), measured by running the codec in the statistics program;
   * ``lc direct`` (``LC(bits, mode="direct")``; ``first_moment`` and ``optimizer`` leaves
     with negative elements): the same on the ``lc_direct`` table (magnitude pruning);
   * ``cluster`` (:class:`~orbax_lossy.codecs.cluster.Cluster`, direct, each ``bits`` in
     ``cluster_bits``; only for optimizer moments, ``domain="log"`` for ``second_moment``
     leaves whose minimum is >= 0, linear otherwise): entropy and error measured on the
     strided sample with the exact centroids the codec will use (an estimate, not a bound).

   For ``second_moment`` leaves the error compared with the budget is the RMS of the
   elementwise relative errors ``(recon - value) / value`` over positive elements, and their
   delta candidates are ``LC(b)`` and ``LC(b, domain="log")`` for ``b`` in ``lc_bits`` up to
   4, run in full in the statistics program: bits are the entropy of their actual symbols,
   and a candidate the handler's guard would refuse is dropped.

2. A lossy candidate is admissible when its error is at most the role's budget
   (``budgets``; a role without a budget, or with 0, is lossless only), a delta codec's error
   relative to the delta ``||value - reference||`` is at most the role's progress budget
   (``progress_budgets``; by default 0.5 for parameters: a save may get at most half of the
   update since the previous checkpoint wrong), and the leaf has at least ``min_size``
   elements.
3. Let ``L`` be the cheaper lossless candidate (exact vs bitmask) and ``Y`` the cheapest
   admissible lossy one. Pick ``L`` if it costs at most ``cheap_lossless_bits`` per element
   (lossless is already cheap: BitSnap's sparse-update regime, no reason to lose anything)
   or at most ``lossless_slack * cost(Y)``; otherwise pick ``Y``.
   Ties go to the earlier candidate in the order exact, bitmask, lc (fewer bits first),
   lc direct, cluster (fewer bits first).

Whatever is picked, the handler's guard (:func:`orbax_lossy.program.encode_tree`) still
stores a leaf exactly for that save if its reconstruction is not finite or breaks the sign of
a non-negative leaf.

This is stage-aware in BitSnap's sense without a schedule: early in training deltas are large
(LC's error exceeds the budget, every bf16 element changes) and moments are stored exactly or
clustered; later most bf16 weights stop changing bitwise between saves (bitmask) and float32
deltas shrink (LC). The realized error is recorded per leaf in the manifest (``rel_error``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.codecs import cluster as cl
from orbax_lossy.codecs.base import Codec
from orbax_lossy.codecs.bitmask import Bitmask, as_words
from orbax_lossy.codecs.cluster import Cluster
from orbax_lossy.codecs.exact import Exact
from orbax_lossy.codecs.lc import LC, exponent_buckets, work_dtype
from orbax_lossy.errors import InvalidArgumentError
from orbax_lossy.policy import ROLES, leaf_role
from orbax_lossy.engine.device import sign_safe
from orbax_lossy.treepaths import StoredPath

#: Default error budgets per role, from resume experiments (``benchmarks/whole_state.py``:
#: AdamW, failure at 60% of training, resume from the lossy checkpoint, final eval loss).
#: ``param`` and ``first_moment``: ``||recon - value|| / ||value||``; ``second_moment``: the RMS
#: of the elementwise relative errors (Adam scales each element's step by ``1/sqrt(nu)``; an
#: L2 budget of 0.1 let ``LC(2)`` freeze the small elements of the digits MLP's ``nu`` and moved
#: its final loss by -3.2%; at 0.2 elementwise it moved +0.35%). Adam's first moment is an EMA
#: (beta1 = 0.9) whose error decays by 0.9 per step after a resume; zeroing it moved the final
#: loss by +0.13% (transformer) and +0.55% (digits); a budget above 1 would admit
#: reconstructions worse than zeros, so it stops at 1 (``LC(2, mode="direct")``, about 0.9).
#: Parameters are limited mostly by the progress budget (``DEFAULT_PROGRESS_BUDGETS``).
DEFAULT_BUDGETS: Mapping[str, float] = {
    "param": 5e-2,
    "first_moment": 1.0,
    "second_moment": 2e-1,
    "optimizer": 0.0,
}

#: Default *progress* budgets: the largest ``||recon - value|| / ||value - reference||`` (the
#: share of the update since the previous checkpoint that a delta codec may get wrong).
#: A value-relative budget alone does not scale with the training stage: late in training an
#: error of a few percent of the weights is many saves' worth of updates. LC's within-bucket
#: error floor is about 0.22 (one representative per octave), ``LC(3)`` measures 0.4-0.7 and
#: ``LC(2)`` 0.9-1.0 on the benchmark's runs; at 0.5, the digits MLP (whose final loss moved
#: +1.2% with ``LC(3)``'s 0.67) gets ``LC(4)`` and the char transformer mostly ``LC(3)``.
DEFAULT_PROGRESS_BUDGETS: Mapping[str, float] = {"param": 0.5}

# Cluster candidate of one leaf for the statistics program: (bits, domain).
ClusterTrial = tuple[int, str]

#: Roles priced with ``LC(mode="direct")`` (magnitude pruning of a signed value). Never a
#: parameter (pruning small weights is not a small error in what the model computes) nor a
#: second moment (non-negative: pruning to 0 is refused by the handler's guard).
DIRECT_LC_ROLES = ("first_moment", "optimizer")

#: Roles a base save may store lossily (with a direct codec, under the role's budget).
#: Parameters stay lossless on bases: a base anchors the chain, and no direct codec prices a
#: parameter within a useful budget.
LOSSY_BASE_ROLES = ("first_moment", "second_moment", "optimizer")


# --------------------------------------------------------------------------- device statistics


def _bucket_table(delta: jax.Array) -> dict[str, jax.Array]:
    """LC bucket table of ``delta``: count, sum, sum of squares, max and min magnitude."""
    flat = delta.reshape(-1)
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


def _value_histogram(value: jax.Array) -> jax.Array:
    """Counts of the (sign, exponent) buckets of ``value``, zeros in the last bin."""
    bucket, n_buckets = exponent_buckets(value.reshape(-1))
    seg = jnp.where(bucket < 0, n_buckets, bucket)
    return jax.ops.segment_sum(jnp.ones_like(seg), seg, num_segments=n_buckets + 1)


def _cluster_trial(
    value: jax.Array, bits: int, domain: str, iters: int, sample: int
) -> dict[str, jax.Array]:
    """Sample squared error, sample value norm and symbol histogram of a Cluster fit."""
    wd = work_dtype(value.dtype)
    x = value.astype(wd)
    t, usable = cl.coded_domain(x, domain)
    centroids = cl.fit_centroids(t, usable, 2**bits - 1, iters, sample)
    book = cl.codebook_values(centroids, domain, value.dtype, wd)
    s_x = cl.strided_sample(x, sample)
    s_t, s_ok = cl.coded_domain(s_x, domain)
    sym = cl.symbols_of(s_t, s_ok, centroids)
    recon = book[sym.astype(jnp.int32)].astype(value.dtype).astype(wd)
    return {
        "err_sq": jnp.sum(jnp.square(recon - s_x)),
        "val_sq": jnp.sum(jnp.square(s_x)),
        "hist": jnp.zeros((2**bits,), jnp.int32).at[sym.astype(jnp.int32)].add(1),
        "elem_rel": _elementwise_rel_rms(s_x, recon),
    }


def _elementwise_rel_rms(
    value: jax.Array, recon: jax.Array, where: jax.Array | None = None
) -> jax.Array:
    """RMS over the positive elements (within ``where``) of ``(recon - value) / value``.

    The error measure of second moments: Adam scales each element's step by
    ``1 / sqrt(nu)``, so what matters is every element's relative error, which an L2 error
    relative to the whole leaf (dominated by its largest elements) does not see. 0 if no
    element counts.
    """
    pos = value > 0 if where is None else (value > 0) & where
    rel = jnp.where(pos, (recon - value) / jnp.where(pos, value, 1), 0)
    count = jnp.maximum(jnp.sum(pos.astype(jnp.float32)), 1)
    return jnp.sqrt(jnp.sum(jnp.square(rel)) / count)


def _codec_trial(codec: LC, value: jax.Array, ref: jax.Array) -> dict[str, jax.Array]:
    """Run ``codec`` in full: symbol histogram, elementwise error, and the handler's guard."""
    enc = codec.device_encode(value, ref)
    recon = enc.recon
    wd = work_dtype(value.dtype)
    sym = enc.fields["sym"].reshape(-1).astype(jnp.int32)
    # Newborn elements (positive now, <= 0 in the reference) are left out: every LC variant
    # stores them over-estimated on purpose (a smaller step; see orbax_lossy.codecs.lc), and
    # one over-estimated tiny element would otherwise dominate the RMS.
    return {
        "hist": jnp.zeros((2**codec.bits,), jnp.int32).at[sym].add(1),
        "elem_rel": _elementwise_rel_rms(value.astype(wd), recon.astype(wd), ref > 0),
        "safe": jnp.all(jnp.isfinite(recon)) & sign_safe(value, recon),
    }


@functools.partial(jax.jit, static_argnames=("trials", "iters", "sample", "codec_trials"))
def leaf_statistics(
    values: Sequence[jax.Array],
    references: Sequence[jax.Array | None],
    *,
    trials: tuple[tuple[ClusterTrial, ...], ...],
    iters: int,
    sample: int,
    codec_trials: tuple[tuple[LC, ...], ...] | None = None,
) -> list[dict[str, Any]]:
    """Statistics of every (float) leaf, against its reference where it has one (deltas).

    ``codec_trials[i]``: delta codecs run in full on leaf ``i`` (second moments), measured
    rather than estimated (``"codec_trials"``: symbol histogram, elementwise error, guard).
    """
    out = []
    codec_trials = codec_trials or tuple(() for _ in values)
    for value, ref, leaf_trials, leaf_codecs in zip(
        values, references, trials, codec_trials, strict=True
    ):
        wd = work_dtype(value.dtype)
        v = value.astype(wd)
        finite = jnp.all(jnp.isfinite(v))
        if ref is not None:
            ref = ref.astype(value.dtype)
            finite &= jnp.all(jnp.isfinite(ref.astype(wd)))
        clean = jnp.where(finite, v, 0)
        st: dict[str, Any] = {
            "finite": finite,
            "value_sq": jnp.sum(jnp.square(clean)),
            "value_min": jnp.min(clean, initial=0),
            "value_hist": _value_histogram(clean),
            "lc_direct": _bucket_table(clean),
            "cluster": [
                _cluster_trial(jnp.where(finite, value, 0), b, d, iters, sample)
                for b, d in leaf_trials
            ],
        }
        if ref is not None:
            r = ref.astype(wd)
            xor = (as_words(value) ^ as_words(ref)).reshape(-1)
            width = np.dtype(value.dtype).itemsize
            st["changed"] = jnp.sum((xor != 0).astype(jnp.int32))
            st["plane_nonzero"] = jnp.stack([
                jnp.sum((((xor >> (8 * j)) & 0xFF) != 0).astype(jnp.int32))
                for j in range(width)
            ])
            st["lc"] = _bucket_table(jnp.where(finite, v - r, 0))
            # positive now, <= 0 in the reference: LC must lift these into a kept positive
            # bucket (see orbax_lossy.codecs.lc), so it needs one
            st["born"] = jnp.sum(((r <= 0) & (v > 0)).astype(jnp.int32))
            st["codec_trials"] = [_codec_trial(c, value, ref) for c in leaf_codecs]
        out.append(st)
    return out


def _to_host(tree: Any) -> Any:
    """Fetch replicated statistics (identical on every process) to numpy."""

    def fetch(x: jax.Array) -> np.ndarray:
        if x.is_fully_addressable:
            return np.asarray(x)
        return np.asarray(x.addressable_data(0))

    return jax.tree_util.tree_map(fetch, tree)


# --------------------------------------------------------------------------- host rule


def entropy_bits(counts: np.ndarray) -> float:
    """Order-0 entropy in bits per symbol of a histogram."""
    c = np.asarray(counts, np.float64)
    c = c[c > 0]
    total = c.sum()
    if total <= 0:
        return 0.0
    p = c / total
    return float(-(p * np.log2(p)).sum())


def binary_entropy(p: float) -> float:
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return float(-p * math.log2(p) - (1 - p) * math.log2(1 - p))


def lc_kept(counts: np.ndarray, bits: int) -> np.ndarray:
    """Which (sign, exponent) buckets :func:`orbax_lossy.codecs.lc.promote` keeps (numpy)."""
    n_symbols = 2**bits
    present = (counts > 0).reshape(-1, 2)
    per_exponent = present.sum(axis=1)
    from_top = np.cumsum(per_exponent[::-1])[::-1]
    keep = present & (from_top <= n_symbols - 1)[:, None]
    if not keep.any() and present.any():
        top = int(np.max(np.nonzero(per_exponent > 0)[0]))
        c2 = counts.reshape(-1, 2)
        keep[top, 1 if c2[top, 1] > c2[top, 0] else 0] = True
    return keep.reshape(-1)


def lc_estimate(table: Mapping[str, np.ndarray], n: int, bits: int) -> tuple[float, float]:
    """``(bits per element, ||error||^2)`` of ``LC(bits)`` on the delta, from the bucket table.

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
    keep = lc_kept(counts, bits)
    kept_err = np.maximum(sumsq - 2 * mid * total + counts * np.square(mid), 0.0)
    err_sq = 1.02 * float(sumsq[~keep].sum() + kept_err[keep].sum())
    symbol_counts = np.append(counts[keep], n - counts[keep].sum())
    return entropy_bits(symbol_counts), err_sq


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A priced codec: estimated bits per element, relative error (to the value) and, for
    delta codecs, the error relative to the delta (``progress_error``)."""

    codec: Codec
    bits_per_element: float
    rel_error: float
    progress_error: float = 0.0


def candidates(
    stats: Mapping[str, Any],
    n: int,
    dtype: np.dtype,
    role: str,
    lc_bits: Sequence[int],
    trials: Sequence[ClusterTrial],
    iters: int,
    sample: int,
    codec_trials: Sequence[Codec] = (),
) -> list[Candidate]:
    """Every candidate codec of one leaf, priced (see the module docstring), in tie order.

    Delta candidates (bitmask, LC delta) need the statistics against a reference (``"lc"``);
    on a base save only the direct ones are priced.
    """
    itemsize = np.dtype(dtype).itemsize
    mantissa = int(jnp.finfo(dtype).nmant)
    exact_bits = min(8.0 * itemsize, entropy_bits(stats["value_hist"]) + mantissa)
    out = [Candidate(Exact(), exact_bits, 0.0)]
    norm = math.sqrt(max(float(stats["value_sq"]), 0.0))
    factor = 2.0 if itemsize < 4 else 1.0

    def lc_candidate(table: Mapping[str, np.ndarray], codec: LC) -> Candidate:
        bpe, err_sq = lc_estimate(table, n, codec.bits)
        err = factor * math.sqrt(err_sq)
        rel = err / norm if norm > 0 else (0.0 if err_sq == 0 else math.inf)
        moved = math.sqrt(max(float(np.sum(table["sumsq"])), 0.0))
        progress = err / moved if moved > 0 else (0.0 if err_sq == 0 else math.inf)
        return Candidate(codec, bpe, rel, progress if codec.needs_reference else 0.0)

    nonnegative = float(stats["value_min"]) >= 0
    if "lc" in stats:
        p = float(stats["changed"]) / n
        q = np.asarray(stats["plane_nonzero"], np.float64) / n
        bitmask_bits = binary_entropy(p) + sum(binary_entropy(float(x)) + 8 * float(x) for x in q)
        out.append(Candidate(Bitmask(), bitmask_bits, 0.0))
        counts = np.asarray(stats["lc"]["count"])
        measured = list(zip(codec_trials, stats.get("codec_trials", []), strict=True))
        for codec, trial in measured:  # second moments: run in full, elementwise error
            if bool(trial["safe"]):
                out.append(Candidate(codec, entropy_bits(trial["hist"]), float(trial["elem_rel"])))
        for b in sorted(lc_bits) if not measured else ():
            positive_kept = lc_kept(counts, b).reshape(-1, 2)[:, 0].any()
            if nonnegative and int(stats["born"]) > 0 and not positive_kept:
                continue  # newborn elements would decode to 0: the guard would refuse it
            out.append(lc_candidate(stats["lc"], LC(bits=b)))
    if role in DIRECT_LC_ROLES and not nonnegative:
        out.extend(
            lc_candidate(stats["lc_direct"], LC(bits=b, mode="direct")) for b in sorted(lc_bits)
        )
    for (b, domain), trial in sorted(zip(trials, stats["cluster"], strict=True),
                                     key=lambda t: t[0][0]):
        if role == "second_moment":
            rel = float(trial["elem_rel"])
        else:
            val_sq = float(trial["val_sq"])
            err = math.sqrt(max(float(trial["err_sq"]), 0.0))
            rel = err / math.sqrt(val_sq) if val_sq > 0 else (0.0 if err == 0 else math.inf)
        codec = Cluster(bits=b, domain=domain, iters=iters, sample=sample)
        out.append(Candidate(codec, entropy_bits(trial["hist"]), rel))
    return out


def choose(
    cands: Sequence[Candidate],
    budget: float,
    lossy_ok: bool,
    slack: float,
    cheap_bits: float,
    progress_budget: float = math.inf,
) -> Codec:
    """The rule of the module docstring, steps 2 and 3."""
    lossless = min(
        (c for c in cands if isinstance(c.codec, (Exact, Bitmask))),
        key=lambda c: c.bits_per_element,
    )
    admissible = [
        c for c in cands
        if isinstance(c.codec, (LC, Cluster)) and lossy_ok and c.rel_error <= budget
        and c.progress_error <= progress_budget
    ] if budget > 0 else []
    if not admissible or lossless.bits_per_element <= cheap_bits:
        return lossless.codec
    lossy = min(admissible, key=lambda c: c.bits_per_element)
    if lossless.bits_per_element <= slack * lossy.bits_per_element:
        return lossless.codec
    return lossy.codec


@dataclasses.dataclass(frozen=True)
class AdaptivePolicy:
    """Stage-aware per-leaf codec choice under a per-role relative error budget.

    Args:
      budgets: ``(role, max relative error)`` pairs; roles absent or at 0 are lossless only.
      progress_budgets: ``(role, max error / ||delta||)`` pairs for delta codecs (see
        ``DEFAULT_PROGRESS_BUDGETS``); roles absent are not limited this way.
      lc_bits: LC alphabet sizes to consider.
      cluster_bits: Cluster alphabet sizes to consider for optimizer moments.
      lossless_slack: prefer a lossless codec unless it costs more than this factor times
        the best admissible lossy codec.
      cheap_lossless_bits: a lossless codec costing at most this many bits per element is
        always preferred (1 bit = 1/16 of bfloat16).
      min_size: leaves with fewer elements are stored losslessly (below ~64 elements the
        side tables of a lossy codec cost as much as the leaf).
      iters, sample: k-means parameters of the Cluster candidates.
    """

    #: the plan changes from save to save, so the handler encodes leaf by leaf (compiled
    #: programs are then cached per leaf shape and codec, not per whole-tree plan)
    plan_varies: ClassVar[bool] = True

    budgets: tuple[tuple[str, float], ...] = tuple(DEFAULT_BUDGETS.items())
    progress_budgets: tuple[tuple[str, float], ...] = tuple(DEFAULT_PROGRESS_BUDGETS.items())
    lc_bits: tuple[int, ...] = (2, 3, 4, 6, 8)
    cluster_bits: tuple[int, ...] = (4, 6, 8)
    lossless_slack: float = 1.25
    cheap_lossless_bits: float = 1.0
    min_size: int = 64
    iters: int = 16
    sample: int = 1 << 16

    def __post_init__(self) -> None:
        for role, budget in (*self.budgets, *self.progress_budgets):
            if role not in ROLES:
                raise InvalidArgumentError(f"unknown role {role!r} in budgets; roles: {ROLES}")
            if not isinstance(budget, (int, float)) or budget < 0:
                raise InvalidArgumentError(f"budget of {role!r} must be >= 0, got {budget!r}")
        for b in (*self.lc_bits, *self.cluster_bits):
            if not isinstance(b, int) or not 1 <= b <= 8:
                raise InvalidArgumentError(f"candidate bits must be ints in 1..8, got {b!r}")
        if self.lossless_slack < 1:
            raise InvalidArgumentError(f"lossless_slack must be >= 1, got {self.lossless_slack}")

    @classmethod
    def create(
        cls,
        budgets: Mapping[str, float] | None = None,
        progress_budgets: Mapping[str, float] | None = None,
        **kwargs: Any,
    ) -> AdaptivePolicy:
        """Defaults updated with the given budgets (``DEFAULT_BUDGETS``,
        ``DEFAULT_PROGRESS_BUDGETS``)."""
        merged = dict(DEFAULT_BUDGETS)
        merged.update(budgets or {})
        progress = dict(DEFAULT_PROGRESS_BUDGETS)
        progress.update(progress_budgets or {})
        return cls(budgets=tuple(merged.items()), progress_budgets=tuple(progress.items()),
                   **kwargs)

    def _codec_trials(self, role: str, reference: jax.Array | None) -> tuple[LC, ...]:
        """Delta codecs measured in full: LC linear and log domain for second moments."""
        if role != "second_moment" or reference is None:
            return ()
        # bits <= 4 only: each trial is traced into the statistics program of every leaf
        # shape (compile time, and on CPU each compiled program holds memory maps)
        bits = [b for b in sorted(self.lc_bits) if 2 <= b <= 4]
        return (*(LC(b) for b in bits), *(LC(b, domain="log") for b in bits))

    def _trials(self, role: str) -> tuple[ClusterTrial, ...]:
        if role == "second_moment":
            return tuple((b, "log") for b in self.cluster_bits)
        if role in ("first_moment", "optimizer"):
            return tuple((b, "linear") for b in self.cluster_bits)
        return ()

    def statistics(
        self,
        values: Sequence[jax.Array],
        references: Sequence[jax.Array | None],
        roles: Sequence[str],
    ) -> list[dict[str, Any]]:
        """Run :func:`leaf_statistics` for float leaves; numpy results, one dict per leaf."""
        # One small program per distinct (shape, dtype, sharding, trials), not one per tree:
        # the compile cost then scales with the distinct leaf shapes (a transformer repeats a
        # few shapes across layers) and is paid once per run.
        stats = [
            leaf_statistics(
                [value], [ref], trials=(self._trials(role),), iters=self.iters,
                codec_trials=(self._codec_trials(role, ref),),
                sample=self.sample,
            )[0]
            for value, ref, role in zip(values, references, roles, strict=True)
        ]
        return _to_host(stats)

    def plan(
        self,
        paths: Sequence[StoredPath],
        values: Sequence[jax.Array],
        references: Sequence[jax.Array | None],
        is_base: bool,
    ) -> list[Codec]:
        """Codec of every device leaf for one save (see the module docstring for the rule)."""
        plan: list[Codec] = [Exact() for _ in values]
        budgets, progress = dict(self.budgets), dict(self.progress_budgets)

        def priced(i: int) -> bool:
            v, r = values[i], references[i]
            if not jnp.issubdtype(v.dtype, jnp.floating):
                return False
            role = leaf_role(paths[i], v.dtype)
            if role in ("integer", "rng"):
                return False
            if is_base:  # only direct lossy codecs compete with Exact on a base
                return role in LOSSY_BASE_ROLES and float(budgets.get(role, 0.0)) > 0
            return r is not None and tuple(r.shape) == tuple(v.shape)

        idx = [i for i in range(len(values)) if priced(i)]
        if not idx:
            return plan
        roles = [leaf_role(paths[i], values[i].dtype) for i in idx]
        stats = self.statistics(
            [values[i] for i in idx], [None if is_base else references[i] for i in idx], roles
        )
        for i, role, st in zip(idx, roles, stats, strict=True):
            if not bool(st["finite"]):
                continue
            n = math.prod(values[i].shape)
            trials = self._trials(role)
            if role == "second_moment" and float(st["value_min"]) < 0:
                trials = ()
                st = {**st, "cluster": []}
            cands = candidates(st, n, np.dtype(values[i].dtype), role, self.lc_bits,
                               trials, self.iters, self.sample,
                               self._codec_trials(role, None if is_base else references[i]))
            plan[i] = choose(cands, float(budgets.get(role, 0.0)), n >= self.min_size,
                             self.lossless_slack, self.cheap_lossless_bits,
                             float(progress.get(role, math.inf)))
        return plan
