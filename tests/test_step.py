"""Step quantizer: the half-step bound on every element (outliers too), its rate against
k-means at equal error, unchanged leaves, configs, and a closed-loop save/restore chain."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orbax_lossy as ol
from orbax_lossy.codecs.base import codec_config, encode_symbol_field


def encode(codec, value, reference=None):
    return jax.jit(codec.device_encode)(value, reference)


def heavy_tailed_delta(shape=(256, 512), seed=0):
    """A reference and a value whose delta is Student-t(3): the kurtosis of training deltas."""
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal(shape) * 0.05
    return (jnp.asarray(ref + 1e-3 * rng.standard_t(3, shape), jnp.float32),
            jnp.asarray(ref, jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rel", [0.05, 1.0, 3.0])
def test_half_step_bound_on_every_element(rel: float, dtype) -> None:
    value, ref = heavy_tailed_delta((64, 48), seed=int(rel * 100))
    value, ref = value.astype(dtype), ref.astype(dtype)
    enc = encode(ol.Step(rel), value, ref)
    v, r = np.asarray(value, np.float64), np.asarray(ref, np.float64)
    d = v - r
    step = float(np.asarray(enc.side["step"])[0])
    rms = np.sqrt(np.mean(np.square(np.asarray(value.astype(jnp.float32) - ref.astype(jnp.float32),
                                               np.float64))))
    amax = np.abs(d).max()
    assert step == pytest.approx(min(max(rel * rms, amax / 127), amax), rel=1e-5)
    err = np.abs(np.asarray(enc.recon, np.float64) - v)
    narrow = 2 if np.dtype(dtype).itemsize < 4 else 1
    assert err.max() <= narrow * (step / 2 * (1 + 1e-5) + 1e-6 * np.abs(v).max())
    sym = np.asarray(enc.fields["sym"]).astype(np.int64)
    assert sym.min() >= 1 and sym.max() <= 255


def test_an_outlier_widens_the_step_instead_of_being_clipped() -> None:
    value, ref = heavy_tailed_delta((256, 256))
    value = value.at[3, 7].add(1.0)  # ~230 rms of the delta: beyond 127 steps of rel * rms
    enc = encode(ol.Step(1.0), value, ref)
    step = float(np.asarray(enc.side["step"])[0])
    err = np.abs(np.asarray(enc.recon, np.float64) - np.asarray(value, np.float64))
    assert step == pytest.approx(float(value[3, 7] - ref[3, 7]) / 127, rel=1e-6)
    assert err.max() <= step / 2 * (1 + 1e-5)
    assert int(np.asarray(enc.fields["sym"])[3, 7]) == 255


def test_fewer_bytes_than_kmeans_at_no_larger_error() -> None:
    """The rate claim of the module docstring, on Student-t deltas, with the real coder."""
    value, ref = heavy_tailed_delta()
    d = np.asarray(value, np.float64) - np.asarray(ref, np.float64)

    def rate_and_error(codec):
        enc = encode(codec, value, ref)
        err = np.linalg.norm(np.asarray(enc.recon, np.float64) - np.asarray(value, np.float64))
        return len(encode_symbol_field(np.asarray(enc.fields["sym"]))), err / np.linalg.norm(d)

    cluster_bytes, cluster_err = rate_and_error(ol.Cluster(3, mode="delta"))
    step_bytes, step_err = rate_and_error(ol.Step(1.5))
    assert step_err <= cluster_err
    assert step_bytes < 0.85 * cluster_bytes
    # and at the bytes of Cluster(2), three quarters of its error or less
    cluster_bytes, cluster_err = rate_and_error(ol.Cluster(2, mode="delta"))
    step_bytes, step_err = rate_and_error(ol.Step(2.0))
    assert step_bytes <= cluster_bytes
    assert step_err < 0.75 * cluster_err


def test_light_tailed_and_scalar_leaves_are_never_frozen() -> None:
    """A uniform delta lies within 1.8 RMS and a scalar's within 1 RMS: ``rel * rms`` would put
    every element in the dead zone at every save; the ``amax`` ceiling moves the largest."""
    rng = np.random.default_rng(3)
    ref = jnp.asarray(rng.standard_normal((128, 128)), jnp.float32)
    value = ref + jnp.asarray(rng.uniform(-1e-2, 1e-2, ref.shape), jnp.float32)
    enc = encode(ol.Step(2.5), value, ref)
    d = np.asarray(value, np.float64) - np.asarray(ref, np.float64)
    assert float(np.asarray(enc.side["step"])[0]) == pytest.approx(np.abs(d).max(), rel=1e-5)
    err = np.asarray(enc.recon, np.float64) - np.asarray(value, np.float64)
    assert np.linalg.norm(err) < 0.55 * np.linalg.norm(d)  # sqrt(1/4) for a uniform delta
    scalar = encode(ol.Step(2.5), jnp.float32(1.25), jnp.float32(1.0))
    assert float(scalar.recon) == 1.25


def test_unchanged_leaf_and_direct_mode() -> None:
    value, ref = heavy_tailed_delta((10, 10))
    same = encode(ol.Step(2.0), ref, ref)
    np.testing.assert_array_equal(np.asarray(same.recon), np.asarray(ref))
    assert (np.asarray(same.fields["sym"]) == 128).all()
    zeros = encode(ol.Step(4.0, mode="direct"), jnp.zeros((7,), jnp.float32))
    np.testing.assert_array_equal(np.asarray(zeros.recon), np.zeros(7))
    direct = encode(ol.Step(0.5, mode="direct"), value)
    step = float(np.asarray(direct.side["step"])[0])
    assert np.abs(np.asarray(direct.recon) - np.asarray(value)).max() <= step / 2 * (1 + 1e-5)


def test_parameters_and_config() -> None:
    assert codec_config(ol.Step(2.5)) == {"id": "step", "rel": 2.5, "mode": "delta"}
    assert ol.Step().needs_reference and not ol.Step(mode="direct").needs_reference
    for bad in (0, -1.0, float("inf"), float("nan"), True, "2"):
        with pytest.raises(ol.CodecError):
            ol.Step(bad)
    with pytest.raises(ol.CodecError):
        ol.Step(2.0, mode="log")
    with pytest.raises(ol.CodecError):
        encode(ol.Step(mode="direct"), jnp.arange(4))
    with pytest.raises(ol.CodecError):
        encode(ol.Step(), jnp.ones(4), None)


def test_closed_loop_chain_restores_the_saved_reconstruction(tmp_path) -> None:
    """Deltas code against the previous reconstruction, so errors do not accumulate: after 6
    saves the restored value is within half a step of the last saved value."""
    policy = ol.LeafPolicy.create(defaults={"param": ol.Step(2.0)},
                                  base_defaults={"param": ol.Exact()})
    mngr = ol.checkpoint_manager(tmp_path, policy=policy, max_to_keep=None)
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    for step in range(6):
        w = w + (1e-3 * rng.standard_t(3, w.shape)).astype(np.float32)
        mngr.save(step, args=ol.LossySave({"w": jnp.asarray(w)}))
        mngr.wait_until_finished()
    mngr.close()
    fresh = ol.checkpoint_manager(tmp_path, policy=policy, max_to_keep=None)
    restored = np.asarray(fresh.restore(5, args=ol.LossyRestore())["w"], np.float64)
    fresh.close()
    manifest = ol.format.read_manifest(tmp_path / "5" / "default")
    (leaf,) = [entry for entry in manifest.leaves if entry.name == "w"]
    assert manifest.header.save_type == "delta" and leaf.codec == ol.Step(2.0)
    step = float(np.asarray(leaf.side["step"])[0])
    err = restored - w
    assert np.abs(err).max() <= step / 2 * (1 + 1e-5)  # the last delta's bound, chain included
    # closed loop: the error is that of one delta, not five accumulated
    assert np.sqrt(np.mean(np.square(err))) <= 1e-3 * np.sqrt(3.0)
