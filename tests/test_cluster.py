"""Cluster (k-means) codec: codebook decode, log domain for Adam nu, determinism, bounds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orbax_lossy.codecs import cluster
from orbax_lossy.codecs.base import codec_config, codec_from_config
from orbax_lossy.codecs.cluster import Cluster
from orbax_lossy.engine import device as program
from orbax_lossy.errors import CodecError, FormatError


def adam_nu(shape=(256, 384), steps: int = 30, seed: int = 0) -> np.ndarray:
    """A realistic second moment: EMA of squared gradients with per-row scales, some zeros."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(-5, 1.0, (shape[0], 1)))
    nu = np.zeros(shape)
    for _ in range(steps):
        g = rng.standard_normal(shape) * scale * np.exp(rng.normal(0, 0.3, shape))
        nu = 0.999 * nu + 0.001 * g**2
    nu[:2, :7] = 0.0  # e.g. embedding rows never touched yet
    return nu.astype(np.float32)


def round_trip(codec, value, reference=None, dtype=None):
    dtype = dtype or value.dtype
    enc = jax.jit(codec.device_encode)(value, reference)
    sym = np.asarray(enc.fields["sym"])
    data = codec.host_encode("sym", sym)
    back = codec.host_decode("sym", data, sym.shape, np.dtype(np.uint8))
    np.testing.assert_array_equal(back, sym)
    decoded = codec.device_decode({"sym": jnp.asarray(back)}, enc.side, reference, dtype)
    return enc, decoded, len(data)


def test_log_domain_nu_decodes_to_centroids_positive_and_bounded(assert_bitwise):
    nu = adam_nu()
    codec = Cluster(bits=8, domain="log")
    enc, decoded, nbytes = round_trip(codec, jnp.asarray(nu))
    assert_bitwise(decoded, enc.recon, "decode == recon")
    r = np.asarray(decoded)
    book = np.asarray(enc.side["codebook"])
    assert book.shape == (256,) and book[0] == 0
    assert np.all(np.isin(r, book.astype(np.float32)))  # every decoded value is a centroid
    zero = nu == 0
    assert np.all(r[zero] == 0) and np.all(r[~zero] > 0) and np.all(np.isfinite(r))
    # each element goes to its nearest centroid in the log domain
    logs = np.log(book[1:].astype(np.float64))
    lv = np.log(nu[~zero].astype(np.float64))
    best = np.min(np.abs(lv[:, None] - logs[None, :]), axis=1)
    assert np.all(np.abs(np.log(r[~zero]) - lv) <= best + 1e-5)
    rel = np.abs(r[~zero] - nu[~zero]) / nu[~zero]
    assert rel.mean() < 0.02 and rel.max() < 0.15
    assert np.linalg.norm(r - nu) / np.linalg.norm(nu) < 0.05
    assert nbytes < 0.3 * nu.nbytes


@pytest.mark.parametrize("bits,mean_bound", [(4, 0.35), (6, 0.08)])
def test_fewer_bits_larger_but_bounded_error(bits, mean_bound):
    nu = adam_nu(seed=1)
    _, decoded, _ = round_trip(Cluster(bits=bits, domain="log"), jnp.asarray(nu))
    r, nz = np.asarray(decoded), nu > 0
    assert np.all(r[nz] > 0)
    assert (np.abs(r[nz] - nu[nz]) / nu[nz]).mean() < mean_bound


def test_deterministic_across_runs_and_programs(assert_bitwise):
    nu = jnp.asarray(adam_nu(seed=2))
    codec = Cluster(bits=6, domain="log", sample=4096)  # subsampled fit
    a = jax.jit(codec.device_encode)(nu, None)
    b = codec.device_encode(nu, None)
    c = program.encode_tree([nu], [nu], plan=(codec,), shardings=(None,))[0]
    for other in (b, c):
        recon = other.recon if hasattr(other, "recon") else other["recon"]
        side = other.side if hasattr(other, "side") else other["side"]
        assert_bitwise(recon, a.recon, "recon")
        assert_bitwise(side["codebook"], a.side["codebook"], "codebook")


def test_bf16_nu_is_clamped_strictly_positive(assert_bitwise):
    nu = adam_nu((64, 64), seed=3)
    nu[5, :10] = 1e-44  # below bf16's smallest normal
    value = jnp.asarray(nu, jnp.bfloat16)
    enc, decoded, _ = round_trip(Cluster(bits=4, domain="log"), value)
    r = np.asarray(decoded.astype(jnp.float32))
    nz = np.asarray(value.astype(jnp.float32)) > 0
    assert decoded.dtype == jnp.bfloat16
    assert np.all(r[nz] >= float(jnp.finfo(jnp.bfloat16).tiny)) and np.all(r[~nz] == 0)
    assert_bitwise(decoded, enc.recon, "decode == recon")


