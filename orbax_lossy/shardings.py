"""Recognising single-device shardings across jax versions.

jax 0.12 deprecates ``jax.sharding.SingleDeviceSharding`` (reading the attribute warns, and
JAX means to describe one device by a ``NamedSharding`` later): it offers
``jax.sharding.make_single_device_sharding`` (also in jax 0.10, so the library calls it
directly) and ``jax.sharding.is_single_device_sharding`` (jax 0.12 only), which
:func:`is_single_device` stands in for on older jax.
"""

from __future__ import annotations

import jax


def is_single_device(sharding: object) -> bool:
    """Whether ``sharding`` is a single-device sharding (what
    ``jax.sharding.make_single_device_sharding`` makes, or ``jax.device_put`` onto a device
    gives)."""
    check = getattr(jax.sharding, "is_single_device_sharding", None)
    if check is not None:
        return bool(check(sharding))
    return isinstance(sharding, jax.sharding.SingleDeviceSharding)
