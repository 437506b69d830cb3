"""LC-Checkpoint codec: bucket bounds, closed loop, bit-identical decode, one compiled program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orbax_lossy.codecs import lc
from orbax_lossy.codecs.exact import Exact
from orbax_lossy.codecs.lc import LC, promote
from orbax_lossy.demo import training_run
from orbax_lossy.engine import device as program


def check_bounds(delta: np.ndarray, symbols: np.ndarray, reps: np.ndarray, bits: int) -> None:
    """The three guarantees of the exponent quantizer, on one delta array."""
    delta = delta.astype(np.float64).reshape(-1)
    symbols = symbols.reshape(-1)
    assert symbols.max(initial=0) < 2**bits
    assert reps[0] == 0
    decoded = reps[symbols].astype(np.float64)
    kept = symbols > 0
    # kept elements decode within their bucket: relative error < 50%, same sign
    if kept.any():
        rel = np.abs(decoded[kept] - delta[kept]) / np.abs(delta[kept])
        assert rel.max() < 0.5
        assert np.all(np.sign(decoded[kept]) == np.sign(delta[kept]))
        # every kept element shares its bucket (sign, exponent) with its representative
        assert np.all(np.frexp(decoded[kept])[1] == np.frexp(delta[kept])[1])
    # every dropped element is smaller than every kept bucket's lower edge (bits >= 2)
    dropped = ~kept & (delta != 0)
    if kept.any() and dropped.any() and bits >= 2:
        lower_edge = np.min(2.0 ** (np.frexp(delta[kept])[1] - 1))
        assert np.abs(delta[dropped]).max() < lower_edge
    if bits == 1 and kept.any() and dropped.any():
        sign = np.sign(decoded[kept][0])
        same = dropped & (np.sign(delta) == sign)
        if same.any():
            assert np.abs(delta[same]).max() < np.min(2.0 ** (np.frexp(delta[kept])[1] - 1))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_bounds_on_random_deltas(bits: int, dtype) -> None:
    rng = np.random.default_rng(bits)
    scale = np.exp(rng.normal(size=20_000) * 2)
    delta = (rng.standard_normal(20_000) * 1e-3 * scale).astype(np.float32)
    delta[rng.random(20_000) < 0.1] = 0.0
    delta = np.asarray(jnp.asarray(delta, dtype).astype(jnp.float32))
    symbols, reps = jax.jit(promote, static_argnums=1)(jnp.asarray(delta), bits)
    symbols, reps = np.asarray(symbols), np.asarray(reps)
    check_bounds(delta, symbols, reps, bits)
    # alphabet: at most 2**bits symbols, zero included; all are used when data allows
    assert len(np.unique(symbols)) <= 2**bits
    # zero deltas always map to symbol 0
    assert np.all(symbols[np.abs(delta) < np.finfo(np.float32).tiny] == 0)


def test_bounds_on_real_training_deltas() -> None:
    states = [s.params for step, s in training_run(40, "adamw") if step in (10, 20, 40)]
    for bits in (2, 3, 4):
        for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[2]), strict=True):
            delta = np.asarray(b - a)
            symbols, reps = jax.jit(promote, static_argnums=1)(jnp.asarray(delta), bits)
            check_bounds(delta, np.asarray(symbols), np.asarray(reps), bits)


def test_midrange_representative_is_paper_choice() -> None:
    delta = jnp.asarray([1.0, 1.5, 1.75, -3.0, -2.5, 0.0], jnp.float32)
    symbols, reps = promote(delta, 3)
    decoded = np.asarray(reps)[np.asarray(symbols)]
    # bucket [1, 2): min 1, max 1.75 -> 1.375; bucket (-4, -2]: -(3 + 2.5) / 2
    np.testing.assert_array_equal(decoded, [1.375, 1.375, 1.375, -2.75, -2.75, 0.0])


def test_all_zero_and_tiny_leaves() -> None:
    for delta in (jnp.zeros((0,)), jnp.zeros((5,)), jnp.asarray(3.0), jnp.asarray([1e-45])):
        symbols, reps = promote(delta.astype(jnp.float32), 3)
        assert symbols.shape == delta.shape
        decoded = np.asarray(reps)[np.asarray(symbols)]
        normal = np.abs(np.asarray(delta)) >= np.finfo(np.float32).tiny
        # normal deltas keep their sign; zeros and subnormals decode to 0
        assert np.all(np.sign(decoded[normal]) == np.sign(np.asarray(delta)[normal]))
        assert np.all(decoded[~normal] == 0)


def encode_decode(values, refs, codecs):
    shardings = tuple(v.sharding for v in values)
    out = program.encode_tree(values, refs, plan=tuple(codecs), shardings=shardings)
    fields = [
        {k: jnp.asarray(c.host_decode(k, c.host_encode(k, np.asarray(v)), v.shape, v.dtype))
         for k, v in o["fields"].items()}
        for o, c in zip(out, codecs, strict=True)
    ]
    sides = [
        {k: jnp.asarray(np.asarray(v)) for k, v in o["side"].items()} for o in out
    ]
    decoded = program.decode_tree(
        fields, sides, refs, plan=tuple(codecs),
        dtypes=tuple(np.dtype(v.dtype) for v in values), shardings=shardings,
    )
    return out, decoded


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_closed_loop_decode_is_bit_identical_to_returned_reconstruction(dtype) -> None:
    rng = np.random.default_rng(0)
    reference = jnp.asarray(rng.standard_normal((64, 33)), dtype)
    recon = reference
    for _ in range(5):
        value = (recon.astype(jnp.float32) + 1e-2 * rng.standard_normal((64, 33))).astype(dtype)
        out, decoded = encode_decode([value], [recon], [LC(3)])
        returned = out[0]["recon"]
        assert returned.dtype == value.dtype
        np.testing.assert_array_equal(
            np.asarray(decoded[0]).view(np.uint16 if dtype != jnp.float32 else np.uint32),
            np.asarray(returned).view(np.uint16 if dtype != jnp.float32 else np.uint32),
        )
        recon = returned


def test_closed_loop_error_does_not_accumulate() -> None:
    """Deltas against the reconstruction keep the error bounded over many saves."""
    rng = np.random.default_rng(1)
    value = jnp.asarray(rng.standard_normal(10_000), jnp.float32)
    recon = value
    errors = []
    for _ in range(30):
        value = value + jnp.asarray(1e-3 * rng.standard_normal(10_000), jnp.float32)
        out, _ = encode_decode([value], [recon], [LC(3)])
        recon = out[0]["recon"]
        errors.append(float(jnp.abs(recon - value).max()))
    assert max(errors[10:]) < 3 * max(errors[:10])


def test_one_program_for_the_whole_tree_and_no_recompile() -> None:
    rng = np.random.default_rng(2)
    shapes = [(32, 16), (16,), (8, 8, 4), ()]
    values = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]
    refs = [v + 0.01 for v in values]
    plan = tuple([LC(3)] * len(shapes))
    shardings = tuple(v.sharding for v in values)
    program.encode_tree.clear_cache()
    with jax.log_compiles(False):
        program.encode_tree(values, refs, plan=plan, shardings=shardings)
        assert program.encode_tree._cache_size() == 1
        values2 = [v * 2 for v in values]
        program.encode_tree(values2, refs, plan=plan, shardings=shardings)
        # Same shapes, dtypes, shardings and codecs: no new compilation.
        assert program.encode_tree._cache_size() == 1
        # A different codec parameter is a new program (and is cached too).
        program.encode_tree(values2, refs, plan=tuple([LC(4)] * 4), shardings=shardings)
        assert program.encode_tree._cache_size() == 2


def test_whole_tree_is_one_dispatch() -> None:
    """The encode program is one XLA computation regardless of the number of leaves."""
    values = [jnp.ones((4, 4)) * i for i in range(6)]
    refs = [v * 0 for v in values]
    lowered = program.encode_tree.lower(
        values, refs, plan=tuple([LC(3)] * 6), shardings=tuple(v.sharding for v in values)
    )
    text = lowered.as_text()
    assert text.count("func.func public @main") == 1


def test_non_finite_delta_flags_leaf_and_keeps_value() -> None:
    value = jnp.asarray([1.0, jnp.nan, 3.0], jnp.float32)
    ref = jnp.zeros(3, jnp.float32)
    out = program.encode_tree(
        [value, value + 0], [ref, None], plan=(LC(3), Exact()),
        shardings=(value.sharding, value.sharding),
    )
    assert not bool(out[0]["safe"])
    np.testing.assert_array_equal(np.asarray(out[0]["recon"]), np.asarray(value))


def test_handler_saves_do_not_recompile(tmp_path, monkeypatch) -> None:
    """Deltas of a tree with unchanged shapes/dtypes/shardings reuse the compiled programs
    (one per leaf class: float32 matrix, bfloat16 vector, int32 scalar; the CPU kernels of
    float32 leaves are off, as the XLA path runs on GPU/TPU)."""
    import orbax_lossy as ol
    from orbax_lossy.engine import cpu_encode

    monkeypatch.setenv(cpu_encode.ENV, "0")

    rng = np.random.default_rng(3)
    state = {"a": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32),
             "b": jnp.asarray(rng.standard_normal(8), jnp.bfloat16), "n": jnp.asarray(1)}
    mngr = ol.checkpoint_manager(tmp_path, max_to_keep=None)
    program.encode_tree.clear_cache()
    sizes = []
    for step in range(4):
        state = {"a": state["a"] + 0.01, "b": state["b"] * 1.01, "n": state["n"] + 1}
        mngr.save(step, args=ol.LossySave(state))
        mngr.wait_until_finished()
        sizes.append(program.encode_tree._cache_size())
    # three programs for the base, three for the deltas; later saves compile nothing
    assert sizes == [3, 6, 6, 6]


def test_stored_symbols_outside_the_alphabet_are_rejected() -> None:
    """JAX clamps out-of-range gathers silently, so the host half must refuse them."""
    import orbax_lossy as ol

    data = LC(2).host_encode("sym", np.asarray([0, 1, 3, 5], np.uint8))
    with pytest.raises(ol.FormatError, match="outside the alphabet of 4"):
        LC(2).host_decode("sym", data, (4,), np.dtype(np.uint8))


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_direct_mode_prunes_small_values_with_the_bucket_bound(bits: int) -> None:
    """LC(mode="direct") quantizes the value itself: no reference, same guarantees."""
    rng = np.random.default_rng(7)
    value = (rng.standard_normal(5000) * np.exp(rng.normal(size=5000))).astype(np.float32)
    codec = LC(bits, mode="direct")
    assert not codec.needs_reference and codec.lossy
    out = program.encode_tree([jnp.asarray(value)], [None], plan=(codec,),
                              shardings=(jnp.asarray(value).sharding,))[0]
    symbols, reps = np.asarray(out["fields"]["sym"]), np.asarray(out["side"]["rep"])
    check_bounds(value, symbols, reps, bits)
    recon = np.asarray(out["recon"])
    np.testing.assert_array_equal(recon, reps[symbols])
    decoded = codec.device_decode(out["fields"], out["side"], None, jnp.float32)
    np.testing.assert_array_equal(np.asarray(decoded), recon)
    assert 0 < float(out["rel_error"]) < 1  # pruning the small values keeps most of the norm
    assert bool(out["safe"])


def test_guard_refuses_a_reconstruction_that_zeroes_a_positive_leaf() -> None:
    """LC direct on a non-negative leaf prunes small positive elements to 0: never kept."""
    nu = jnp.asarray(np.exp(np.random.default_rng(1).normal(size=4000) * 3), jnp.float32)
    signed = nu - jnp.median(nu)
    out = program.encode_tree([nu, signed], [None, None], plan=(LC(2, mode="direct"),) * 2,
                              shardings=(nu.sharding,) * 2)
    assert not bool(out[0]["safe"])  # the handler stores this leaf exactly
    np.testing.assert_array_equal(np.asarray(out[0]["recon"]), np.asarray(nu))
    assert float(out[0]["rel_error"]) == 0.0
    assert bool(out[1]["safe"])  # a signed leaf may have elements pruned to 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=str)
def test_sign_safe_decides_as_its_elementwise_definition(dtype) -> None:
    """``sign_safe`` and ``all_nonnegative`` reduce with float minima and maxima (fast on
    XLA:CPU); on mixes of zeros of both signs, subnormals, NaN, infinities and ordinary
    numbers they decide as the comparisons they replace, compiled the same way."""
    from orbax_lossy.codecs.base import all_nonnegative, sign_safe

    def definition(value, recon):
        nonnegative = jnp.all(value >= 0)
        return ~nonnegative | (jnp.all(recon >= 0) & jnp.all((value <= 0) | (recon > 0)))

    fast = jax.jit(lambda v, r: jnp.stack([sign_safe(v, r), all_nonnegative(v)]))
    slow = jax.jit(lambda v, r: jnp.stack([definition(v, r), jnp.all(v >= 0)]))
    specials = np.asarray([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 3e38],
                          np.float32)
    rng = np.random.default_rng(7)
    outcomes = set()
    for _ in range(400):
        pair = []
        for _ in range(2):
            x = np.where(rng.random(5) < 0.5, rng.choice(specials, 5),
                         rng.normal(size=5)).astype(np.float32)
            pair.append(np.abs(x) if rng.random() < 0.6 else x)
        v, r = (jnp.asarray(x, dtype) for x in pair)
        got, want = np.asarray(fast(v, r)), np.asarray(slow(v, r))
        np.testing.assert_array_equal(got, want, err_msg=f"{pair}")
        outcomes.add(tuple(bool(b) for b in want))
    # safe on a signed leaf, safe and unsafe on non-negative ones: every reachable outcome
    assert outcomes == {(True, False), (True, True), (False, True)}
    empty = jnp.zeros((0,), dtype)
    assert bool(sign_safe(empty, empty)) and bool(all_nonnegative(empty))


def test_handler_stores_an_unsafe_leaf_exactly(tmp_path) -> None:
    import orbax_lossy as ol

    nu = jnp.asarray(np.exp(np.random.default_rng(2).normal(size=(64, 64)) * 3), jnp.float32)
    policy = ol.LeafPolicy.create(rules=[("nu", LC(2, mode="direct"))])
    mngr = ol.checkpoint_manager(tmp_path, policy=policy, max_to_keep=None)
    mngr.save(0, args=ol.LossySave({"nu": nu}))
    mngr.wait_until_finished()
    (row,) = ol.checkpoint_stats(tmp_path / "0" / "default")
    assert row["codec"] == {"id": "exact"} and row["rel_error"] == 0.0
    restored = mngr.restore(0, args=ol.LossyRestore())
    mngr.close()
    np.testing.assert_array_equal(np.asarray(restored["nu"]), np.asarray(nu))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_log_domain_bounds_ratios_keeps_positive_and_decodes_bit_identically(bits: int) -> None:
    """LC(domain="log") quantizes log(value / reference) with the bucket bound."""
    rng = np.random.default_rng(bits)
    ref = np.exp(rng.normal(-12, 3, (400, 32))).astype(np.float32)
    ref[:2] = 0.0  # never-updated rows of a second moment
    value = ref * np.exp(rng.normal(0, 0.05, ref.shape)).astype(np.float32)
    value[0] = 1e-9  # newborn: positive now, zero in the reference
    value[5, :3] = 0.0  # an element that drops to exactly 0 keeps its reference
    codec = LC(bits, domain="log")
    v, r = jnp.asarray(value), jnp.asarray(ref)
    out = program.encode_tree([v], [r], plan=(codec,), shardings=(v.sharding,))[0]
    assert bool(out["safe"])
    recon = np.asarray(out["recon"])
    decoded = codec.device_decode(out["fields"], out["side"], r, jnp.float32)
    np.testing.assert_array_equal(np.asarray(decoded), recon)
    symbols = np.asarray(out["fields"]["sym"])
    factor = np.asarray(out["side"]["factor"])
    assert factor[0] == 1.0
    both = (value > 0) & (ref > 0)
    ratio = np.log(value[both].astype(np.float64) / ref[both])
    # kept ratios: relative error of the log-ratio < 50%, dropped: below every kept edge
    kept = symbols[both] > 0
    got = np.log(recon[both].astype(np.float64) / ref[both])
    if kept.any():
        assert np.all(np.abs(got[kept] - ratio[kept]) <= 0.5 * np.abs(ratio[kept]) + 1e-6)
        # (the codec takes float32 logs of values near e**-12: ~1e-6 absolute error, so a
        # ratio within 1e-5 of a bucket edge may sit on either side of it)
        edge = np.min(2.0 ** (np.frexp(np.abs(ratio[kept]) + 1e-5)[1] - 1))
        assert np.abs(ratio[~kept]).max(initial=0) < edge + 1e-5
    np.testing.assert_array_equal(recon[both][~kept], ref[both][~kept])  # factor 1: exact
    assert np.all(recon[0] == value[0].max()) and np.all(recon[1] == 0)  # newborn; still 0
    np.testing.assert_array_equal(recon[5, :3], ref[5, :3])
    assert recon.min() >= 0 and np.all(recon[value > 0] > 0)


def test_log_domain_parameters_are_validated() -> None:
    from orbax_lossy.errors import CodecError

    for kwargs in ({"domain": "sqrt"}, {"domain": "log", "mode": "direct"},
                   {"domain": "log", "bits": 1}):
        with pytest.raises(CodecError):
            LC(**kwargs)


# ---------------------------------------------------------------- bit identity of promote


def reference_promote(
    delta: jax.Array, bits: int, lift: jax.Array | None = None, reserve: int = 0
) -> tuple[jax.Array, jax.Array]:
    """``promote`` as it was before the scatter-light rewrite (frexp buckets, |delta| scatters,
    int32 symbol gather): the new one must return the same bits."""
    info = jnp.finfo(delta.dtype)
    lo, hi = int(info.minexp) - int(info.nmant) + 1, int(info.maxexp)
    n_symbols = 2**bits - reserve
    flat = delta.reshape(-1)
    _, e = jnp.frexp(flat)
    bucket = 2 * (e.astype(jnp.int32) - lo) + (flat < 0).astype(jnp.int32)
    bucket = jnp.where(jnp.abs(flat) < info.tiny, -1, bucket)
    n_buckets = 2 * (hi - lo + 1)
    seg = jnp.where(bucket < 0, n_buckets, bucket)
    mag = jnp.abs(flat)
    big = jnp.asarray(jnp.inf, mag.dtype)
    max_mag = jax.ops.segment_max(mag, seg, num_segments=n_buckets + 1)[:-1]
    min_mag = jax.ops.segment_min(jnp.where(bucket < 0, big, mag), seg, n_buckets + 1)[:-1]
    present = (max_mag > 0).reshape(-1, 2)
    per_exponent = present.sum(axis=1)
    from_top = jnp.cumsum(per_exponent[::-1])[::-1]
    keep = present & (from_top <= n_symbols - 1)[:, None]
    if n_symbols <= 2:
        top = jnp.max(jnp.where(per_exponent > 0, jnp.arange(per_exponent.shape[0]), -1))
        negatives = jnp.sum((bucket == 2 * top + 1).astype(jnp.int32))
        positives = jnp.sum((bucket == 2 * top).astype(jnp.int32))
        fuller = jnp.where(negatives > positives, 1, 0)
        fallback = jnp.zeros_like(keep).at[top, fuller].set(True) & present & (top >= 0)
        keep = jnp.where(jnp.any(keep), keep, fallback)
    keep = keep.reshape(-1)
    rank = jnp.cumsum(keep[::-1].astype(jnp.int32))[::-1]
    symbol_of_bucket = jnp.where(keep, rank, 0)
    midrange = (max_mag + min_mag) * jnp.asarray(0.5, mag.dtype)
    signed = jnp.where(jnp.arange(n_buckets) % 2 == 1, -midrange, midrange)
    reps = jnp.zeros((2**bits,), mag.dtype).at[symbol_of_bucket].max(
        jnp.where(keep, jnp.abs(signed), 0)
    )
    sign_of_symbol = jnp.zeros((2**bits,), jnp.bool_).at[symbol_of_bucket].max(
        keep & (jnp.arange(n_buckets) % 2 == 1)
    )
    reps = jnp.where(sign_of_symbol, -reps, reps)
    symbols = jnp.where(bucket < 0, 0, symbol_of_bucket[jnp.maximum(bucket, 0)])
    if lift is not None:
        positive_kept = keep & (jnp.arange(n_buckets) % 2 == 0)
        lowest = jnp.argmax(positive_kept)
        lifted = lift.reshape(-1) & (symbols == 0) & jnp.any(positive_kept)
        symbols = jnp.where(lifted, symbol_of_bucket[lowest], symbols)
    return symbols.astype(jnp.uint8).reshape(delta.shape), reps


def edge_deltas(n: int, dtype, seed: int) -> list[np.ndarray]:
    """Random and edge-case deltas of ``n`` elements (finite, in ``dtype``'s range)."""
    rng = np.random.default_rng(seed)
    info = np.finfo(np.float32 if dtype == jnp.bfloat16 else dtype)
    lo, hi = int(info.minexp), int(info.maxexp) - 1
    g = rng.standard_normal(n)
    cases = [
        1e-3 * g,
        g * np.exp2(rng.integers(lo, hi, n)),  # every exponent, both signs
        np.where(rng.random(n) < 0.8, 0.0, g),  # mostly zeros
        np.abs(g),  # one sign only
        np.sign(g) * np.exp2(rng.integers(lo - 3, lo + 3, n).astype(float)),  # subnormals
        np.zeros(n),  # all zeros
        np.where(rng.random(n) < 0.97, 0.0, g * np.exp2(rng.choice([lo + 2, -20, 0, 9], n))),
        np.concatenate([[-3.0, 3.5], np.full(n - 2, 0.25)]),  # both signs at the top only
        np.concatenate([[-3.0, 3.5, -2.5], 1e-9 * g[3:]]),  # a gap below the top exponent
        np.concatenate([[2.0**hi, -(2.0**hi)], np.exp2(float(lo)) * np.ones(n - 2)]),
    ]
    return [np.clip(c, -float(info.max), float(info.max)) for c in cases]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_promote_is_bit_identical_to_the_reference(dtype) -> None:
    """Symbols and representatives equal the pre-rewrite promote's for every bits/lift/reserve."""
    n = 512
    deltas = [jnp.asarray(c, dtype) for c in edge_deltas(n, dtype, 0)]
    deltas += [jnp.asarray([1.5], dtype), jnp.asarray([-0.0], dtype)]  # single elements
    rng = np.random.default_rng(1)
    # 1 and 2 (with reserve) take the two-symbol path; 3 is the default; 8 keeps every bucket
    for bits in (1, 2, 3, 4, 8) if dtype == jnp.float32 else (1, 2, 8):
        for reserve in (0, 1) if bits >= 2 else (0,):
            for use_lift in (False, True):
                def both(x, lift, bits=bits, reserve=reserve, use_lift=use_lift):
                    lift = lift if use_lift else None
                    return promote(x, bits, lift, reserve), reference_promote(
                        x, bits, lift, reserve)
                run = jax.jit(both)
                for x in deltas:
                    lift = jnp.asarray(rng.random(x.shape) < 0.3)
                    new, old = jax.device_get(run(x, lift))
                    for a, b in zip(new, old, strict=True):
                        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (
                            bits, reserve, use_lift, np.asarray(x)[:4])


def test_promote_is_bit_identical_to_the_reference_in_float64() -> None:
    """The float64 work dtype (x64) buckets its wider exponent range the same way."""
    with jax.enable_x64(True):
        deltas = [jnp.asarray(c, jnp.float64) for c in edge_deltas(256, np.float64, 2)]
        for bits in (1, 2, 3, 8):
            run = jax.jit(lambda x, bits=bits: (promote(x, bits), reference_promote(x, bits)))
            for x in deltas:
                new, old = jax.device_get(run(x))
                for a, b in zip(new, old, strict=True):
                    assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), bits


