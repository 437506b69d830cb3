"""Cutting held experts out of a stacked leaf and putting reconstructions back, on device.

Layout: the expert axis ``a`` (and layer axis ``b``) stay where they are; a slot holds
``slot[.., j @ a, .., l @ b, ..] = x[.., held[l, j] @ a, .., l @ b, ..]`` (``held[l]`` sorted).

Two programs, chosen per leaf and save:

* **Shard-local** (:func:`local_plan` is not None): the expert axis is split over ``P`` shards
  of a :class:`~jax.sharding.NamedSharding` and every shard holds ``K / P`` of the held experts
  of every layer (the balanced selection of :mod:`orbax_lossy.experts.selection` makes it so
  when ``P`` divides K and N). The slot keeps the leaf's sharding *including* the expert axis
  (``K / P`` rows per shard) and is cut inside :func:`jax.shard_map` from each shard's own
  rows: no collective, each device (so each process) holds, encodes and writes exactly the
  held experts it owns.
* **Flat** (:func:`flat_plan` is not None; K < P): no single layer row is balanced over the
  ``P`` expert shards, but the held (layer, expert) slices of a scanned leaf, or of a
  *bundle* of the same leaf in several MoE layers (``params/blocks/0/moe/w_in``,
  ``params/blocks/1/moe/w_in``, ...: same shape and sharding), are (``m`` per shard; the
  striped rotation of :mod:`orbax_lossy.experts.selection` makes it so when ``P`` divides the
  number of held slices). The slot is then a flat stack ``[P m, ...rest]`` of canonical
  slices (``rest``: the leaf's other axes, in order), row ``r`` holding member
  ``rows[r, 0]``'s ``[.., rows[r, 2] @ a, .., rows[r, 1] @ b, ..]``, shard-major and sharded
  like the members (expert mesh axes on the rows): again no collective, each shard cuts its
  own ``m`` slices. The rows are recorded in the PEC record.
* **Gathered** (otherwise: K < P without enough layers to balance, a load-aware choice whose
  shard quotas cannot be met, an unsharded or single-device leaf): the slot keeps the leaf's
  sharding except along the expert axis, which is replicated; with a sharded expert axis XLA
  moves the held rows between devices.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from orbax_lossy.shardings import is_single_device


def _spec(sharding: NamedSharding, ndim: int) -> list:
    return list(sharding.spec) + [None] * (ndim - len(sharding.spec))


def _names(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def expert_shards(x, axis: int) -> int:
    """How many shards the expert axis of ``x`` is split into (1: not split)."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return 1
    names = _names(_spec(sharding, x.ndim)[axis])
    return math.prod(sharding.mesh.shape[n] for n in names)


def local_plan(x, held: np.ndarray, axis: int, layer: int | None) -> np.ndarray | None:
    """Per-shard local indices ``int [P, L, K/P]`` when the cut can be shard-local, else None.

    Shard ``p`` of the expert axis owns experts ``[p N/P, (p+1) N/P)``; the cut is local when
    it owns exactly ``K / P`` held experts of every layer row.
    """
    parts = expert_shards(x, axis)
    if parts <= 1:
        return None
    n = int(x.shape[axis])
    held = np.asarray(held, np.int64)
    k = held.shape[1]
    if n % parts or k % parts:
        return None
    per, kp = n // parts, k // parts
    out = np.empty((parts, held.shape[0], kp), np.int32)
    for row, h in enumerate(held):
        if np.any(np.diff(h) <= 0):
            return None
        owner = h // per
        if not np.array_equal(owner, np.repeat(np.arange(parts), kp)):
            return None
        out[:, row, :] = (h % per).reshape(parts, kp)
    if layer is not None and held.shape[0] != x.shape[layer]:
        return None
    return out