def test_linear_direct_and_delta_modes(assert_bitwise):
    rng = np.random.default_rng(4)
    mu = jnp.asarray(rng.standard_normal((128, 96)) * 1e-3, jnp.float32)
    _, decoded, _ = round_trip(Cluster(bits=8), mu)
    m = np.asarray(mu)
    assert np.linalg.norm(np.asarray(decoded) - m) / np.linalg.norm(m) < 0.02
    ref = mu
    new = mu.at[:, ::3].add(jnp.asarray(rng.standard_normal((128, 32)) * 1e-4, jnp.float32))
    enc, decoded, _ = round_trip(Cluster(bits=6, mode="delta"), new, ref)
    assert_bitwise(decoded, enc.recon, "delta decode")
    unchanged = np.asarray(new) == np.asarray(ref)
    assert_bitwise(np.asarray(decoded)[unchanged], np.asarray(ref)[unchanged], "unchanged")
    d = np.asarray(new) - m
    assert np.linalg.norm(np.asarray(decoded) - np.asarray(new)) < 0.1 * np.linalg.norm(d)


def test_degenerate_leaves():
    for domain in ("linear", "log"):
        for value in (jnp.zeros((10, 3)), jnp.full((7,), 2.5), jnp.zeros((0,))):
            _, decoded, _ = round_trip(Cluster(bits=3, domain=domain), value)
            # exp(log(x)) is exact on CPU, within 1 ulp on GPU
            rtol = 0 if domain == "linear" else 2.5e-7
            np.testing.assert_allclose(np.asarray(decoded), np.asarray(value), rtol=rtol, atol=0)


def test_config_and_bad_parameters():
    for codec in (Cluster(), Cluster(bits=4, domain="log", iters=3, sample=512)):
        assert codec_from_config(codec_config(codec)) == codec
        assert codec.lossy and not codec.needs_reference  # direct: usable on base saves
    assert Cluster(mode="delta").needs_reference
    for kwargs in ({"bits": 0}, {"bits": 9}, {"domain": "sqrt"}, {"mode": "x"},
                   {"domain": "log", "mode": "delta"}, {"sample": 4}):
        with pytest.raises(CodecError):
            Cluster(**kwargs)
    with pytest.raises(FormatError, match="outside the alphabet"):  # corrupted stored symbols
        Cluster(bits=2).host_decode("sym", Cluster().host_encode("sym", np.full(4, 9, np.uint8)),
                                    (4,), np.dtype(np.uint8))


def test_direct_cluster_codes_base_saves_and_restores_from_the_newest_link(tmp_path):
    import orbax_lossy as ol

    rng = np.random.default_rng(5)
    nu = jnp.asarray(np.exp(rng.normal(size=(128, 64)) * 2), jnp.float32)
    w = jnp.asarray(rng.standard_normal((128, 64)), jnp.float32)
    # exact parameter bases (the default codes them with Cluster(8)): `w` is the exact control
    policy = ol.LeafPolicy.create(rules=[("nu", Cluster(6, domain="log"))],
                                  base_defaults={"param": ol.Exact()})
    mngr = ol.checkpoint_manager(tmp_path, policy=policy, base_interval=3, max_to_keep=None)
    for step in range(3):
        mngr.save(step, args=ol.LossySave({"w": w + step * 1e-3, "nu": nu * (1 + step / 10)}))
        mngr.wait_until_finished()
    rows = {r["path"]: r for r in ol.checkpoint_stats(tmp_path / "0" / "default")}
    assert rows["nu"]["codec"]["id"] == "cluster" and rows["w"]["codec"] == {"id": "exact"}
    assert 0 < rows["nu"]["rel_error"] < 0.2 and rows["nu"]["ratio"] > 3
    restored = mngr.restore(2, args=ol.LossyRestore())
    mngr.close()
    got = np.asarray(restored["nu"])
    assert got.min() > 0
    assert np.linalg.norm(got - nu * 1.2) / np.linalg.norm(nu * 1.2) < 0.2


def reference_assign(x: jax.Array, centroids: jax.Array) -> jax.Array:
    """``assign`` as it was before the compare-all rewrite (always a binary search)."""
    mids = (centroids[1:] + centroids[:-1]) * jnp.asarray(0.5, centroids.dtype)
    return jnp.searchsorted(mids, x, side="left").astype(jnp.int32)


@pytest.mark.parametrize("bits", [1, 2, 3, 6, 7, 8])
def test_encode_is_bit_identical_to_the_binary_search_assignment(bits, monkeypatch) -> None:
    """Symbols, codebook and reconstruction equal the encode with the reference assignment,
    in delta, direct and log modes, incl. zeros, ties and a single element."""
    from orbax_lossy.codecs import cluster as cluster_module

    rng = np.random.default_rng(bits)
    ref = rng.standard_normal((64, 64)).astype(np.float32)
    value = ref + 1e-3 * rng.standard_normal(ref.shape).astype(np.float32)
    value[0, :9] = ref[0, :9]  # zero deltas
    value[1, :5] = ref[1, :5] + 0.25  # ties
    codecs = [Cluster(bits, mode="delta", iters=4, sample=256), Cluster(bits, iters=4),
              Cluster(bits, domain="log", iters=4)]
    inputs = [(value, ref), (np.abs(value), None), (value[:1, :1], ref[:1, :1]),
              (np.zeros_like(value), ref)]
    for codec in codecs:
        for v, r in inputs:
            r = None if not codec.needs_reference else (ref[: v.shape[0], : v.shape[1]]
                                                        if r is None else r)
            run = jax.jit(codec.encode)
            with monkeypatch.context() as patch:
                new = jax.device_get(run(jnp.asarray(v), None if r is None else jnp.asarray(r)))
                patch.setattr(cluster_module, "assign", reference_assign)
                old = jax.device_get(jax.jit(codec.encode)(
                    jnp.asarray(v), None if r is None else jnp.asarray(r)))
            for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True):
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (codec, v.shape)


