"""``AdaptivePolicy``: a per-leaf, per-save codec choice from measured statistics (BitSnap).

Every float leaf is priced against its role's candidate codecs (any registered codec; by
default exact, bitmask, LC, LC direct and cluster) and the cheapest admissible one under
the role's error budget is picked, unless a lossless one is nearly as cheap. The rule, its
statistics and the default budgets are described in ``docs/adaptive.md``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.codecs.base import Codec, ErrorMeasure
from orbax_lossy.codecs.bitmask import Bitmask
from orbax_lossy.codecs.cluster import Cluster
from orbax_lossy.codecs.exact import Exact
from orbax_lossy.codecs.lc import LC
from orbax_lossy.errors import InvalidArgumentError
from orbax_lossy.policy.adaptive.pricing import choose, is_analytic, price
from orbax_lossy.policy.adaptive.statistics import (
    DEFAULT_SAMPLE,
    DEFAULT_TRIAL_SAMPLE,
    completed,
    leaf_statistics,
    to_host,
)
from orbax_lossy.policy.base import EXACT_ROLES, OPTIMIZER_ROLES, check_role
from orbax_lossy.policy.roles import path_roles
from orbax_lossy.treepaths import StoredPath

#: Default error budgets per role, from resume experiments (``benchmarks/whole_state.py``;
#: measurements in docs/adaptive.md). ``param`` and ``first_moment``:
#: ``||recon - value|| / ||value||``; ``second_moment``: the RMS of the elementwise relative
#: errors. A first-moment budget above 1 would admit reconstructions worse than zeros.
DEFAULT_BUDGETS: Mapping[str, float] = {
    "param": 5e-2,
    "first_moment": 1.0,
    "second_moment": 2e-1,
    "optimizer": 0.0,
}

#: Default *progress* budgets: the largest ``||recon - value|| / ||value - reference||`` (the
#: share of the update since the previous checkpoint that a delta codec may get wrong); see
#: docs/adaptive.md.
DEFAULT_PROGRESS_BUDGETS: Mapping[str, float] = {"param": 0.5}

#: How each role's error is measured (others: ``"l2"``). Adam scales each element's step by
#: ``1 / sqrt(nu)``, so a second moment's error is elementwise.
ERROR_MEASURES: Mapping[str, ErrorMeasure] = {"second_moment": "elementwise"}

#: Roles priced with ``LC(mode="direct")`` by default (magnitude pruning of a signed value):
#: never a parameter nor a second moment.
DIRECT_LC_ROLES = ("first_moment", "optimizer")

#: Roles a base save may store lossily (with a direct codec, under the role's budget).
#: Parameters stay lossless on bases: a base anchors the chain.
LOSSY_BASE_ROLES = OPTIMIZER_ROLES

#: Second moments run their LC candidates in full (measured); only these bits, since every
#: trial is traced into the statistics program of every leaf shape (compile time).
MEASURED_LC_BITS = (2, 3, 4)


def default_candidates(
    role: str, lc_bits: Sequence[int], cluster_bits: Sequence[int], iters: int, sample: int
) -> tuple[Codec, ...]:
    """Today's candidates of a role, in tie order (fewer bits first within a family)."""
    lc = sorted(lc_bits)
    out: list[Codec] = [Exact(), Bitmask()]
    few = [b for b in lc if b in MEASURED_LC_BITS]
    if role == "second_moment" and few:
        out += [LC(b) for b in few] + [LC(b, domain="log") for b in few]
    else:
        out += [LC(b) for b in lc]
    if role in DIRECT_LC_ROLES:
        out += [LC(b, mode="direct") for b in lc]
    if role in OPTIMIZER_ROLES:
        domain = "log" if role == "second_moment" else "linear"
        out += [Cluster(b, domain=domain, iters=iters, sample=sample) for b in sorted(cluster_bits)]
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class AdaptivePolicy:
    """Stage-aware per-leaf codec choice under a per-role relative error budget.

    Args:
      budgets: ``(role, max relative error)`` pairs; roles absent or at 0 are lossless only.
      progress_budgets: ``(role, max error / ||delta||)`` pairs for delta codecs (see
        ``DEFAULT_PROGRESS_BUDGETS``); roles absent are not limited this way.
      lc_bits: LC alphabet sizes of the default candidates.
      cluster_bits: Cluster alphabet sizes of the default candidates for optimizer moments.
      lossless_slack: prefer a lossless codec unless it costs more than this factor times
        the best admissible lossy codec.
      cheap_lossless_bits: a lossless codec costing at most this many bits per element is
        always preferred (1 bit = 1/16 of bfloat16).
      min_size: leaves with fewer elements are stored losslessly (below ~64 elements the
        side tables of a lossy codec cost as much as the leaf).
      iters, sample: k-means parameters of the default Cluster candidates.
      stats_sample: statistics and measured trials read at most this many elements of a
        leaf, a deterministic strided sample of bigger ones (``<= 0``: the whole leaf); see
        docs/adaptive.md.
      trial_sample: the same for the measured trials (each a full device encode).
      candidates: ``(role, codecs)`` pairs replacing a role's default candidates (any
        registered codecs, in tie order; ``Exact()`` is always a candidate).
    """

    budgets: tuple[tuple[str, float], ...] = tuple(DEFAULT_BUDGETS.items())
    progress_budgets: tuple[tuple[str, float], ...] = tuple(DEFAULT_PROGRESS_BUDGETS.items())
    lc_bits: tuple[int, ...] = (2, 3, 4, 6, 8)
    cluster_bits: tuple[int, ...] = (4, 6, 8)
    lossless_slack: float = 1.25
    cheap_lossless_bits: float = 1.0
    min_size: int = 64
    iters: int = 16
    sample: int = 1 << 16
    stats_sample: int = DEFAULT_SAMPLE
    trial_sample: int = DEFAULT_TRIAL_SAMPLE
    candidates: tuple[tuple[str, tuple[Codec, ...]], ...] = ()

    def __post_init__(self) -> None:
        def roles(pairs: Sequence[tuple[str, Any]], what: str) -> tuple[tuple[str, Any], ...]:
            return tuple((check_role(role, what), x) for role, x in pairs)

        object.__setattr__(self, "budgets", roles(self.budgets, "budgets"))
        object.__setattr__(self, "progress_budgets", roles(self.progress_budgets, "budgets"))
        object.__setattr__(self, "candidates", tuple(
            (role, tuple(codecs)) for role, codecs in roles(self.candidates, "candidates")))
        for role, budget in (*self.budgets, *self.progress_budgets):
            if not isinstance(budget, (int, float)) or budget < 0:
                raise InvalidArgumentError(f"budget of {role!r} must be >= 0, got {budget!r}")
        for b in (*self.lc_bits, *self.cluster_bits):
            if not isinstance(b, int) or not 1 <= b <= 8:
                raise InvalidArgumentError(f"candidate bits must be ints in 1..8, got {b!r}")
        if self.lossless_slack < 1:
            raise InvalidArgumentError(f"lossless_slack must be >= 1, got {self.lossless_slack}")
        for role, codecs in self.candidates:
            for codec in codecs:
                if not hasattr(codec, "codec_id"):
                    raise InvalidArgumentError(f"candidate of {role!r}: {codec!r} is not a codec")

    @classmethod
    def create(
        cls,
        budgets: Mapping[str, float] | None = None,
        progress_budgets: Mapping[str, float] | None = None,
        candidates: Mapping[str, Sequence[Codec]] | None = None,
        **kwargs: Any,
    ) -> AdaptivePolicy:
        """Defaults updated with the given budgets (``DEFAULT_BUDGETS``,
        ``DEFAULT_PROGRESS_BUDGETS``) and per-role candidate lists."""
        merged = dict(DEFAULT_BUDGETS)
        merged.update(budgets or {})
        progress = dict(DEFAULT_PROGRESS_BUDGETS)
        progress.update(progress_budgets or {})
        return cls(budgets=tuple(merged.items()), progress_budgets=tuple(progress.items()),
                   candidates=tuple((r, tuple(c)) for r, c in (candidates or {}).items()),
                   **kwargs)

    def role_candidates(self, role: str) -> tuple[Codec, ...]:
        """The codecs priced for a leaf of ``role``, in tie order, ``Exact()`` first."""
        given = dict(self.candidates)
        if role in given:
            codecs = given[role]
        else:
            codecs = default_candidates(role, self.lc_bits, self.cluster_bits, self.iters,
                                        self.sample)
        return (Exact(), *(c for c in codecs if c != Exact()))

    def _priced(self, role: str, value: jax.Array, reference: jax.Array | None,
                is_base: bool) -> bool:
        if not jnp.issubdtype(value.dtype, jnp.floating) or role in EXACT_ROLES:
            return False
        if is_base:  # only direct lossy codecs compete with Exact on a base
            return role in LOSSY_BASE_ROLES and float(dict(self.budgets).get(role, 0.0)) > 0
        return reference is not None and tuple(reference.shape) == tuple(value.shape)

    def _dispatch(self, role: str, value: jax.Array, reference: jax.Array | None
                  ) -> tuple[list[Codec], ErrorMeasure, Any]:
        """The role's candidates, its error measure and the leaf's statistics (dispatched, not
        fetched)."""
        measure: ErrorMeasure = ERROR_MEASURES.get(role, "l2")
        codecs = [c for c in self.role_candidates(role)
                  if reference is not None or not c.needs_reference]
        measured = tuple(c for c in codecs if not is_analytic(c, measure))
        # One small program per distinct (shape, dtype, sharding, measured codecs), not one
        # per tree: compile cost scales with the distinct leaf shapes, paid once per run.
        stats = leaf_statistics(value, reference, measured=measured, measure=measure,
                                sample=self.stats_sample, trial_sample=self.trial_sample)
        return codecs, measure, stats

    def _choose(self, role: str, value: jax.Array, codecs: Sequence[Codec],
                measure: ErrorMeasure, stats: Mapping[str, Any]) -> Codec:
        """Price the candidates from the fetched statistics and apply the rule."""
        if not bool(stats["finite"]):
            return Exact()
        n = math.prod(value.shape)
        # bits per element and relative errors are intensive: a sampled leaf is priced on
        # its sample's statistics in units of the leaf (docs/adaptive.md)
        stats, priced_n = completed(stats, value.dtype, n, self.stats_sample)
        cands = price(codecs, stats, priced_n, np.dtype(value.dtype), measure)
        return choose(cands, float(dict(self.budgets).get(role, 0.0)), n >= self.min_size,
                      self.lossless_slack, self.cheap_lossless_bits,
                      float(dict(self.progress_budgets).get(role, math.inf)))

    def choose_leaf(self, role: str, value: jax.Array, reference: jax.Array | None) -> Codec:
        """Price the role's candidates on one leaf and apply the rule (docs/adaptive.md)."""
        codecs, measure, stats = self._dispatch(role, value, reference)
        return self._choose(role, value, codecs, measure, to_host(stats))

    def plan(self, paths: Sequence[StoredPath], values: Sequence[jax.Array],
             references: Sequence[jax.Array | None], is_base: bool,
             roles: Sequence[str] | None = None) -> list[Codec]:
        """:meth:`choose_leaf` for every priced leaf, Exact for the others
        (:meth:`~orbax_lossy.policy.Policy.plan`); roles from ``roles``, else from the paths
        (``state`` leaves have no budget: lossless). Every leaf's statistics program is
        dispatched before any result is fetched."""
        if roles is None:
            roles = path_roles(paths, [value.dtype for value in values])
        pending: dict[int, tuple[list[Codec], ErrorMeasure, Any]] = {}
        for i, (value, ref, role) in enumerate(zip(values, references, roles, strict=True)):
            ref = None if is_base else ref
            if self._priced(role, value, ref, is_base):
                pending[i] = self._dispatch(role, value, ref)
        plan: list[Codec] = [Exact() for _ in values]
        # fetched in dispatch order: pricing one leaf overlaps the programs of the next ones
        for i, (codecs, measure, stats) in pending.items():
            plan[i] = self._choose(roles[i], values[i], codecs, measure, to_host(stats))
        return plan
