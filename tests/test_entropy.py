"""Tests of the entropy-coded symbol stream (orbax_lossy.entropy)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orbax_lossy.entropy import _kernels as K
from orbax_lossy.entropy import (
    decode_symbols,
    encode_symbols,
    huffman,
    order0_entropy_bits,
    stream,
    varint,
)
from orbax_lossy.errors import CodecError, FormatError, TruncatedError

N = 1_000_000
#: allowed fixed overhead in bytes for a 1e6-symbol stream: header + Huffman tables
#: (<= ~200 bytes) + 16 blocks x (4-byte size + padding byte)
OVERHEAD = 300 + 5 * (-(-N // stream.BLOCK_SYMBOLS))


def _iid(seed: int, probs: np.ndarray, n: int = N, symbols: np.ndarray | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    probs = np.asarray(probs, np.float64) / np.sum(probs)
    idx = np.searchsorted(np.cumsum(probs), rng.random(n), side="right")
    idx = np.minimum(idx, probs.size - 1)
    table = np.arange(probs.size) if symbols is None else symbols
    return np.asarray(table, np.uint8)[idx]


def _roundtrip(sym: np.ndarray) -> bytes:
    data = encode_symbols(sym)
    out = decode_symbols(data, sym.size)
    assert out.dtype == np.uint8 and out.shape == sym.shape
    np.testing.assert_array_equal(out, sym)
    return data


# ------------------------------------------------------------------------- size targets


@pytest.mark.parametrize(
    ("p0", "others", "shape"),
    [
        (0.9, 2, "uniform"),
        (0.9, 7, "geometric"),
        (0.97, 3, "uniform"),
        (0.97, 5, "geometric"),
        (0.99, 7, "uniform"),
        (0.99, 2, "geometric"),
        (0.999, 4, "uniform"),
        (0.999, 7, "geometric"),
    ],
)
def test_sparse_streams_beat_one_bit_floor(p0: float, others: int, shape: str) -> None:
    rest = np.ones(others) if shape == "uniform" else 0.5 ** np.arange(others)
    probs = np.concatenate(([p0], (1 - p0) * rest / rest.sum()))
    sym = _iid(int(p0 * 1000) + others, probs, symbols=np.array([0, *range(3, 3 + others)]))
    data = _roundtrip(sym)
    bound = order0_entropy_bits(sym) / 8
    assert len(data) <= 1.15 * bound + OVERHEAD, (len(data), bound)
    assert len(data) * 8 < sym.size  # below Huffman's 1 bit/symbol floor
    assert data[0] == stream.MODE_ZRUN


@pytest.mark.parametrize("p0", [0.3, 0.5, 0.7, 0.85])
@pytest.mark.parametrize("alphabet", [2, 4, 8, 16, 256])
@pytest.mark.parametrize("shape", ["uniform", "geometric"])
def test_flat_streams_near_entropy(p0: float, alphabet: int, shape: str) -> None:
    others = alphabet - 1
    rest = np.ones(others) if shape == "uniform" else 0.8 ** np.arange(others)
    probs = np.concatenate(([p0], (1 - p0) * rest / rest.sum()))
    sym = _iid(alphabet * 10 + int(p0 * 100), probs)
    data = _roundtrip(sym)
    bound = order0_entropy_bits(sym) / 8
    assert len(data) <= 1.03 * bound + OVERHEAD, (len(data), bound)


@pytest.mark.parametrize("alphabet", [2, 3, 4, 5, 8, 16, 100, 256])
def test_uniform_streams_near_entropy(alphabet: int) -> None:
    sym = _iid(alphabet, np.ones(alphabet))
    data = _roundtrip(sym)
    bound = order0_entropy_bits(sym) / 8
    assert len(data) <= 1.03 * bound + OVERHEAD, (len(data), bound)


def test_tuple_mode_breaks_one_bit_floor_for_skewed_small_alphabet() -> None:
    sym = _iid(7, [0.85, 0.15])
    data = _roundtrip(sym)
    assert data[0] == stream.MODE_TUPLE
    k = data[1 + len(stream._uvarint(N)) + 1 + 2]  # mode, n, m-1, symset (2 bytes), k
    assert k > 1
    assert len(data) * 8 < 0.7 * sym.size


def test_constant_and_raw_modes() -> None:
    for value in (0, 255, 17):
        sym = np.full(N, value, np.uint8)
        data = _roundtrip(sym)
        assert data[0] == stream.MODE_CONST and len(data) <= 8
    sym = np.random.default_rng(1).integers(0, 256, N, dtype=np.uint8)
    data = _roundtrip(sym)
    assert len(data) <= N + 8


def test_order0_entropy_bits() -> None:
    assert order0_entropy_bits(np.zeros(0, np.uint8)) == 0.0
    assert order0_entropy_bits(np.zeros(10, np.uint8)) == 0.0
    assert order0_entropy_bits(np.array([0, 1, 0, 1], np.uint8)) == pytest.approx(4.0)
    assert order0_entropy_bits(np.arange(256, dtype=np.uint8)) == pytest.approx(2048.0)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "sym",
    [
        np.zeros(0, np.uint8),
        np.array([0], np.uint8),
        np.array([200], np.uint8),
        np.array([0, 1], np.uint8),
        np.arange(256, dtype=np.uint8),
        np.tile(np.arange(256, dtype=np.uint8), 1000),
        np.full(stream.BLOCK_SYMBOLS * 3 + 17, 255, np.uint8),
    ],
    ids=["empty", "one-zero", "one-200", "two", "all256", "all256x1000", "all255"],
)
def test_roundtrip_edge_cases(sym: np.ndarray) -> None:
    _roundtrip(sym)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 65535, 65536, 65537, 3 * 65536 + 17])
@pytest.mark.parametrize("kind", ["sparse", "skewed2", "skewed3", "geometric"])
def test_roundtrip_lengths_around_blocks(n: int, kind: str) -> None:
    probs = {
        "sparse": [0.995, 0.003, 0.002],
        "skewed2": [0.9, 0.1],
        "skewed3": [0.8, 0.15, 0.05],
        "geometric": 0.6 ** np.arange(40),
    }[kind]
    sym = _iid(n, probs, n=n)
    _roundtrip(sym)


def test_roundtrip_zero_runs_at_block_edges() -> None:
    b = stream.BLOCK_SYMBOLS
    sym = np.zeros(5 * b + 3, np.uint8)
    sym[b - 1] = 3  # block ends on a literal
    sym[2 * b] = 4  # block starts on a literal
    sym[4 * b + 5] = 9  # blocks 2 and 3 entirely zero
    sym[-1] = 1
    data = _roundtrip(sym)
    assert data[0] == stream.MODE_ZRUN
    sym[-1] = 0  # stream ends in a run
    sym[-2] = 7
    _roundtrip(sym)


def test_encoding_is_deterministic() -> None:
    sym = _iid(3, [0.6, 0.3, 0.1])
    assert encode_symbols(sym) == encode_symbols(sym.copy())


def test_accepts_memoryview_and_noncontiguous_input() -> None:
    base = _iid(4, [0.7, 0.2, 0.1], n=20_000)
    sym = base[::2]
    data = encode_symbols(sym)
    np.testing.assert_array_equal(decode_symbols(memoryview(data), sym.size), sym)
    np.testing.assert_array_equal(decode_symbols(bytearray(data), sym.size), sym)


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=300).map(lambda b: np.frombuffer(b, np.uint8)),
        st.lists(st.sampled_from([0, 0, 0, 0, 0, 0, 1, 2, 255]), max_size=3000).map(
            lambda v: np.array(v, np.uint8)
        ),
        st.lists(st.sampled_from([5, 5, 5, 9]), max_size=2000).map(lambda v: np.array(v, np.uint8)),
    )
)
def test_roundtrip_hypothesis(sym: np.ndarray) -> None:
    _roundtrip(sym)


# ----------------------------------------------------------------- block independence


def test_blocks_decode_independently() -> None:
    sym = _iid(5, np.ones(16), n=5 * stream.BLOCK_SYMBOLS + 1234)
    data = encode_symbols(sym)
    buf = np.frombuffer(data, np.uint8)
    assert buf[0] == stream.MODE_TUPLE
    _, pos = stream._read_uvarint(buf, 1, "n")
    used, pos = stream._read_symset(buf, pos)
    k = int(buf[pos])
    assert k == 1
    lens, pos = huffman.deserialize_lengths(buf, pos + 1, used.size)
    lut, bits = huffman.decode_table(lens)
    units, offsets = stream._read_blocks(buf, pos, sym.size)
    assert units == stream.BLOCK_SYMBOLS and offsets.size - 1 == 6
    expand = used.astype(np.uint8).reshape(-1, 1)
    for b in (4, 1, 5):  # any block alone, in any order
        out = np.zeros(sym.size, np.uint8)
        status = K.tuple_decode(buf, offsets, lut, bits, expand, units, sym.size, out, b, b + 1)
        assert status == K.STATUS_OK
        sl = slice(b * units, min((b + 1) * units, sym.size))
        np.testing.assert_array_equal(out[sl], sym[sl])
        assert not out[: sl.start].any()


def _blocks_position(buf: np.ndarray) -> int:
    """Where the blocks of a TUPLE stream start."""
    _, pos = stream._read_uvarint(buf, 1, "n")
    used, pos = stream._read_symset(buf, pos)
    k = int(buf[pos])
    return huffman.deserialize_lengths(buf, pos + 1, used.size**k)[1]


@pytest.mark.parametrize("n", [32, 3000, stream.BLOCK_SYMBOLS])
def test_one_block_streams_have_no_size_table(n: int) -> None:
    """Format 4: a stream of one block stores block size 0 and no size table (6 bytes less
    than the sized form, which a small leaf's stream of ~20 bytes felt)."""
    sym = _iid(7, np.array([4.0, 2, 1, 1]), n=n)  # dyadic: plain Huffman (k = 1) is optimal
    data = encode_symbols(sym)
    buf = np.frombuffer(data, np.uint8)
    assert buf[0] == stream.MODE_TUPLE
    pos = _blocks_position(buf)
    assert buf[pos] == 0
    np.testing.assert_array_equal(decode_symbols(data, n), sym)
    # The sized form of the same block (what format 3 wrote) still decodes.
    sized = data[:pos] + stream._uvarint(stream.BLOCK_SYMBOLS) + np.array(
        [len(data) - pos - 1], "<u4").tobytes() + data[pos + 1:]
    np.testing.assert_array_equal(decode_symbols(sized, n), sym)
    assert len(sized) == len(data) + 6  # 3-byte block size and a u32 size, for one 0 byte
    with pytest.raises((FormatError, TruncatedError)):
        decode_symbols(data[:-1], n)
    with pytest.raises(FormatError):
        decode_symbols(data + b"\0", n)


def test_a_one_block_stream_past_the_block_limit_is_refused() -> None:
    sym = _iid(8, np.array([4.0, 2, 1, 1]), n=2 * stream.BLOCK_SYMBOLS)
    data = encode_symbols(sym)
    buf = np.frombuffer(data, np.uint8)
    pos = _blocks_position(buf)
    units, after = stream._read_uvarint(buf, pos, "units")
    assert units == stream.BLOCK_SYMBOLS  # two blocks: the sized form
    one = data[:pos] + b"\0" + data[after + 8:]
    with pytest.raises(FormatError, match="one-block"):
        decode_symbols(one, sym.size)


# --------------------------------------------------------------------------- corruption


def _streams() -> dict[str, tuple[np.ndarray, bytes]]:
    cases = {
        "raw": np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8),
        "const": np.full(3000, 7, np.uint8),
        "tuple1": _iid(1, 0.7 ** np.arange(20), n=150_000),
        "tuplek": _iid(2, [0.9, 0.1], n=150_000),
        "zrun": _iid(3, [0.98, 0.01, 0.005, 0.005], n=150_000),
    }
    return {name: (sym, encode_symbols(sym)) for name, sym in cases.items()}


