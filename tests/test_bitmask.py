"""Bitmask codec: exact bit-for-bit round trips, chunk-grid pieces, mask cost, quantized mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orbax_lossy.codecs.base import codec_config, codec_from_config
from orbax_lossy.codecs.bitmask import Bitmask
from orbax_lossy.engine import device as program
from orbax_lossy.errors import CodecError


def sparse_update(shape, dtype, frac: float, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """(reference, value): value differs from the reference in about ``frac`` of elements."""
    rng = np.random.default_rng(seed)
    ref = jnp.asarray(rng.standard_normal(shape) * 0.05, dtype)
    changed = rng.random(shape) < frac
    step = np.where(changed, rng.choice([-1.0, 1.0], shape) * 2.0**-6, 0.0)
    value = jnp.where(changed, (ref.astype(jnp.float32) * (1 + step)).astype(dtype), ref)
    return ref, value


def host_round_trip(codec, fields: dict, dtype) -> dict:
    """host_encode/host_decode every field; returns (decoded fields, total bytes)."""
    out, total = {}, 0
    for name, arr in fields.items():
        host = np.asarray(arr)
        data = codec.host_encode(name, host)
        total += len(data)
        fdtype = codec.field_dtypes(np.dtype(dtype))[name]
        out[name] = jnp.asarray(codec.host_decode(name, data, host.shape, fdtype))
    return out, total


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_exact_round_trip_is_bitwise(dtype, assert_bitwise):
    ref, value = sparse_update((96, 80), dtype, 0.05)
    # special values: signed zeros, a NaN payload, infinities survive bit for bit
    value = value.at[0, :4].set(jnp.array([-0.0, jnp.nan, jnp.inf, -jnp.inf], dtype))
    ref = ref.at[0, 0].set(0.0)
    codec = Bitmask()
    enc = jax.jit(codec.device_encode)(value, ref)
    assert_bitwise(enc.recon, value, "recon")
    mask = np.asarray(enc.fields["mask"])
    expected = np.asarray(value).view(np.uint16 if np.dtype(dtype).itemsize == 2 else np.uint32)
    expected = expected != np.asarray(ref).view(expected.dtype)
    np.testing.assert_array_equal(mask, expected.astype(np.uint8))
    fields, _ = host_round_trip(codec, enc.fields, dtype)
    decoded = jax.jit(codec.device_decode, static_argnums=3)(fields, enc.side, ref, dtype)
    assert_bitwise(decoded, value, "decode")


def test_pieces_of_the_chunk_grid_decode_independently(assert_bitwise):
    ref, value = sparse_update((64, 50), jnp.bfloat16, 0.02, seed=3)
    codec = Bitmask()
    enc = codec.device_encode(value, ref)
    for name, arr in enc.fields.items():
        host = np.asarray(arr)
        fdtype = codec.field_dtypes(np.dtype(jnp.bfloat16))[name]
        parts = [host[:20, :30], host[:20, 30:], host[20:, :]]
        decoded = [codec.host_decode(name, codec.host_encode(name, np.ascontiguousarray(p)),
                                     p.shape, fdtype) for p in parts]
        whole = np.concatenate([np.concatenate(decoded[:2], axis=1), decoded[2]], axis=0)
        assert_bitwise(whole, host, name)


def test_one_percent_changed_bf16_costs_under_a_tenth_of_raw(assert_bitwise):
    ref, value = sparse_update((512, 512), jnp.bfloat16, 0.01, seed=1)
    codec = Bitmask()
    enc = codec.device_encode(value, ref)
    frac = float(np.asarray(enc.fields["mask"]).mean())
    assert 0.005 < frac < 0.015
    fields, total = host_round_trip(codec, enc.fields, jnp.bfloat16)
    raw = value.size * 2
    assert total < 0.1 * raw, (total, raw)
    assert_bitwise(codec.device_decode(fields, enc.side, ref, jnp.bfloat16), value, "decode")
    # an unchanged leaf costs a few bytes
    enc0 = codec.device_encode(ref, ref)
    _, total0 = host_round_trip(codec, enc0.fields, jnp.bfloat16)
    assert total0 < 64


@pytest.mark.parametrize("bits", [1, 3, 8])
def test_quantized_mode_keeps_unchanged_elements_exact(bits, assert_bitwise):
    ref, value = sparse_update((80, 64), jnp.float32, 0.1, seed=2)
    value = value + jnp.where(jnp.arange(64) % 7 == 0, 1e-3, 0.0)  # some larger moves
    codec = Bitmask(bits=bits)
    enc = jax.jit(codec.device_encode)(value, ref)
    mask = np.asarray(enc.fields["mask"]) == 1
    recon, v, r = np.asarray(enc.recon), np.asarray(value), np.asarray(ref)
    assert_bitwise(recon[~mask], r[~mask], "unchanged")
    # a kept change decodes within 50% of its delta, same sign; dropped ones stay at ref
    delta, got = (v - r)[mask], (recon - r)[mask]
    moved = got != 0
    assert moved.any()
    assert np.all(np.abs(got[moved] - delta[moved]) < 0.5 * np.abs(delta[moved]) + 1e-9)
    assert np.all(np.sign(got[moved]) == np.sign(delta[moved]))
    fields, _ = host_round_trip(codec, enc.fields, jnp.float32)
    assert_bitwise(codec.device_decode(fields, enc.side, ref, jnp.float32), enc.recon, "decode")


def test_through_the_tree_program_and_registry(assert_bitwise):
    ref, value = sparse_update((33, 17), jnp.bfloat16, 0.1, seed=4)
    plan = (Bitmask(), Bitmask(bits=4))
    out = program.encode_tree([value, value], [ref, ref], plan=plan, shardings=(None, None))
    assert bool(out[0]["safe"]) and float(out[0]["rel_error"]) == 0.0
    assert_bitwise(out[0]["recon"], value, "exact")
    dec = program.decode_tree(
        [o["fields"] for o in out], [o["side"] for o in out], [ref, ref], plan=plan,
        dtypes=(jnp.bfloat16, jnp.bfloat16), shardings=(None, None),
    )
    assert_bitwise(dec[0], value, "exact decode")
    assert_bitwise(dec[1], out[1]["recon"], "quantized decode")
    for codec in plan:
        assert codec_from_config(codec_config(codec)) == codec
    assert hash(Bitmask()) == hash(Bitmask())


def test_bad_parameters_are_refused():
    for bad in (0, 9, 2.0, True):
        with pytest.raises(CodecError):
            Bitmask(bits=bad)
    with pytest.raises(CodecError):
        Bitmask().device_encode(jnp.zeros(3), None)
