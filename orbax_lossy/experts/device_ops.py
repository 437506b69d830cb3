"""Cutting held experts out of a stacked leaf and putting reconstructions back, on device.

Layout: the expert axis ``a`` (and layer axis ``b``) stay where they are; a slot holds
``slot[.., j @ a, .., l @ b, ..] = x[.., held[l, j] @ a, .., l @ b, ..]``. The slot keeps the
leaf's sharding except along the expert axis (K held experts rarely divide the mesh axis).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def slot_sharding(x: jax.Array, axis: int):
    """The slot's sharding: the leaf's, with the expert axis unsharded (None: let XLA pick)."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = list(sharding.spec) + [None] * (x.ndim - len(sharding.spec))
        spec[axis] = None
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    return None


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


def _replicated_like(sharding, value):
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.device_put(value, jax.sharding.NamedSharding(sharding.mesh,
                                                                jax.sharding.PartitionSpec()))
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return jax.device_put(value, sharding)
    return value


def take(x: jax.Array, held: np.ndarray, axis: int, layer: int | None) -> jax.Array:
    """The held experts of ``x`` (``held``: int [layers, K])."""
    out = slot_sharding(x, axis)
    idx = _replicated_like(out, jnp.asarray(held, jnp.int32))
    return _program(_take, out)(x, idx, axis=axis, layer=layer)


def put(x: jax.Array, slot: jax.Array, held: np.ndarray, axis: int,
        layer: int | None) -> jax.Array:
    """``x`` with its held experts replaced by ``slot`` (same sharding as ``x``)."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, (jax.sharding.NamedSharding, jax.sharding.SingleDeviceSharding)):
        sharding = None
    s_sh = slot_sharding(x, axis)
    if s_sh is not None:
        slot = jax.device_put(slot, s_sh)
    idx = _replicated_like(sharding, jnp.asarray(held, jnp.int32))
    return _program(_put, sharding)(x, slot, idx, axis=axis, layer=layer)


def expert_slices(slot: jax.Array, axis: int, layer: int | None) -> jax.Array:
    """A slot in canonical layout ``[K, L, ...]``."""
    return _canon(slot, axis, layer)


def from_canonical(c: jax.Array, axis: int, layer: int | None) -> jax.Array:
    """Inverse of :func:`expert_slices` for a full ``[N, L, ...]`` stack."""
    return _uncanon(c, axis, layer)