STREAMS = _streams()


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_truncation_raises(name: str) -> None:
    sym, data = STREAMS[name]
    cuts = sorted(set(range(min(len(data), 64))) | set(range(0, len(data), 97)))
    for cut in cuts:
        with pytest.raises((TruncatedError, FormatError)):
            decode_symbols(data[:cut], sym.size)


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_trailing_bytes_and_wrong_count_raise(name: str) -> None:
    sym, data = STREAMS[name]
    with pytest.raises(FormatError):
        decode_symbols(data + b"\x00", sym.size)
    with pytest.raises(FormatError):
        decode_symbols(data, sym.size + 1)
    with pytest.raises(FormatError):
        decode_symbols(data, sym.size - 1)


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_byte_flips_never_crash(name: str) -> None:
    sym, data = STREAMS[name]
    rng = np.random.default_rng(len(data))
    positions = set(range(min(len(data), 80))) | set(rng.integers(0, len(data), 150).tolist())
    for i in sorted(positions):
        for flip in (0x01, 0x80, 0xFF):
            bad = bytearray(data)
            bad[i] ^= flip
            try:
                out = decode_symbols(bytes(bad), sym.size)
            except (FormatError, TruncatedError):
                continue
            assert out.shape == (sym.size,) and out.dtype == np.uint8


