"""Single-device shardings recognised through ``orbax_lossy.shardings`` (jax 0.12 deprecates
``jax.sharding.SingleDeviceSharding``)."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from orbax_lossy.shardings import is_single_device


def test_single_device_shardings_are_recognised() -> None:
    device = jax.devices()[0]
    assert is_single_device(jax.sharding.make_single_device_sharding(device))
    kind = device.default_memory().kind
    assert is_single_device(jax.sharding.make_single_device_sharding(device, memory_kind=kind))
    assert is_single_device(jnp.ones(3).sharding)  # what a plain array on a device has
    assert is_single_device(jax.device_put(np.ones(3), device).sharding)


def test_other_shardings_and_non_shardings_are_not_single_device() -> None:
    mesh = Mesh(np.array(jax.devices()), ("all",))
    assert not is_single_device(NamedSharding(mesh, PartitionSpec()))
    assert not is_single_device(None)
    assert not is_single_device("cpu:0")


def test_the_library_names_the_deprecated_class_in_one_place() -> None:
    # jax 0.12 deprecates jax.sharding.SingleDeviceSharding; a later jax removes it
    root = pathlib.Path(__file__).resolve().parents[1] / "orbax_lossy"
    users = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                   if re.search(r"SingleDeviceSharding\b", p.read_text()))
    assert users == ["shardings.py"], users
