"""Conformance suite run over every registered codec (each class's ``examples()``).

Round trip through the host coders, bit-identical device decode of the stored bytes to the
reconstruction returned at save, config round trip, exactness or the declared error bound,
out-of-alphabet symbols rejected; plus the registry and the entry-point group.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orbax_lossy as ol
from orbax_lossy.codecs import base
from orbax_lossy.codecs.base import (
    CodecBase,
    Encoded,
    Field,
    codec_config,
    codec_from_config,
    encode_symbol_field,
    registered_codecs,
    work_dtype,
)
from orbax_lossy.errors import CodecError, FormatError, LossyError

EXAMPLES = [
    pytest.param(codec, id=f"{codec_id}-{i}")
    for codec_id, cls in sorted(registered_codecs().items())
    for i, codec in enumerate(cls.examples() if hasattr(cls, "examples") else ())
]
#: (leaf dtype, signed values) cases every example runs on
CASES = [pytest.param(jnp.float32, True, id="f32-signed"),
         pytest.param(jnp.bfloat16, False, id="bf16-nonneg")]


def leaf_pair(dtype: Any, signed: bool, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """(value, reference): a small update of a reference; some elements unchanged, some 0."""
    rng = np.random.default_rng(seed)
    shape = (24, 40)
    if signed:
        ref = rng.standard_normal(shape) * 0.05
        value = ref + rng.standard_normal(shape) * 1e-3
    else:
        ref = np.exp(rng.normal(-8, 1.5, shape))
        ref[0, :5] = 0.0  # elements born since the reference
        value = ref * 0.99 + np.exp(rng.normal(-10, 1, shape))
    value = np.where(rng.random(shape) < 0.3, ref, value)  # unchanged elements
    value[1, :3] = 0.0
    return jnp.asarray(value, dtype), jnp.asarray(ref, dtype)


def to_numpy(enc: Encoded) -> Encoded:
    return Encoded({k: np.asarray(v) for k, v in enc.fields.items()},
                   {k: np.asarray(v) for k, v in enc.side.items()}, np.asarray(enc.recon))


def check_codec(codec: Any, value: jax.Array, reference: jax.Array) -> None:
    """Every conformance property of ``codec`` on one leaf (``reference`` used if needed)."""
    ref = reference if codec.needs_reference else None
    enc = to_numpy(jax.jit(codec.device_encode)(value, ref))
    dtype = np.dtype(value.dtype)
    assert enc.recon.dtype == dtype and enc.recon.shape == value.shape
    declared = codec.field_dtypes(dtype)
    assert set(enc.fields) == set(declared)
    stored = {}
    for name, array in enc.fields.items():
        assert array.dtype == declared[name] and array.shape == value.shape, name
        data = codec.host_encode(name, array)
        stored[name] = codec.host_decode(name, data, array.shape, declared[name])
        np.testing.assert_array_equal(stored[name], array, err_msg=name)
    shapes = codec.side_shapes()  # what a restore checks the stored side arrays against
    if shapes is not None and work_dtype(dtype) == jnp.float32:
        assert {k: (v.shape, v.dtype) for k, v in enc.side.items()} == {
            k: (tuple(v), np.dtype(np.float32)) for k, v in shapes.items()}, codec
    decode = jax.jit(codec.device_decode, static_argnums=3)
    restored = np.asarray(decode(stored, enc.side, ref, dtype))
    assert restored.dtype == dtype
    # bit-identical to the reconstruction returned at save
    np.testing.assert_array_equal(restored.view(f"u{dtype.itemsize}"),
                                  enc.recon.view(f"u{dtype.itemsize}"))
    v = np.asarray(value)
    if not codec.lossy:
        np.testing.assert_array_equal(restored.view(f"u{dtype.itemsize}"),
                                      v.view(f"u{dtype.itemsize}"))
        return
    bound = codec.error_bound(v, None if ref is None else np.asarray(ref), enc)
    assert bound is not None, f"lossy codec {codec!r} declares no error_bound"
    err = np.abs(restored.astype(np.float64) - v.astype(np.float64))
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), (codec, worst, err[worst], bound[worst], v[worst])


def test_every_registered_codec_has_examples() -> None:
    for codec_id, cls in registered_codecs().items():
        examples = cls.examples() if hasattr(cls, "examples") else ()
        assert examples, f"codec {codec_id!r} has no examples() for the conformance suite"
        assert all(type(c) is cls for c in examples)
    assert {"exact", "lc", "cluster", "bitmask", "uniform"} <= set(registered_codecs())


@pytest.mark.parametrize("dtype, signed", CASES)
@pytest.mark.parametrize("codec", EXAMPLES)
def test_round_trip_decode_and_bound(codec: Any, dtype: Any, signed: bool) -> None:
    value, reference = leaf_pair(dtype, signed)
    check_codec(codec, value, reference)


@pytest.mark.parametrize("codec", EXAMPLES)
def test_config_round_trip(codec: Any) -> None:
    config = json.loads(json.dumps(codec_config(codec)))
    again = codec_from_config(config)
    assert again == codec and hash(again) == hash(codec)
    assert codec_config(again) == codec_config(codec)


@pytest.mark.parametrize("codec", EXAMPLES)
def test_out_of_alphabet_symbols_are_rejected(codec: Any) -> None:
    fields = codec.fields() if hasattr(codec, "fields") else {}
    for name, spec in fields.items():
        if spec.coder != "symbols" or spec.alphabet >= 256:
            continue
        data = encode_symbol_field(np.full((4, 8), spec.alphabet, np.uint8))
        with pytest.raises(FormatError) as info:
            codec.host_decode(name, data, (4, 8), np.dtype(np.uint8))
        assert isinstance(info.value, LossyError)
    with pytest.raises(FormatError):
        codec.host_decode("no_such_field", b"", (1,), np.dtype(np.uint8))


def test_device_halves_run_in_named_scopes() -> None:
    x = jnp.ones((8,), jnp.float32)
    text = jax.jit(ol.LC(3).device_encode).lower(x, x).as_text(debug_info=True)
    assert "orbax_lossy.lc.encode" in text
    text = jax.jit(ol.Uniform(4).device_decode, static_argnums=3).lower(
        {"sym": jnp.zeros((8,), jnp.uint8)}, {"codebook": jnp.zeros((16,))}, None,
        np.dtype(np.float32)).as_text(debug_info=True)
    assert "orbax_lossy.uniform.decode" in text


# --------------------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class Negate(CodecBase, register=False):
    """A third-party codec, registered only through its entry point: stores ``-value``."""

    codec_id: ClassVar[str] = "test_negate"
    lossy: ClassVar[bool] = False

    def fields(self) -> dict[str, Field]:
        return {"neg": Field.lossless()}

    def encode(self, value: jax.Array, reference: jax.Array | None) -> Encoded:
        return Encoded({"neg": -value}, {}, jnp.copy(value))

    def decode(self, fields: dict[str, jax.Array], side: dict[str, jax.Array],
               reference: jax.Array | None, dtype: Any) -> jax.Array:
        return (-fields["neg"]).astype(dtype)


def fake_entry_points(monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    """Pretend an installed distribution declares ``test_negate = target``."""
    eps = importlib.metadata.EntryPoints([
        importlib.metadata.EntryPoint("test_negate", target, base.ENTRY_POINT_GROUP)
    ])

    def entry_points(**params: Any) -> importlib.metadata.EntryPoints:
        return eps.select(**params)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))


def test_entry_point_codec_decodes_an_old_manifest_without_an_import(monkeypatch) -> None:
    assert "test_negate" not in registered_codecs()
    fake_entry_points(monkeypatch, f"{__name__}:Negate")
    codec = codec_from_config({"id": "test_negate"}, where="leaf w")
    assert codec == Negate() and registered_codecs()["test_negate"] is Negate
    value, reference = leaf_pair(jnp.float32, True)
    check_codec(codec, value, reference)
    with pytest.raises(CodecError, match="unknown codec id 'nope'"):
        codec_from_config({"id": "nope"})


def test_entry_point_must_name_a_codec_with_its_id(monkeypatch) -> None:
    fake_entry_points(monkeypatch, "orbax_lossy.codecs.exact:Exact")
    with pytest.raises(CodecError, match="does not define codec"):
        codec_from_config({"id": "test_negate"})


def test_duplicate_codec_ids_are_rejected(monkeypatch) -> None:
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    with pytest.raises(CodecError, match="registered twice"):

        @dataclasses.dataclass(frozen=True)
        class Impostor(CodecBase):
            codec_id: ClassVar[str] = "exact"


def test_bad_configs_are_codec_errors() -> None:
    with pytest.raises(CodecError, match="bits must be an int"):
        codec_from_config({"id": "uniform", "bits": 9})
    with pytest.raises(CodecError, match="bad parameters"):
        codec_from_config({"id": "lc", "colour": "red"})


@pytest.mark.parametrize("codec", EXAMPLES)
def test_declared_side_arrays_are_those_of_the_traced_encode(codec: Any) -> None:
    """A restore checks stored side arrays against the codec's declaration (no trace of the
    encode in a fresh process); it must be what the encode writes, for every float dtype
    that works in float32 and any shape."""
    from orbax_lossy.engine.restore import _side_spec, traced_side_spec

    declared = codec.side_shapes()
    assert declared is not None, f"{codec!r} declares no side arrays (restores trace it)"
    for dtype in (np.float32, np.dtype(jnp.bfloat16), np.float16):
        for shape in ((16,), (3, 5), (1,), (2, 1, 7)):
            traced = traced_side_spec(codec, shape, np.dtype(dtype))
            assert _side_spec(codec, shape, np.dtype(dtype)) == traced, (codec, dtype, shape)