def test_garbage_and_bad_arguments() -> None:
    with pytest.raises(TruncatedError):
        decode_symbols(b"", 0)
    with pytest.raises(FormatError):
        decode_symbols(bytes([9, 3, 0, 0, 0]), 3)
    with pytest.raises(FormatError):
        decode_symbols(bytes([stream.MODE_CONST, 0]), 0)
    with pytest.raises(FormatError):  # uvarint longer than 9 bytes
        decode_symbols(bytes([0] + [0xFF] * 12), 5)
    with pytest.raises(CodecError):
        decode_symbols(b"\x00\x00", -1)
    with pytest.raises(CodecError):
        encode_symbols(np.zeros(4, np.int32))
    with pytest.raises(CodecError):
        encode_symbols(np.zeros((2, 2), np.uint8))
    rng = np.random.default_rng(9)
    for _ in range(300):
        junk = rng.integers(0, 256, int(rng.integers(1, 200)), dtype=np.uint8).tobytes()
        try:
            out = decode_symbols(junk, 100)
        except (FormatError, TruncatedError):
            continue
        assert out.shape == (100,)


def test_huffman_lengths_are_limited_and_complete() -> None:
    counts = (1.6 ** np.arange(60)).astype(np.int64)  # Fibonacci-like: unlimited depth ~59
    lens = huffman.code_lengths(counts, 12)
    assert lens.max() == 12 and lens.min() >= 1
    assert huffman.kraft_sum(lens) == 1 << huffman.MAX_CODE_LEN
    assert np.all(np.diff(lens.astype(int)) <= 0)  # more frequent -> not longer
    lut, bits = huffman.decode_table(lens)
    codes = huffman.canonical_codes(lens)
    for s in range(counts.size):
        entry = lut[int(codes[s]) << (bits - int(lens[s]))]
        assert entry >> 4 == s and entry & 15 == lens[s]
    with pytest.raises(FormatError):
        huffman.decode_table(np.array([1, 1, 1], np.uint8))


