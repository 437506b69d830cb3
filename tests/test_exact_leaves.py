"""Exact leaves through the handler: every dtype JAX uses, 0-d and empty arrays, NaN deltas."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import orbax_lossy as ol
from orbax_lossy.format.manifest import read_manifest_body as read_manifest


def bits(x) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype == np.bool_:
        return a.view(np.uint8)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind in "fc" or a.dtype.name == "bfloat16" \
        else a


def test_every_dtype_round_trips_bit_for_bit(tmp_path) -> None:
    rng = np.random.default_rng(0)
    state = {
        "f32": jnp.asarray(rng.standard_normal((7, 5)), jnp.float32),
        "bf16": jnp.asarray(rng.standard_normal((9,)), jnp.bfloat16),
        "f16": jnp.asarray(rng.standard_normal((3, 3)), jnp.float16),
        "f64_numpy": rng.standard_normal(4),
        "c64": jnp.asarray(rng.standard_normal(4) + 1j * rng.standard_normal(4), jnp.complex64),
        "i8": jnp.asarray(rng.integers(-128, 127, 10), jnp.int8),
        "u8": jnp.asarray(rng.integers(0, 255, 10), jnp.uint8),
        "i16": jnp.asarray(rng.integers(-3000, 3000, 10), jnp.int16),
        "u32": jnp.asarray(rng.integers(0, 2**32 - 1, 10, dtype=np.uint64), jnp.uint32),
        "i64_numpy": rng.integers(-(2**62), 2**62, 6),
        "bool": jnp.asarray(rng.random(11) > 0.5),
        "scalar0d": jnp.asarray(3.5, jnp.float32),
        "int0d": jnp.asarray(7, jnp.int32),
        "empty": jnp.zeros((0, 4), jnp.float32),
        "empty_int": jnp.zeros((3, 0), jnp.int32),
        "key": jax.random.key(42),
        "raw_key": jax.random.PRNGKey(1),
        "specials": jnp.asarray([np.nan, -np.inf, np.inf, -0.0, 1e-40], jnp.float32),
        "py_int": 5,
        "py_float": 0.25,
        "py_bool": True,
    }
    # Every leaf exact by policy (the default's bases code float parameters with Cluster(8)).
    mngr = ol.checkpoint_manager(tmp_path, max_to_keep=None, policy=ol.LeafPolicy.lossless())
    mngr.save(0, args=ol.LossySave(state))
    mngr.wait_until_finished()
    restored = ol.checkpoint_manager(tmp_path).restore(0)
    for name, want in state.items():
        got = restored[name]
        if name == "key":
            assert jax.random.key_impl(got) == jax.random.key_impl(want)
            np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))
            continue
        if isinstance(want, (int, float, bool)):
            assert type(got) is type(want) and got == want, name
            continue
        assert got.shape == want.shape and got.dtype == want.dtype, name
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=name)


def test_non_finite_delta_is_stored_exactly(tmp_path) -> None:
    """A leaf whose delta holds NaN/Inf is stored exactly for that save (never garbage)."""
    w = jnp.linspace(-1, 1, 256, dtype=jnp.float32)
    handler = ol.LossyCheckpointHandler(ol.LeafPolicy.params_only())
    mngr = ol.checkpoint_manager(tmp_path, handler=handler, max_to_keep=None)
    mngr.save(0, args=ol.LossySave({"w": w, "v": w}))
    mngr.wait_until_finished()
    bad = w.at[3].set(jnp.nan).at[7].set(jnp.inf)
    mngr.save(1, args=ol.LossySave({"w": bad, "v": w + 1e-3}))
    mngr.wait_until_finished()
    manifest = read_manifest(tmp_path / "1" / "default")
    codecs = {leaf["path"][0][1]: leaf["codec"]["id"] for leaf in manifest["leaves"]}
    assert manifest["kind"] == "delta"
    assert codecs == {"w": "exact", "v": "lc"}
    got = ol.checkpoint_manager(tmp_path).restore(1)
    np.testing.assert_array_equal(bits(got["w"]), bits(bad))
    np.testing.assert_array_equal(bits(got["w"]), bits(handler.reference.values[1]))
    # the next save from a non-finite reference is exact again, then the chain goes on
    mngr.save(2, args=ol.LossySave({"w": w, "v": w}))
    mngr.wait_until_finished()
    got2 = ol.checkpoint_manager(tmp_path).restore(2)
    np.testing.assert_array_equal(bits(got2["w"]), bits(w))
