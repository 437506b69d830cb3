"""Tests of the byte-plane lossless array coder (orbax_lossy.codecs.lossless)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from orbax_lossy.codecs.lossless import decode_array, encode_array, from_planes, to_planes
from orbax_lossy.errors import CodecError, FormatError, TruncatedError

FLOATS = [np.float16, np.float32, np.float64, ml_dtypes.bfloat16]
INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
COMPLEX = [np.complex64, np.complex128]
SMALL = [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.int4]
ALL = [np.bool_, *INTS, *FLOATS, *COMPLEX, *SMALL]


def _random_bits(dtype: np.dtype, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Arbitrary bit patterns (NaN payloads, denormals, ...) of ``dtype``."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    if dt.kind == "b":
        raw &= 1
    if dt.name in ("int4",):
        raw = (raw % 16 - 8).astype(np.int8).view(np.uint8)
    return raw.view(dt).reshape(shape)


def _assert_identical(out: np.ndarray, ref: np.ndarray) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert out.tobytes() == np.ascontiguousarray(ref).tobytes()


def _roundtrip(array: np.ndarray) -> bytes:
    data = encode_array(array)
    _assert_identical(decode_array(data, array.shape, array.dtype), array)
    return data


@pytest.mark.parametrize("dtype", ALL, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (7,), (5, 13), (300, 257)])
def test_roundtrip_random_bits(dtype: np.dtype, shape: tuple[int, ...]) -> None:
    _roundtrip(_random_bits(dtype, shape, seed=len(shape)))


@pytest.mark.parametrize("dtype", [*FLOATS, *COMPLEX], ids=lambda d: np.dtype(d).name)
def test_roundtrip_special_floats(dtype: np.dtype) -> None:
    dt = np.dtype(dtype)
    real = np.dtype(f"f{dt.itemsize // 2}") if dt.kind == "c" else dt
    values = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0, -1.0]
    arr = np.array(values, dtype=np.float64).astype(real)
    finfo = ml_dtypes.finfo(real) if real.name == "bfloat16" else np.finfo(real)
    tiny = np.array([finfo.smallest_subnormal, -finfo.smallest_subnormal, finfo.max], real)
    width = real.itemsize * 8
    word = np.dtype(f"u{real.itemsize}")
    exp_mask = np.array([np.array(np.inf, real).view(word)], word)
    payload_nans = (exp_mask | np.array([1, 2, 3], word)).view(real)  # signalling/payload NaNs
    neg_nans = (payload_nans.view(word) | word.type(1 << (width - 1))).view(real)
    arr = np.concatenate([arr, tiny, payload_nans, neg_nans])
    if dt.kind == "c":
        arr = np.ascontiguousarray(np.stack([arr, arr[::-1]], axis=1)).view(dt).reshape(-1)
    _roundtrip(arr)
    _roundtrip(np.tile(arr, 5000))


def test_zero_dim_and_noncontiguous_views() -> None:
    base = (np.random.default_rng(1).normal(size=(64, 48)) * 0.1).astype(np.float32)
    for view in (base[::2, ::3], base.T, base[:, 5], base[10:20, ::-1], base.reshape(-1)[::7]):
        assert not view.flags.c_contiguous or view.ndim == 1
        data = encode_array(view)
        _assert_identical(decode_array(data, view.shape, view.dtype), view)
    for scalar in (np.float32(-0.0), np.int64(-5), np.bool_(True), np.complex128(1 - 2j)):
        arr = np.asarray(scalar)
        _roundtrip(arr)


def test_non_native_byte_order() -> None:
    arr = np.arange(20, dtype=">f4") - 3.5
    data = encode_array(arr)
    out = decode_array(data, arr.shape, arr.dtype)
    assert out.dtype == arr.dtype
    np.testing.assert_array_equal(out, arr)
    assert data == encode_array(arr.astype("<f4"))


def test_jax_bfloat16_dtype_accepted() -> None:
    jnp = pytest.importorskip("jax.numpy")
    arr = (np.random.default_rng(2).normal(size=1000) * 0.02).astype(jnp.bfloat16)
    data = encode_array(arr)
    _assert_identical(decode_array(data, arr.shape, jnp.bfloat16), arr)


def test_planes_rotation_layout() -> None:
    arr = np.array([1.0, -1.0, -0.0], np.float32)
    planes = to_planes(arr)
    assert planes.shape == (4, 3)
    # top plane = 8-bit exponent (127 for +-1), sign in the lowest bit of plane 0
    np.testing.assert_array_equal(planes[3], [127, 127, 0])
    np.testing.assert_array_equal(planes[0] & 1, [0, 1, 1])
    _assert_identical(from_planes(planes, arr.shape, arr.dtype), arr)


# ------------------------------------------------------------------ validation on decode


def test_mismatches_and_corruption_raise() -> None:
    arr = (np.random.default_rng(3).normal(size=(40, 50)) * 0.05).astype(np.float32)
    data = encode_array(arr)
    with pytest.raises(FormatError):
        decode_array(data, arr.shape, np.int32)  # wrong dtype
    with pytest.raises(FormatError):
        decode_array(data, (40, 51), arr.dtype)  # wrong element count
    decode_array(data, (50, 40), arr.dtype)  # same count, other shape: caller's business
    with pytest.raises(FormatError):
        decode_array(data + b"\x00", arr.shape, arr.dtype)
    with pytest.raises(FormatError):
        decode_array(b"\x09" + data[1:], arr.shape, arr.dtype)  # version
    for cut in range(len(data)):
        with pytest.raises((TruncatedError, FormatError)):
            decode_array(data[:cut], arr.shape, arr.dtype)
    rng = np.random.default_rng(4)
    for i in rng.integers(0, len(data), 300):
        bad = bytearray(data)
        bad[i] ^= int(rng.integers(1, 256))
        try:
            out = decode_array(bytes(bad), arr.shape, arr.dtype)
        except (FormatError, TruncatedError):
            continue
        assert out.shape == arr.shape and out.dtype == arr.dtype


def test_bool_with_bad_bytes_raises() -> None:
    arr = np.array([True, False, True])
    data = encode_array(np.array([1, 0, 2], np.uint8))
    bool_data = bytes([data[0], encode_array(arr)[1]]) + data[2:]
    with pytest.raises(FormatError):
        decode_array(bool_data, arr.shape, arr.dtype)


def test_unsupported_inputs_raise_codec_error() -> None:
    with pytest.raises(CodecError):
        encode_array(np.array(["a", "b"]))
    with pytest.raises(CodecError):
        encode_array(np.array([object()], dtype=object))
    with pytest.raises(CodecError):
        decode_array(b"\x01\x0c\x00", (-1,), np.float32)


# ------------------------------------------------------------------------ vs zstandard


def _trained_like(seed: int) -> np.ndarray:
    """A weight matrix after many small Gaussian updates (fixed seed)."""
    rng = np.random.default_rng(seed)
    w = (rng.normal(size=(256, 1024)) * 0.02).astype(np.float32)
    for _ in range(20):
        w += (rng.normal(size=w.shape) * 0.005).astype(np.float32)
    return w


@pytest.mark.parametrize(
    "name", ["f32_updates", "f32_normal", "bf16_updates", "bf16_normal", "f16_normal"]
)
def test_beats_zstd_level3_on_trained_like_weights(name: str) -> None:
    zstd = pytest.importorskip("zstandard")
    rng = np.random.default_rng(5)
    arr = {
        "f32_updates": lambda: _trained_like(6),
        "f32_normal": lambda: (rng.normal(size=1 << 18) * 0.05).astype(np.float32),
        "bf16_updates": lambda: _trained_like(7).astype(ml_dtypes.bfloat16),
        "bf16_normal": lambda: (rng.normal(size=1 << 18) * 0.05).astype(ml_dtypes.bfloat16),
        "f16_normal": lambda: (rng.normal(size=1 << 18) * 0.05).astype(np.float16),
    }[name]()
    ours = len(_roundtrip(arr))
    theirs = len(zstd.ZstdCompressor(level=3).compress(arr.tobytes()))
    assert ours < theirs, (ours, theirs)


def _reference_planes(arr: np.ndarray) -> np.ndarray:
    """The layout of the module doc in plain numpy (the form the kernels replaced): words
    rotated left by one bit for floats, little-endian bytes, plane j = byte j of each word."""
    dt = arr.dtype
    width = dt.itemsize // 2 if dt.kind == "c" else dt.itemsize
    words = np.ascontiguousarray(arr).reshape(-1).view(np.dtype(f"u{width}"))
    if dt.kind in "fc" or dt.name.startswith(("float", "bfloat")):
        words = (words << np.uint8(1)) | (words >> np.uint8(8 * width - 1))
    return words.astype(np.dtype(f"<u{width}")).view(np.uint8).reshape(-1, width).T


@pytest.mark.parametrize("dtype", ALL, ids=lambda d: np.dtype(d).name)
def test_plane_kernels_keep_the_documented_layout(dtype) -> None:
    """Stored bytes do not change with the split/join kernels, for every dtype."""
    arr = _random_bits(dtype, (3, 1001), seed=11)
    planes = to_planes(arr)
    np.testing.assert_array_equal(planes, _reference_planes(arr))
    _assert_identical(from_planes(planes, arr.shape, arr.dtype), arr)


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("shape", [(), (1,), (3, 5), (64,)])
def test_small_and_incompressible_arrays_are_stored_as_words(dtype, shape) -> None:
    """Format 4: where byte planes would not be smaller, the array's own words (version 2):
    a scalar of n bytes costs 2 + 1 + n bytes, never more than the planes."""
    array = _random_bits(dtype, shape, seed=3)
    data = _roundtrip(array)
    words = 3 + array.nbytes
    assert len(data) <= words
    if data[0] == 2:
        assert len(data) == words
    if array.size <= 1:
        assert data[0] == 2


def test_a_compressible_array_keeps_its_planes() -> None:
    array = np.zeros(4096, np.float32)
    data = _roundtrip(array)
    assert data[0] == 1 and len(data) < 64


def test_damaged_words_are_refused() -> None:
    array = np.arange(8, dtype=np.float32) * 1.1
    data = _roundtrip(array)
    assert data[0] == 2
    with pytest.raises(TruncatedError):
        decode_array(data[:-1], array.shape, array.dtype)
    with pytest.raises(FormatError):
        decode_array(data + b"\0", array.shape, array.dtype)
    with pytest.raises(FormatError, match="bool"):
        decode_array(bytes([2, 1, 2, 0, 7]), (2,), np.bool_)