# ------------------------------------------------------------------------------ the GIL


def test_every_kernel_releases_the_gil() -> None:
    """Background saves rely on this; checked from the compiled flags, not from timings."""
    from numba.core.registry import CPUDispatcher

    kernels = {n: f for n, f in vars(K).items() if isinstance(f, CPUDispatcher)}
    assert {"tuple_decode", "tuple_encode", "zrun_decode", "zrun_encode"} <= set(kernels)
    for name, kernel in kernels.items():
        assert kernel.targetoptions.get("nogil") is True, name
        assert not kernel.targetoptions.get("parallel"), name  # see the _kernels docstring


def test_concurrent_decodes_agree() -> None:
    streams = [_iid(11, 0.7 ** np.arange(30), n=700_000), _iid(12, [8, 1, 1], n=700_000)]
    encoded = [encode_symbols(s) for s in streams]
    results: list[bool] = []

    def worker(i: int) -> None:
        for _ in range(3):
            results.append(np.array_equal(decode_symbols(encoded[i], streams[i].size), streams[i]))

    threads = [threading.Thread(target=worker, args=(i % 2,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 12


# ---------------------------------------------------------------------------------- varints


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 2**32, 2**63 - 1])
def test_varint_round_trip(value: int) -> None:
    data = varint.encode_uvarint(value)
    for buf in (
        data + b"\x01",
        memoryview(data + b"\x01"),
        np.frombuffer(data + b"\x01", np.uint8),
    ):
        assert varint.read_uvarint(buf, 0, "v") == (value, len(data))
    assert stream._uvarint(value) == data  # the symbol stream writes the same bytes


def test_varint_rejects_bad_encodings() -> None:
    with pytest.raises(ValueError):
        varint.encode_uvarint(-1)
    with pytest.raises(ValueError):
        varint.encode_uvarint(2**63)
    with pytest.raises(FormatError, match="non-canonical"):
        varint.read_uvarint(b"\x80\x00", 0, "v")
    with pytest.raises(FormatError, match="longer than 9"):
        varint.read_uvarint(b"\xff" * 9 + b"\x01", 0, "v")
    with pytest.raises(TruncatedError, match="lossless stream ends inside v"):
        varint.read_uvarint(b"\x81", 0, "v", stream="lossless stream")


# ------------------------------------------------------------------ multi-code decoding


def _tuple_stream_parts(data: bytes, n: int):
    """The decoder's inputs for a TUPLE stream (mirrors ``stream._decode_tuple``)."""
    from orbax_lossy.entropy import stream as S

    buf = np.frombuffer(data, np.uint8)
    assert buf[0] == S.MODE_TUPLE
    _, pos = S._read_uvarint(buf, 1, "")
    used, pos = S._read_symset(buf, pos)
    k, pos = S._read_u8(buf, pos, "")
    lens, pos = huffman.deserialize_lengths(buf, pos, used.size**k)
    lut, bits = huffman.decode_table(lens)
    total = -(-n // k)
    units, offsets = S._read_blocks(buf, pos, total)
    digits = np.arange(used.size**k)
    expand = np.empty((used.size**k, k), np.uint8)
    for j in range(k - 1, -1, -1):
        expand[:, j] = used[digits % used.size]
        digits //= used.size
    return buf, offsets, lut, bits, expand, units, total


@pytest.mark.parametrize("probs", [[1] * 8, [8, 4, 2, 1, 1], [3, 2, 1], [1] * 200,
                                   0.8 ** np.arange(40)])
def test_multi_code_decoder_matches_single_code_decoder(probs) -> None:
    """The multi-code table changes speed only: same bytes and the same status as the
    one-code-per-lookup kernel, on valid streams and on streams with flipped bits."""
    rng = np.random.default_rng(len(probs))
    sym = _iid(3, probs, n=200_003)
    data = encode_symbols(sym)
    assert data[0] == 2, "these distributions are coded in TUPLE mode"
    buf, offsets, lut, bits, expand, units, total = _tuple_stream_parts(data, sym.size)
    table = K.multi_code_table(lut, bits)
    for trial in range(12):
        damaged = buf.copy()
        if trial:
            for i in rng.integers(len(data) - int(offsets[-1] - offsets[0]), len(data), trial):
                damaged[i] ^= np.uint8(1 << int(rng.integers(8)))
        one, many = (np.zeros(total * expand.shape[1], np.uint8) for _ in range(2))
        nb = offsets.size - 1
        s1 = K.tuple_decode(damaged, offsets, lut, bits, expand, units, total, one, 0, nb)
        s2 = K.tuple_decode_multi(damaged, offsets, lut, bits, *table, expand, units, total,
                                  many, 0, nb)
        assert s1 == s2
        if s1 == K.STATUS_OK:
            np.testing.assert_array_equal(one, many)
            if not trial:
                np.testing.assert_array_equal(one[: sym.size], sym)


@pytest.mark.parametrize("kind", ["tuple", "zrun"])
def test_decoded_symbols_are_aligned_for_a_zero_copy_upload(kind):
    """Decoded arrays start on 64 bytes, so XLA:CPU takes them as device buffers without a
    copy (a restore uploads every decoded field)."""
    import jax

    from orbax_lossy.entropy import stream

    rng = np.random.default_rng(3)
    if kind == "zrun":  # one dominant symbol: the zero-run mode
        symbols = np.where(rng.random(300_000) < 0.9, 0, rng.integers(1, 8, 300_000))
    else:
        symbols = rng.integers(0, 8, 300_000)
    symbols = symbols.astype(np.uint8)
    data = stream.encode_symbols(symbols)
    assert data[0] == (stream.MODE_ZRUN if kind == "zrun" else stream.MODE_TUPLE)
    out = stream.decode_symbols(data, symbols.size)
    np.testing.assert_array_equal(out, symbols)
    assert out.ctypes.data % stream.OUTPUT_ALIGNMENT == 0
    on_device = jax.device_put(out, jax.local_devices(backend="cpu")[0])
    assert on_device.unsafe_buffer_pointer() == out.ctypes.data  # aliased, not copied
    region = stream.aligned_empty((7, 13), np.float32)
    assert region.shape == (7, 13) and region.dtype == np.float32
    assert region.flags.c_contiguous and region.ctypes.data % stream.OUTPUT_ALIGNMENT == 0


@pytest.mark.parametrize("mode", ["raw", "const", "tuple", "zrun"])
def test_symbols_outside_the_alphabet_are_refused_in_every_mode(mode):
    rng = np.random.default_rng(7)
    top = 5  # the largest symbol of each stream
    symbols = {
        "raw": rng.permutation(np.arange(20000) % 256).astype(np.uint8),
        "const": np.full(5000, top, np.uint8),
        "tuple": rng.integers(0, top + 1, 20000).astype(np.uint8),
        "zrun": np.where(rng.random(20000) < 0.9, 0, rng.integers(1, top + 1, 20000)),
    }[mode].astype(np.uint8)
    top = int(symbols.max())
    data = encode_symbols(symbols)
    assert data[0] == {"raw": 0, "const": 1, "tuple": 2, "zrun": 3}[mode]
    np.testing.assert_array_equal(decode_symbols(data, symbols.size, top + 1), symbols)
    with pytest.raises(FormatError, match=f"symbol {top} outside the alphabet of {top}"):
        decode_symbols(data, symbols.size, top)
