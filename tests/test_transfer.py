"""Device-to-host copies of coded fields (engine/transfer.py).

On an accelerator, uint8 fields cross as uint32 words into pinned host memory; the CPU
backend has pinned memory too, so ``ORBAX_LOSSY_TRANSFER=force`` runs that path here and the
tests compare it with the plain copy, value for value and file byte for byte.
"""

from __future__ import annotations

import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orbax_lossy as ol
from orbax_lossy.engine import transfer


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv(transfer.TRANSFER_ENV, "force")
    monkeypatch.setattr(transfer, "MIN_PACKED_BYTES", 0)


@pytest.mark.parametrize("shape,dtype", [
    ((64, 256), jnp.uint8),      # packed: last axis a multiple of 4
    ((3, 5, 8), jnp.uint8),      # packed, 3-D
    ((7, 6), jnp.uint8),         # not packable: pinned copy of the bytes
    ((12,), jnp.uint8),
    ((0, 4), jnp.uint8),         # empty
    ((33, 40), jnp.float32),
    ((5,), jnp.bfloat16),
])
def test_host_copy_returns_the_same_values(forced, shape, dtype):
    size = int(np.prod(shape))
    x = jnp.asarray((np.arange(size, dtype=np.uint64) * 2654435761 % 251).reshape(shape), dtype)
    copy = transfer.HostCopy(x)
    host = copy.result()
    assert host.shape == shape and host.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(host, np.asarray(x))
    packed = dtype == jnp.uint8 and shape[-1] % 4 == 0 and size
    assert (copy._value.dtype == jnp.uint32) == bool(packed)
    assert copy._value.sharding.memory_kind == "pinned_host"


def test_plain_mode_and_cpu_default_copy_directly(monkeypatch):
    x = jnp.ones((64, 64), jnp.uint8)
    for mode in ("plain", "auto"):  # auto on the CPU backend: no pack, no pinned put
        monkeypatch.setenv(transfer.TRANSFER_ENV, mode)
        copy = transfer.HostCopy(x)
        assert copy._value is x
        np.testing.assert_array_equal(copy.result(), np.ones((64, 64), np.uint8))


def _save_chain(root: str, states: list) -> list:
    mngr = ol.checkpoint_manager(root, policy=ol.LeafPolicy.create(
        defaults={"first_moment": ol.LC(3), "second_moment": ol.LC(3, domain="log")}))
    for step, state in enumerate(states):
        mngr.save(step, args=ol.LossySave(state))
        mngr.wait_until_finished()
    out = mngr.restore(len(states) - 1, args=ol.LossyRestore(states[0]))
    mngr.close()
    return out


def test_packed_pinned_saves_write_the_same_files(tmp_path, monkeypatch):
    key = jax.random.key(0)
    w = 0.05 * jax.random.normal(key, (256, 512), jnp.float32)
    states = []
    for step in range(3):
        g = 1e-3 * jax.random.normal(jax.random.fold_in(key, step), w.shape, jnp.float32)
        states.append({"params": {"w": w, "odd": w[:, :37]},
                       "opt_state": {"mu": g, "nu": jnp.square(g)}})
        w = w - g
    restored = {}
    for mode in ("plain", "force"):
        monkeypatch.setenv(transfer.TRANSFER_ENV, mode)
        monkeypatch.setattr(transfer, "MIN_PACKED_BYTES", 0)
        restored[mode] = _save_chain(str(tmp_path / mode), states)
    for step in range(3):
        files = sorted(glob.glob(str(tmp_path / "plain" / str(step) / "*" / "data.*")))
        assert files
        for path in files:
            twin = path.replace(os.sep + "plain" + os.sep, os.sep + "force" + os.sep)
            with open(path, "rb") as a, open(twin, "rb") as b:
                assert a.read() == b.read(), path
    jax.tree.map(np.testing.assert_array_equal, restored["plain"], restored["force"])


def test_upload_through_words_matches_the_plain_upload(forced):
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    rng = np.random.default_rng(1)
    for shape in ((64, 256), (2, 3, 8), (7, 6), (10,)):
        host = rng.integers(0, 256, shape, dtype=np.uint8)
        calls = []

        def callback(index, host=host, calls=calls):
            calls.append(index)
            return host[index]

        out = transfer.upload(shape, np.uint8, sharding, callback)
        assert out.shape == shape and out.dtype == jnp.uint8 and out.sharding == sharding
        np.testing.assert_array_equal(np.asarray(out), host)
        packed = shape[-1] % 4 == 0
        assert transfer._uploads_words(shape, np.dtype(np.uint8), sharding) == packed


def test_restore_through_words_is_bit_identical(tmp_path, monkeypatch):
    key = jax.random.key(3)
    w = 0.05 * jax.random.normal(key, (128, 256), jnp.float32)
    states = [{"w": w + 1e-3 * step * jnp.sin(w * (step + 1))} for step in range(4)]
    out = {}
    for mode in ("plain", "force"):
        monkeypatch.setenv(transfer.TRANSFER_ENV, mode)
        monkeypatch.setattr(transfer, "MIN_PACKED_BYTES", 0)
        out[mode] = _save_chain(str(tmp_path / mode), states)
    np.testing.assert_array_equal(np.asarray(out["plain"]["w"]), np.asarray(out["force"]["w"]))
    assert float(jnp.max(jnp.abs(out["force"]["w"] - states[-1]["w"]))) < 1e-2


SHARDED = r"""
import os, sys, json
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import orbax_lossy as ol
from orbax_lossy.engine import transfer
transfer.MIN_PACKED_BYTES = 0
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
packed = {}
rng = np.random.default_rng(0)
for shape, spec in [((16, 64), P("a", "b")), ((16, 12), P("a", "b")), ((8, 16), P(None, "b")),
                    ((16, 8), P("a")), ((10, 32), P(None, ("a", "b")))]:
    sharding = NamedSharding(mesh, spec)
    host = rng.integers(0, 256, shape, dtype=np.uint8)
    os.environ[transfer.TRANSFER_ENV] = "force"
    out = transfer.upload(shape, np.uint8, sharding, lambda i, h=host: h[i])
    assert out.sharding == sharding, (shape, spec)
    np.testing.assert_array_equal(np.asarray(out), host)
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), host[shard.index])
    packed[str(shape)] = transfer._uploads_words(shape, np.dtype(np.uint8), sharding)
restored = {}
for mode in ("plain", "force"):
    os.environ[transfer.TRANSFER_ENV] = mode
    w = jax.device_put(0.05 * jax.random.normal(jax.random.key(0), (64, 128)),
                       NamedSharding(mesh, P("a", "b")))
    mngr = ol.checkpoint_manager(os.path.join(sys.argv[1], mode))
    for step in range(3):
        mngr.save(step, args=ol.LossySave({"w": w}))
        mngr.wait_until_finished()
        w = w + 1e-3 * jnp.cos(w * (step + 2))
    target = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.sharding)}
    restored[mode] = np.asarray(mngr.restore(2, args=ol.LossyRestore(target))["w"])
    mngr.close()
np.testing.assert_array_equal(restored["plain"], restored["force"])
print(json.dumps(packed))
"""


def test_sharded_transfers_on_eight_devices(tmp_path, run_cpu_script):
    import json

    packed = json.loads(run_cpu_script(["-c", SHARDED, str(tmp_path)]).strip().splitlines()[-1])
    # whole words per shard: packed; 12 columns over 2 shards (6 bytes each): plain bytes
    assert packed == {"(16, 64)": True, "(16, 12)": False, "(8, 16)": True,
                      "(16, 8)": True, "(10, 32)": True}
