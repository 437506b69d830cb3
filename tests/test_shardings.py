"""Single-device shardings through ``orbax_lossy.shardings`` (jax 0.12 deprecates the class)."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from orbax_lossy.shardings import is_single_device, single_device_sharding


def test_single_device_sharding_holds_an_array_whole_on_its_device() -> None:
    device = jax.devices()[0]
    sharding = single_device_sharding(device)
    assert is_single_device(sharding)
    assert sharding.device_set == {device}
    x = jax.device_put(np.arange(6, dtype=np.float32).reshape(2, 3), sharding)
    assert x.sharding == sharding
    np.testing.assert_array_equal(np.asarray(x), np.arange(6).reshape(2, 3))
    assert is_single_device(jnp.ones(3).sharding)  # what a plain array on a device has


def test_memory_kind_is_kept() -> None:
    device = jax.devices()[0]
    kind = device.default_memory().kind
    assert single_device_sharding(device, memory_kind=kind).memory_kind == kind


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