def slot_sharding(x: jax.Array, axis: int, local: bool = False):
    """The slot's sharding: the leaf's (``local``), or with the expert axis unsharded (None:
    let XLA pick)."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
        if local:
            return sharding
        spec = _spec(sharding, x.ndim)
        spec[axis] = None
        return NamedSharding(sharding.mesh, P(*spec))
    if is_single_device(sharding):
        return sharding
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class FlatCut:
    """A flat slot's layout over ``B`` member leaves of one shape and sharding (see the module
    docstring; ``B = 1``: one leaf's own flat slot, ``B > 1``: a *bundle* of the same leaf of
    several MoE layers).

    ``rows``: int ``[R, 3]``, the (member, layer, expert) slice of slot row ``r``; ``local``:
    int ``[P, m, 3]``, per expert shard the (member, local expert, layer) of its ``m`` rows;
    ``source``: the members' sharding; ``sharding``: the slot's.
    """

    rows: np.ndarray
    local: np.ndarray
    source: NamedSharding
    sharding: NamedSharding
    axis: int
    layer: int | None


def flat_plan(xs: Sequence[Any], helds: Sequence[np.ndarray], axis: int,
              layer: int | None) -> FlatCut | None:
    """A flat cut of the members ``xs`` (held experts ``helds[b]``: int [layers, K]) when
    every expert shard owns the same number of their held slices, all members have one shape,
    dtype and :class:`NamedSharding` and the layer axis (if any) is not sharded; else None."""
    x = xs[0]
    parts = expert_shards(x, axis)
    if parts <= 1 or any(getattr(y, "sharding", None) != x.sharding or y.shape != x.shape
                         or y.dtype != x.dtype for y in xs):
        return None
    sharding = x.sharding
    spec = _spec(sharding, x.ndim)
    n = int(x.shape[axis])
    if n % parts or (layer is not None and spec[layer] is not None):
        return None
    per = n // parts
    owned: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]
    for b, held in enumerate(helds):
        held = np.asarray(held, np.int64)
        if held.shape[0] != (1 if layer is None else x.shape[layer]):
            return None
        for row, h in enumerate(held):
            if len(set(h.tolist())) != len(h):
                return None
            for e in h:
                owned[int(e) // per].append((b, row, int(e)))
    m = len(owned[0])
    if m == 0 or any(len(o) != m for o in owned):
        return None
    owned = [sorted(o) for o in owned]
    rows = np.asarray([t for o in owned for t in o], np.int64)
    local = np.asarray([[(b, e % per, row) for b, row, e in o] for o in owned], np.int32)
    rest = [spec[d] for d in range(x.ndim) if d != axis and d != layer]
    slot = NamedSharding(sharding.mesh, P(spec[axis], *rest))
    return FlatCut(rows, local, sharding, slot, axis, layer)


def _canon(x, axis, layer):
    if layer is None:
        return jnp.moveaxis(x, axis, 0)[:, None]
    return jnp.moveaxis(x, (axis, layer), (0, 1))


def _uncanon(c, axis, layer):
    if layer is None:
        return jnp.moveaxis(c[:, 0], 0, axis)
    return jnp.moveaxis(c, (0, 1), (axis, layer))


def _take(x, held, axis, layer):
    c = _canon(x, axis, layer)
    rows = jnp.arange(c.shape[1])[None, :]
    return _uncanon(c[held.T, rows], axis, layer)


def _put(x, slot, held, axis, layer):
    c = _canon(x, axis, layer)
    s = _canon(slot, axis, layer)
    rows = jnp.arange(c.shape[1])[None, :]
    return _uncanon(c.at[held.T, rows].set(s), axis, layer)


@functools.lru_cache(maxsize=256)
def _program(fn, out_sharding):
    return jax.jit(fn, static_argnames=("axis", "layer"), out_shardings=out_sharding)


@functools.lru_cache(maxsize=256)
def _local_program(kind: str, mesh, spec, idx_spec, axis: int, layer: int | None):
    """``take``/``put`` run per shard on its own rows (``idx``: that shard's local indices)."""
    if kind == "take":
        def take_body(x, idx):
            return _take(x, idx[0], axis, layer)

        return jax.jit(jax.shard_map(take_body, mesh=mesh, in_specs=(spec, idx_spec),
                                     out_specs=spec))

    def put_body(x, slot, idx):
        return _put(x, slot, idx[0], axis, layer)

    return jax.jit(jax.shard_map(put_body, mesh=mesh, in_specs=(spec, spec, idx_spec),
                                 out_specs=spec))


@functools.lru_cache(maxsize=256)
def _flat_program(kind: str, members: int, mesh, spec, slot_spec, idx_spec, axis: int,
                  layer: int | None):
    """Flat ``take``/``put`` per shard over ``members`` leaves: its ``m`` (member, local
    expert, layer) slices."""
    if kind == "take":
        def take_body(*args):
            *xs, idx = args
            b, e, lyr = idx[0, :, 0], idx[0, :, 1], idx[0, :, 2]
            out = None
            for j, x in enumerate(xs):
                got = _canon(x, axis, layer)[e, lyr]
                mine = (b == j).reshape((-1,) + (1,) * (got.ndim - 1))
                out = got if out is None else jnp.where(mine, got, out)
            return out

        return jax.jit(jax.shard_map(take_body, mesh=mesh,
                                     in_specs=(spec,) * members + (idx_spec,),
                                     out_specs=slot_spec))

    def put_body(*args):
        *xs, slot, idx = args
        b, e, lyr = idx[0, :, 0], idx[0, :, 1], idx[0, :, 2]
        out = []
        for j, x in enumerate(xs):
            c = _canon(x, axis, layer)
            rows = jnp.where(b == j, e, c.shape[0])  # other members' rows: out of bounds
            out.append(_uncanon(c.at[rows, lyr].set(slot, mode="drop"), axis, layer))
        return tuple(out)

    return jax.jit(jax.shard_map(put_body, mesh=mesh,
                                 in_specs=(spec,) * members + (slot_spec, idx_spec),
                                 out_specs=(spec,) * members))


def _flat_call(kind: str, xs: Sequence[Any], cut: FlatCut):
    xs = [x if x.sharding == cut.source else jax.device_put(x, cut.source) for x in xs]
    expert_entry = _spec(cut.source, xs[0].ndim)[cut.axis]
    idx_spec = P(expert_entry, None, None)
    idx = jax.make_array_from_callback(cut.local.shape, NamedSharding(cut.source.mesh, idx_spec),
                                       lambda i: cut.local[i])
    fn = _flat_program(kind, len(xs), cut.source.mesh, cut.source.spec, cut.sharding.spec,
                       idx_spec, cut.axis, cut.layer)
    return fn, xs, idx


def take_flat(xs: Sequence[Any], cut: FlatCut) -> jax.Array:
    """The flat slot of ``cut`` cut from its members ``xs`` (no collective)."""
    fn, xs, idx = _flat_call("take", xs, cut)
    return fn(*xs, idx)


def put_flat(xs: Sequence[Any], slot: jax.Array, cut: FlatCut) -> list[jax.Array]:
    """The members ``xs`` with their held slices replaced by the flat ``slot``'s rows."""
    fn, xs, idx = _flat_call("put", xs, cut)
    if slot.sharding != cut.sharding:
        slot = jax.device_put(slot, cut.sharding)
    return list(fn(*xs, slot, idx))


def flat_hlo(kind: str, xs: Sequence[Any], cut: FlatCut, slot: Any = None) -> str:
    """The compiled HLO text of :func:`take_flat` (``"take"``) or :func:`put_flat`."""
    fn, xs, idx = _flat_call(kind, xs, cut)
    args = (*xs, idx) if kind == "take" else (*xs, slot, idx)
    return fn.lower(*args).compile().as_text()


def _replicated_like(sharding, value):
    if isinstance(sharding, NamedSharding):
        return jax.device_put(value, NamedSharding(sharding.mesh, P()))
    if is_single_device(sharding):
        return jax.device_put(value, sharding)
    return value


def _local_index(x, plan: np.ndarray, axis: int, layer: int | None):
    sharding = x.sharding
    spec = _spec(sharding, x.ndim)
    idx_spec = P(spec[axis], None if layer is None else spec[layer], None)
    idx_sharding = NamedSharding(sharding.mesh, idx_spec)
    idx = jax.make_array_from_callback(plan.shape, idx_sharding, lambda i: plan[i])
    return idx, idx_spec


def _take_call(x, held, axis, layer):
    plan = local_plan(x, held, axis, layer)
    if plan is not None:
        idx, idx_spec = _local_index(x, plan, axis, layer)
        fn = _local_program("take", x.sharding.mesh, x.sharding.spec, idx_spec, axis, layer)
        return fn, (x, idx), {}
    out = slot_sharding(x, axis)
    idx = _replicated_like(out, jnp.asarray(held, jnp.int32))
    return _program(_take, out), (x, idx), {"axis": axis, "layer": layer}


def take(x: jax.Array, held: np.ndarray, axis: int, layer: int | None) -> jax.Array:
    """The held experts of ``x`` (``held``: int [layers, K], rows sorted)."""
    fn, args, kw = _take_call(x, held, axis, layer)
    return fn(*args, **kw)


def take_hlo(x: jax.Array, held: np.ndarray, axis: int, layer: int | None) -> str:
    """The compiled HLO text of the program :func:`take` runs (tests look for collectives)."""
    fn, args, kw = _take_call(x, held, axis, layer)
    return fn.lower(*args, **kw).compile().as_text()


def _put_call(x, slot, held, axis, layer):
    plan = local_plan(x, held, axis, layer)
    if plan is not None:
        if slot.sharding != x.sharding:
            slot = jax.device_put(slot, x.sharding)
        idx, idx_spec = _local_index(x, plan, axis, layer)
        fn = _local_program("put", x.sharding.mesh, x.sharding.spec, idx_spec, axis, layer)
        return fn, (x, slot, idx), {}
    sharding = getattr(x, "sharding", None)
    if not (isinstance(sharding, NamedSharding) or is_single_device(sharding)):
        sharding = None
    s_sh = slot_sharding(x, axis)
    if s_sh is not None:
        slot = jax.device_put(slot, s_sh)
    idx = _replicated_like(sharding, jnp.asarray(held, jnp.int32))
    return _program(_put, sharding), (x, slot, idx), {"axis": axis, "layer": layer}


def put(x: jax.Array, slot: jax.Array, held: np.ndarray, axis: int,
        layer: int | None) -> jax.Array:
    """``x`` with its held experts replaced by ``slot`` (same sharding as ``x``)."""
    fn, args, kw = _put_call(x, slot, held, axis, layer)
    return fn(*args, **kw)


def put_hlo(x: jax.Array, slot: jax.Array, held: np.ndarray, axis: int,
            layer: int | None) -> str:
    """The compiled HLO text of the program :func:`put` runs."""
    fn, args, kw = _put_call(x, slot, held, axis, layer)
    return fn.lower(*args, **kw).compile().as_text()


def expert_slices(slot: jax.Array, axis: int, layer: int | None) -> jax.Array:
    """A slot in canonical layout ``[K, L, ...]``."""
    return _canon(slot, axis, layer)


def from_canonical(c: jax.Array, axis: int, layer: int | None) -> jax.Array:
    """Inverse of :func:`expert_slices` for a full ``[N, L, ...]`` stack."""
    return _uncanon(c, axis, layer)
