"""Uniform quantizer: the half-step bound, constant leaves, dtypes, and policies pick it up."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orbax_lossy as ol
from orbax_lossy.codecs.base import codec_config
from orbax_lossy.policy import LeafPolicy, leaf_role

MU = (("key", "opt_state"), ("key", "mu"), ("key", "w"))


def encode(codec: ol.Uniform, value: jax.Array):
    return jax.jit(codec.device_encode)(value, None)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("bits", [1, 2, 5, 8])
def test_half_step_bound_and_exact_endpoints(bits: int, dtype) -> None:
    rng = np.random.default_rng(bits)
    x = jnp.asarray(rng.standard_normal((33, 17)) * 3 + 1, dtype)
    enc = encode(ol.Uniform(bits), x)
    v = np.asarray(x, np.float64)
    lo, hi = v.min(), v.max()
    err = np.abs(np.asarray(enc.recon, np.float64) - v)
    step = (hi - lo) / (2**bits - 1)
    narrow = 2 if np.dtype(dtype).itemsize < 4 else 1
    assert err.max() <= narrow * (step / 2 + 1e-6 * max(abs(lo), abs(hi)))
    book = np.asarray(enc.side["codebook"], np.float64)
    assert book.shape == (2**bits,) and book[0] == lo and book[-1] == hi
    assert int(np.asarray(enc.fields["sym"]).max()) < 2**bits
    # the extremes decode exactly
    recon = np.asarray(enc.recon, np.float64)
    assert recon[v == lo].tolist() == [lo] * int((v == lo).sum())
    assert recon[v == hi].tolist() == [hi] * int((v == hi).sum())


def test_constant_and_tiny_leaves_decode_exactly() -> None:
    for x in (jnp.full((5, 4), 0.25, jnp.float32), jnp.zeros((3,), jnp.bfloat16),
              jnp.asarray([7.0], jnp.float16)):
        enc = encode(ol.Uniform(3), x)
        np.testing.assert_array_equal(np.asarray(enc.recon), np.asarray(x))
        assert not np.asarray(enc.fields["sym"]).any()


def test_parameters_and_config() -> None:
    assert codec_config(ol.Uniform(4)) == {"id": "uniform", "bits": 4}
    assert not ol.Uniform().needs_reference and ol.Uniform().lossy
    for bad in (0, 9, 2.0, True):
        with pytest.raises(ol.CodecError):
            ol.Uniform(bad)
    with pytest.raises(ol.CodecError):
        encode(ol.Uniform(4), jnp.arange(4))


def test_leaf_policy_rule_picks_uniform_on_base_and_delta_saves() -> None:
    policy = LeafPolicy.create(rules=[("role:first_moment", ol.Uniform(4))])
    mu = jnp.ones((8, 8), jnp.float32)
    for is_base in (True, False):
        assert policy.plan([MU], [mu], [None if is_base else mu], is_base) == [ol.Uniform(4)]


def test_adaptive_policy_prices_uniform_by_a_measured_trial() -> None:
    rng = np.random.default_rng(0)
    mu = jnp.asarray(rng.uniform(-1e-3, 1e-3, (64, 64)), jnp.float32)
    policy = ol.AdaptivePolicy.create(
        {"first_moment": 0.1}, candidates={"first_moment": [ol.Uniform(4), ol.Uniform(8)]}
    )
    # uniform values: 4 bits give ~7% error (step / sqrt(12) of a 1/sqrt(3) RMS), under
    # budget and cheaper than 8 bits
    assert policy.plan([MU], [mu], [None], is_base=True) == [ol.Uniform(4)]
    assert policy.plan([MU], [mu], [mu * 0.9], is_base=False) == [ol.Uniform(4)]
    strict = ol.AdaptivePolicy.create(
        {"first_moment": 0.01}, candidates={"first_moment": [ol.Uniform(4), ol.Uniform(8)]}
    )
    assert strict.plan([MU], [mu], [None], is_base=True) == [ol.Uniform(8)]


def test_uniform_first_moments_through_the_handler(tmp_path) -> None:
    rng = np.random.default_rng(1)
    state = {"params": {"w": jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)},
             "opt_state": {"mu": {"w": jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)}}}
    # exact parameter bases (the default codes them with Cluster(8)): params are the control
    policy = LeafPolicy.create(rules=[("role:first_moment", ol.Uniform(6))],
                               base_defaults={"param": ol.Exact()})
    mngr = ol.checkpoint_manager(tmp_path, policy=policy)
    mngr.save(0, args=ol.LossySave(state))
    mngr.wait_until_finished()
    restored = ol.checkpoint_manager(tmp_path).restore(0)
    np.testing.assert_array_equal(np.asarray(restored["params"]["w"]),
                                  np.asarray(state["params"]["w"]))
    mu = np.asarray(state["opt_state"]["mu"]["w"])
    got = np.asarray(restored["opt_state"]["mu"]["w"])
    assert 0 < np.abs(got - mu).max() <= (mu.max() - mu.min()) / (2 * 63) * (1 + 1e-5)
    mngr.close()


def test_nonfloat_role_and_the_deprecated_integer_alias() -> None:
    assert leaf_role((("key", "step"),), np.dtype(np.int32)) == "nonfloat"
    assert leaf_role((("key", "flag"),), np.dtype(np.bool_)) == "nonfloat"
    assert leaf_role((("key", "z"),), np.dtype(np.complex64)) == "nonfloat"
    with pytest.warns(DeprecationWarning, match="nonfloat"):
        old = LeafPolicy.create(rules=[("role:integer", ol.Exact())])
    assert old.rules == (("role:nonfloat", ol.Exact()),)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LeafPolicy.create(rules=[("role:nonfloat", ol.Exact())])
    with pytest.raises(ol.InvalidArgumentError):
        LeafPolicy.create(rules=[("role:weights", ol.Exact())])