@pytest.mark.parametrize(
    "codec", [LC(1), LC(3), LC(8), LC(3, mode="direct"), LC(2, domain="log")], ids=str
)
def test_encode_matches_the_reference_promote_on_a_large_leaf(codec, monkeypatch) -> None:
    """Whole encode (fields, side, reconstruction) against the same encode with the
    reference promote swapped in, on a realistic 2^20-element delta."""
    from orbax_lossy.codecs import lc as lc_module

    ref = jax.random.normal(jax.random.key(0), (1024, 1024), jnp.float32)
    if codec.domain == "log":
        ref = jnp.square(ref)
    value = ref + 1e-3 * jax.random.normal(jax.random.key(1), ref.shape, jnp.float32)
    if codec.domain == "log":
        value = jnp.abs(value).at[0, :7].set(0.0)
    new = jax.device_get(jax.jit(codec.encode)(value, ref))
    monkeypatch.setattr(lc_module, "promote", reference_promote)
    old = jax.device_get(jax.jit(codec.encode)(value, ref))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("n", [1000, 9000, 40_003])
def test_bucket_extremes_rows_match_one_scatter(n: int) -> None:
    """The row-interleaved scatters of promote give exactly the one-row maxima and minima,
    for leaves below and above the size where the rows start (empty buckets included)."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32) * np.float32(10.0) ** rng.integers(-6, 3, n)
    x[rng.random(n) < 0.1] = 0.0
    flat = jnp.asarray(x)
    seg, n_buckets = lc.segment_ids(flat)
    top, bottom = lc._bucket_extremes(flat, seg, n_buckets)
    want_top = jax.ops.segment_max(flat, seg, num_segments=n_buckets + 1)[:-1]
    want_bottom = jax.ops.segment_min(flat, seg, num_segments=n_buckets + 1)[:-1]
    np.testing.assert_array_equal(np.asarray(top), np.asarray(want_top))
    np.testing.assert_array_equal(np.asarray(bottom), np.asarray(want_bottom))
    assert np.isneginf(np.asarray(top)).any()  # some buckets are empty
