"""Token accounting: unsaved tokens per expert, lost tokens, PLT (MoC-System Eq. 7), Dynamic-K.

For every MoE layer (a group, or one layer of a scanned group) and expert, ``unsaved`` counts
the tokens routed to the expert since its newest saved copy. A save records ``unsaved`` after
zeroing its held experts: exactly the tokens whose expert updates are lost if that step is
ever restored. A restore adds them to ``lost_total``; PLT averages over layers

    PLT = mean_i  lost_total_i / denominator_i

where the denominator is the run's total expert assignments ``T_i * TopK_i`` when the user
gives it (``PartialExperts(total_assignments=...)``, the paper's definition) and otherwise the
assignments seen so far (``plt_denominator == "tokens_seen"``, an upper estimate of the
paper's PLT). Dynamic-K doubles K (up to N) after a restore whose PLT exceeds the threshold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from orbax_lossy.errors import InvalidArgumentError


def validate_tokens(tokens: Any) -> dict[str, np.ndarray]:
    """``{group: non-negative int counts [E] or [L, E]}`` as int64 host arrays."""
    if not isinstance(tokens, Mapping):
        raise InvalidArgumentError(
            f"expert_tokens must map group names to counts, got {type(tokens).__name__}")
    out = {}
    for group, counts in tokens.items():
        if not isinstance(group, str):
            raise InvalidArgumentError(f"expert_tokens key {group!r} is not a group name")
        arr = np.asarray(counts)
        if arr.ndim not in (1, 2) or arr.size == 0:
            raise InvalidArgumentError(
                f"expert_tokens[{group!r}] has shape {arr.shape}; expected [experts] or "
                "[layers, experts]")
        if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
            raise InvalidArgumentError(f"expert_tokens[{group!r}] has dtype {arr.dtype}")
        if np.issubdtype(arr.dtype, np.floating) and not np.all(arr == np.round(arr)):
            raise InvalidArgumentError(f"expert_tokens[{group!r}] holds non-integer counts")
        if np.any(arr < 0):
            raise InvalidArgumentError(f"expert_tokens[{group!r}] holds negative counts")
        out[group] = arr.astype(np.int64)
    return out


@dataclasses.dataclass
class GroupCounts:
    """Per group: arrays ``[layers, experts]`` (unsaved, age, holder) and ``[layers]`` totals."""

    unsaved: np.ndarray
    age: np.ndarray  # saves since each expert was held
    holder: np.ndarray  # step of each expert's newest saved copy (-1: none)
    tokens_total: np.ndarray
    lost_total: np.ndarray

    @classmethod
    def empty(cls, layers: int, n: int) -> GroupCounts:
        """No tokens, nothing held."""
        z = np.zeros((layers, n), np.int64)
        return cls(z.copy(), z.copy(), np.full((layers, n), -1, np.int64),
                   np.zeros(layers, np.int64), np.zeros(layers, np.int64))

    def copy(self) -> GroupCounts:
        """A deep copy."""
        return GroupCounts(*(np.array(a, copy=True) for a in dataclasses.astuple(self)))

    def to_json(self) -> dict[str, Any]:
        """JSON form (lists of ints)."""
        return {k: np.asarray(v).tolist() for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> GroupCounts:
        """Inverse of :meth:`to_json`."""
        return cls(*(np.asarray(d[f.name], np.int64) for f in dataclasses.fields(cls)))


def add_tokens(counts: GroupCounts, tokens: np.ndarray | None, group: str) -> None:
    """Accumulate the tokens routed since the previous save (validated against the shape)."""
    if tokens is None:
        return
    layers, n = counts.unsaved.shape
    t = tokens.reshape(1, -1) if tokens.ndim == 1 else tokens
    if t.shape != (layers, n):
        raise InvalidArgumentError(
            f"expert_tokens[{group!r}] has shape {tokens.shape}; group {group!r} has "
            f"{layers} layer(s) of {n} experts ([{n}] or [{layers}, {n}])")
    counts.unsaved += t
    counts.tokens_total += t.sum(axis=1)


def denominators(
    groups: Mapping[str, GroupCounts], total_assignments: Any,
) -> tuple[dict[str, np.ndarray], str]:
    """Per group and layer, the PLT denominator, and its label."""
    if total_assignments is None:
        return {g: c.tokens_total.astype(np.float64) for g, c in groups.items()}, "tokens_seen"
    out = {}
    for g, c in groups.items():
        t = total_assignments.get(g) if isinstance(total_assignments, Mapping) else (
            total_assignments)
        if t is None:
            raise InvalidArgumentError(f"total_assignments has no entry for group {g!r}")
        out[g] = np.broadcast_to(np.asarray(t, np.float64), c.tokens_total.shape).copy()
    return out, "total_assignments"


def plt(groups: Mapping[str, GroupCounts], total_assignments: Any,
        lost: Mapping[str, np.ndarray] | None = None) -> tuple[float, str]:
    """PLT over every MoE layer (Eq. 7) with ``lost`` (default: each group's lost_total)."""
    dens, label = denominators(groups, total_assignments)
    ratios = []
    for g, c in groups.items():
        num = (c.lost_total if lost is None else lost[g]).astype(np.float64)
        for x, d in zip(num, dens[g], strict=True):
            ratios.append(x / d if d > 0 else 0.0)
    return (float(np.mean(ratios)) if ratios else 0.0), label


def next_k(k: int, n_max: int, plt_value: float, threshold: float | None) -> int:
    """Dynamic-K: double K (at most ``n_max``) when PLT exceeds the threshold."""
    if threshold is not None and plt_value > threshold and k < n_max:
        return min(2 * k, n_max)
    return k