def test_assignment_falls_back_to_the_binary_search_on_unsorted_boundaries() -> None:
    """Non-finite centroids (unsorted or NaN boundaries) give the binary search's answer."""
    from orbax_lossy.codecs.cluster import assign

    x = jnp.asarray(np.random.default_rng(0).standard_normal(1000), jnp.float32)
    x = x.at[:3].set(jnp.asarray([0.0, -0.0, np.nan]))
    for c in ([-np.inf, np.inf, 1.0, 2.0], [np.nan, 0.0, 1.0], [-1.0, -0.0, 0.0, 0.0, 3.0],
              [0.0, 0.0, -0.0, 1.0], [-2.0, -1.0, 0.5, 4.0]):
        c = jnp.asarray(c, jnp.float32)
        new, old = jax.jit(lambda x, c: (assign(x, c), reference_assign(x, c)))(x, c)
        assert np.array_equal(np.asarray(new), np.asarray(old)), c


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_ascending_is_jnp_sort_bit_for_bit(dtype) -> None:
    """``cluster.ascending`` (integer keys: XLA:CPU's float sort is 4x slower) returns
    ``jnp.sort``'s array, infinities and repeated values included, batched too; NaNs sort
    last as with ``jnp.sort``."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 5000)).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 5000)
    x[:, ::7], x[:, 1::11], x[:, 2::13] = np.inf, -np.inf, 1.5
    finite = jnp.finfo(dtype)
    values = jnp.asarray(np.clip(x, float(finite.min), float(finite.max)), dtype)
    values = jnp.where(values == 0, jnp.asarray(1, dtype), values)  # fit samples hold no zero
    got, want = jax.jit(cluster.ascending)(values), jnp.sort(values, axis=-1)
    width = {2: np.uint16, 4: np.uint32}[values.dtype.itemsize]
    np.testing.assert_array_equal(np.asarray(got).view(width), np.asarray(want).view(width))
    with_nan = values.at[:, 5].set(jnp.nan).at[:, 9].set(-jnp.nan)
    got = np.asarray(cluster.ascending(with_nan), np.float32)
    assert np.isnan(got[:, -2:]).all() and not np.isnan(got[:, :-2]).any()
    np.testing.assert_array_equal(got[:, :-2], np.asarray(jnp.sort(with_nan, axis=-1),
                                                          np.float32)[:, :-2])


def _fit_cases() -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    cases = []
    for n in (0, 1, 5, 1000, 200_000):
        x = rng.standard_normal(n).astype(np.float32)
        zeros = x.copy()
        zeros[::7] = 0
        cases += [("normal", x), ("zeros", zeros), ("positive", np.abs(x) + 1e-3),
                  ("square", np.square(x))]
        if n > 3:
            for name, index, value in (("nan", 2, np.nan), ("negative zero", 1, -0.0),
                                       ("subnormal", 3, 1e-40), ("inf", 0, np.inf)):
                special = np.abs(x)
                special[index] = value
                cases.append((name, special))
    return cases


@pytest.mark.parametrize("domain", ["linear", "log"])
def test_fit_sample_with_plain_extremes_is_the_masked_fit_bit_for_bit(domain) -> None:
    """``everywhere_usable`` lets ``fit_sample`` take plain reductions for the extremes; the
    fitted values and their count are the masked reductions' own, bit for bit, whether every
    element is usable or not (zeros, -0.0, NaN, inf, subnormals, empty leaves)."""
    taken = set()
    for name, x in _fit_cases():
        xj = jnp.asarray(x)
        t, usable = cluster.coded_domain(xj, domain)
        every = cluster.everywhere_usable(xj, domain)
        taken.add(bool(every))
        masked = jax.jit(lambda t, u: cluster.fit_sample(t, u, 512, jnp.asarray(False)))(
            t, usable)
        plain = jax.jit(lambda t, u, e: cluster.fit_sample(t, u, 512, e))(t, usable, every)
        for a, b in zip(masked, plain, strict=True):
            assert np.atleast_1d(np.asarray(a)).tobytes() == np.atleast_1d(
                np.asarray(b)).tobytes(), (domain, name, x.size)
        if x.size and domain == "linear" and name in ("zeros", "negative zero"):
            assert not bool(every)
    assert taken == {True, False}  # both branches were exercised
