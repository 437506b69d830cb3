"""Single-device shardings across jax versions.

jax 0.12 deprecates ``jax.sharding.SingleDeviceSharding`` (reading the attribute warns, and
JAX means to describe one device by a ``NamedSharding`` later): it offers
``jax.sharding.make_single_device_sharding`` (also in jax 0.10) and
``jax.sharding.is_single_device_sharding`` (jax 0.12) instead. The library builds and tests
such shardings through these two functions only, so no jax it supports warns.
"""

from __future__ import annotations

import jax


def single_device_sharding(device: jax.Device, memory_kind: str | None = None
                           ) -> jax.sharding.Sharding:
    """The sharding of an array held whole on ``device`` (in ``memory_kind``, else the
    device's default memory)."""
    return jax.sharding.make_single_device_sharding(device, memory_kind=memory_kind)


def is_single_device(sharding: object) -> bool:
    """Whether ``sharding`` is a single-device sharding (what :func:`single_device_sharding`
    makes, or ``jax.device_put`` onto a device gives)."""
    check = getattr(jax.sharding, "is_single_device_sharding", None)
    if check is not None:
        return isinstance(sharding, jax.sharding.Sharding) and bool(check(sharding))
    return isinstance(sharding, jax.sharding.SingleDeviceSharding)
