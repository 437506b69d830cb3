"""Which experts a save holds: interleaved round-robin (the paper's default) or load-aware.

Every (group, layer) pair is a *slot row* with a position ``p`` in a fixed order (groups in
tree order, layers in order). Sequential selection at rotation cursor ``c`` holds, in row
``p``, experts ``(c + p) * K + j mod N`` for ``j < K``: consecutive layers hold different
blocks of experts, so with experts sharded over an expert-parallel mesh axis the saved experts
(and the write work) spread over the shards (MoC-System Fig. 4). Every expert is held at
least once in every ``ceil(N / K)`` consecutive saves.

Load-aware selection holds the top-K experts by unsaved tokens; ties go to the expert saved
longest ago, then the lower id; an expert not held for ``max_staleness`` saves is held first.
With ``K < P`` (:func:`load_aware_balanced`) the choice runs jointly over ``R`` rows (the
layers of a scanned group, or the MoE layers of several groups with the same N) under a
quota of ``R K / P`` held slices per shard, so that the flat cut stays shard-local.

Expert-parallel shards (``shards = P > 1``, the number of shards the group's expert axis is split
into, when ``P`` divides both N and K): both selections run per shard, ``K / P`` of each shard's
``N / P`` experts, so every shard holds the same number of held experts in every layer (the
paper's balanced per-rank schedule) and the held slices are cut shard-locally
(:mod:`orbax_lossy.experts.device_ops`). ``P = 1`` is the plain rule above.

Fewer held experts than shards (``K < P``, ``P`` dividing N): sequential selection walks the
experts *striped* over the shards, position ``i`` standing for expert
``(i mod P) N/P + i div P`` (shard ``i mod P``). Consecutive rows (the ``L`` layers of a
scanned group, then the next groups) hold consecutive positions, so ``R`` rows hold
``R K / P`` slices of every shard when ``P`` divides ``R K``: no single row can be balanced,
but a scanned leaf or a bundle of the same leaf over several MoE layers can, and the flat cut
stays shard-local. With ``P = N`` (one expert per shard) the order is the plain one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def balanced(n: int, k: int, shards: int) -> bool:
    """Whether ``k`` of ``n`` experts can be held as ``k / shards`` per expert shard."""
    return shards > 1 and n % shards == 0 and min(k, n) % shards == 0


def striped(n: int, k: int, shards: int) -> bool:
    """Whether ``k`` of ``n`` experts are held in the striped order over ``shards``."""
    return shards > 1 and k < shards and n % shards == 0


def sequential(n: int, k: int, cursor: int, position: int, shards: int = 1,
               stripes: int = 1) -> list[int]:
    """Held experts of one row (sorted); ``stripes``: the striped order over that many
    shards (see the module docstring)."""
    if stripes > 1:
        per = n // stripes
        return sorted((i % stripes) * per + i // stripes
                      for i in sequential(n, k, cursor, position))
    if balanced(n, k, shards):
        per, kp = n // shards, min(k, n) // shards
        return sorted(p * per + e for p in range(shards)
                      for e in sequential(per, kp, cursor, position))
    k = min(k, n)
    start = ((cursor + position) * k) % n
    return sorted({(start + j) % n for j in range(k)})


def load_aware(
    n: int, k: int, unsaved: Sequence[int], age: Sequence[int], max_staleness: int | None,
    shards: int = 1,
) -> list[int]:
    """Top-K by unsaved tokens with a staleness cap (see the module docstring)."""
    if balanced(n, k, shards):
        per, kp = n // shards, min(k, n) // shards
        return sorted(p * per + e for p in range(shards) for e in load_aware(
            per, kp, unsaved[p * per:(p + 1) * per], age[p * per:(p + 1) * per],
            max_staleness))
    k = min(k, n)
    tokens = np.asarray(unsaved, np.int64)
    ages = np.asarray(age, np.int64)
    order = sorted(range(n), key=lambda e: (-int(tokens[e]), -int(ages[e]), e))
    forced: list[int] = []
    if max_staleness is not None:
        stale = [e for e in range(n) if ages[e] >= max_staleness]
        forced = sorted(stale, key=lambda e: (-int(ages[e]), -int(tokens[e]), e))[:k]
    held = list(forced)
    for e in order:
        if len(held) >= k:
            break
        if e not in held:
            held.append(e)
    return sorted(held)


def load_aware_balanced(
    n: int, k: int, unsaved: Sequence[Sequence[int]], age: Sequence[Sequence[int]],
    max_staleness: int | None, shards: int,
) -> list[list[int]] | None:
    """Load-aware choice for ``R`` rows at once (``unsaved[r][e]``, ``age[r][e]``) with every
    shard holding exactly ``R K / P`` slices (``P = shards`` dividing ``n`` and ``R K``).

    Greedy over all (row, expert) pairs: stale ones first (oldest first), then by unsaved
    tokens (most first; ties: saved longest ago, then row, then id); a pair is taken while its
    row has fewer than K and its shard fewer than its quota. Rows left short are completed
    from shards with quota left (the fewest-tokens case). None when that is impossible (the
    caller falls back to :func:`load_aware` per row).
    """
    rows = len(unsaved)
    if shards <= 1 or n % shards or (rows * k) % shards or k > n:
        return None
    per, quota = n // shards, rows * k // shards
    tokens = np.asarray(unsaved, np.int64)
    ages = np.asarray(age, np.int64)
    pairs = [(r, e) for r in range(rows) for e in range(n)]
    stale = [] if max_staleness is None else sorted(
        (p for p in pairs if ages[p] >= max_staleness),
        key=lambda p: (-int(ages[p]), -int(tokens[p]), p[0], p[1]))
    ranked = sorted(pairs, key=lambda p: (-int(tokens[p]), -int(ages[p]), p[0], p[1]))
    held: list[list[int]] = [[] for _ in range(rows)]
    used = [0] * shards
    for r, e in stale + ranked:
        if len(held[r]) < k and used[e // per] < quota and e not in held[r]:
            held[r].append(e)
            used[e // per] += 1
    for r in range(rows):
        for e in range(n):
            if len(held[r]) >= k:
                break
            if used[e // per] < quota and e not in held[r]:
                held[r].append(e)
                used[e // per] += 1
        if len(held[r]) < k:
            return None
    return [sorted(h) for h in held]
