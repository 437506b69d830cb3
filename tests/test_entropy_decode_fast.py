"""The byte-table TUPLE decoder (``_kernels.tuple_decode_bytes``) against the code-by-code
reference decoders it replaced: identical output on valid streams, identical exceptions
(type and message) on damaged ones, for k = 1..4, ZRUN, block edges and the thread pool."""

from __future__ import annotations

import numpy as np
import pytest

from orbax_lossy.entropy import _kernels as K
from orbax_lossy.entropy import stream
from orbax_lossy.entropy.varint import encode_uvarint

BLOCK = stream.BLOCK_SYMBOLS


def _source(rng: np.random.Generator, n: int, m: int, p: float) -> np.ndarray:
    """``n`` symbols over ``m`` random byte values, geometric-ish with ratio ``p``."""
    values = rng.choice(255, m, replace=False).astype(np.uint8)  # 255 is left unused
    weights = p ** np.arange(m)
    idx = rng.choice(m, n, p=weights / weights.sum())
    return values[idx]


def _tuple_stream(sym: np.ndarray, k: int) -> bytes:
    """A TUPLE stream of ``sym`` with tuple length ``k`` (whatever the encoder would pick)."""
    counts = K.byte_histogram(sym)
    used = np.flatnonzero(counts)
    m = used.size
    digit = np.zeros(256, np.int64)
    digit[used] = np.arange(m)
    hist = counts[used].astype(np.int64) if k == 1 else K.tuple_histogram(sym, digit, m, k, m**k)
    plan = stream._plan_tuple(sym, used, k, hist, digit)
    return bytes([stream.MODE_TUPLE]) + encode_uvarint(sym.size) + plan.build()


def _zrun_stream(sym: np.ndarray) -> bytes:
    zsym = int(np.argmax(K.byte_histogram(sym)))
    plan = stream._plan_zrun(sym, zsym)
    return bytes([stream.MODE_ZRUN]) + encode_uvarint(sym.size) + plan.build()


def _outcome(data: bytes, n: int, *, reference: bool, monkeypatch) -> tuple:
    """``decode_symbols`` as ("ok", bytes) or (exception type, message)."""
    fast = not reference and stream.sys.byteorder == "little"
    monkeypatch.setattr(stream, "_LITTLE_ENDIAN", fast)
    try:
        return ("ok", stream.decode_symbols(data, n).tobytes())
    except Exception as exc:  # noqa: BLE001 - compared by type and message
        return (type(exc), str(exc))


def _same(data: bytes, n: int, monkeypatch, *, pool: bool = False) -> tuple:
    """Decode with the new and the reference kernels; without the pool, one kernel call
    decodes all blocks (so blocks are paired), with it each call gets a range of blocks."""
    monkeypatch.setattr(stream, "PARALLEL_MIN_BLOCKS", 2 if pool else 1 << 30)
    new = _outcome(data, n, reference=False, monkeypatch=monkeypatch)
    old = _outcome(data, n, reference=True, monkeypatch=monkeypatch)
    assert new == old
    return new


def _lengths(rng: np.random.Generator) -> list[int]:
    edges = [1, 2, 7, 15, 16, 17, 31, 100, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 3]
    return edges[: int(rng.integers(4, len(edges) + 1))] + [int(rng.integers(1, 5 * BLOCK))]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_tuple_streams_decode_like_the_reference(k: int, monkeypatch) -> None:
    rng = np.random.default_rng(100 + k)
    for trial in range(6):
        m = int(rng.integers(2, 9 if k > 1 else 256))
        while k > 1 and m**k > stream.MAX_TUPLE_ALPHABET:
            m -= 1
        p = float(rng.choice([0.15, 0.4, 0.7, 0.95, 1.0]))
        for n in _lengths(rng)[trial % 3 :: 3]:
            sym = _source(rng, n, m, p)
            if np.unique(sym).size < 2:
                continue
            data = _tuple_stream(sym, k)
            result = _same(data, n, monkeypatch)
            assert result == ("ok", sym.tobytes())


def test_encoder_choice_and_thread_pool(monkeypatch) -> None:
    rng = np.random.default_rng(7)
    for m, p in [(7, 0.3), (5, 0.5), (15, 0.7), (240, 0.98), (3, 0.1), (2, 0.5)]:
        sym = _source(rng, int(rng.integers(9 * BLOCK, 12 * BLOCK)), m, p)
        data = stream.encode_symbols(sym)
        assert _same(data, sym.size, monkeypatch, pool=True) == ("ok", sym.tobytes())
        assert _same(data, sym.size, monkeypatch) == ("ok", sym.tobytes())


def test_long_codes_and_large_tuples(monkeypatch) -> None:
    """Codes longer than the table window (fallback lookups) and k up to 12 (m = 2)."""
    rng = np.random.default_rng(11)
    for m, k, p in [(2, 12, 0.2), (3, 7, 0.3), (4, 6, 0.5), (16, 3, 0.6), (64, 2, 0.9)]:
        sym = _source(rng, int(rng.integers(BLOCK, 3 * BLOCK)), m, p)
        data = _tuple_stream(sym, k)
        assert _same(data, sym.size, monkeypatch) == ("ok", sym.tobytes())
    sym = np.repeat(np.arange(200, dtype=np.uint8), 2 ** (np.arange(200) % 14))
    sym = sym[rng.permutation(sym.size)]
    assert _same(_tuple_stream(sym, 1), sym.size, monkeypatch) == ("ok", sym.tobytes())


def test_zrun_streams(monkeypatch) -> None:
    rng = np.random.default_rng(3)
    for n in [1, 50, BLOCK - 1, BLOCK, BLOCK + 5, 3 * BLOCK + 17, 5 * BLOCK]:
        for p in [0.5, 0.9, 0.999]:
            sym = np.where(rng.random(n) < p, 0, rng.integers(1, 9, n)).astype(np.uint8)
            sym[: n // 3] = 0
            sym[n - n // 5 :] = 0  # long runs up to the block ends
            if n > 100:
                sym[BLOCK - 20 : BLOCK - 3] = 5
            data = _zrun_stream(sym)
            assert _same(data, n, monkeypatch) == ("ok", sym.tobytes())
            assert _same(data, n, monkeypatch, pool=True) == ("ok", sym.tobytes())


def test_damaged_zrun_streams_fail_like_the_reference(monkeypatch) -> None:
    rng = np.random.default_rng(31)
    for n, p in [(300, 0.9), (BLOCK + 40, 0.95), (3 * BLOCK, 0.99), (2 * BLOCK, 0.6)]:
        sym = np.where(rng.random(n) < p, 3, rng.integers(0, 12, n)).astype(np.uint8)
        data = _zrun_stream(sym)
        assert _same(data, n, monkeypatch) == ("ok", sym.tobytes())
        seen = set()
        for _ in range(40):
            bad = _damaged(data, rng)
            result = _same(bad, n, monkeypatch)
            assert _same(bad, n, monkeypatch, pool=True) == result
            seen.add(result[1] if result[0] != "ok" else "ok")
        assert len(seen) >= 2


def _damaged(data: bytes, rng: np.random.Generator) -> bytes:
    arr = bytearray(data)
    what = int(rng.integers(0, 4))
    if what == 0:  # flip bits in the second half (payload)
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(len(arr) // 2, len(arr)))
            arr[i] ^= 1 << int(rng.integers(0, 8))
    elif what == 1:  # overwrite a run of payload bytes with 0xFF or 0x00
        i = int(rng.integers(len(arr) // 2, len(arr)))
        j = min(len(arr), i + int(rng.integers(1, 40)))
        arr[i:j] = bytes([0xFF if rng.random() < 0.5 else 0]) * (j - i)
    elif what == 2:  # truncate
        arr = arr[: int(rng.integers(1, len(arr)))]
    else:  # any byte anywhere
        i = int(rng.integers(0, len(arr)))
        arr[i] = int(rng.integers(0, 256))
    return bytes(arr)


def _block_sizes_offset(data: bytes) -> tuple[int, int]:
    """Position and count of the u32 block size table of a TUPLE stream."""
    buf = np.frombuffer(data, np.uint8)
    _, pos = stream._read_uvarint(buf, 1, "n")
    n = stream._read_uvarint(buf, 1, "n")[0]
    used, pos = stream._read_symset(buf, pos)
    k = int(buf[pos])
    lens, pos = stream.huffman.deserialize_lengths(buf, pos + 1, used.size**k)
    units, pos2 = stream._read_uvarint(buf, pos, "units")
    if units == 0:  # the one-block form has no size table
        return pos2, 0
    tuples = -(-n // k)
    nb = -(-tuples // units)
    return pos2, nb


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_damaged_streams_fail_like_the_reference(k: int, monkeypatch) -> None:
    rng = np.random.default_rng(200 + k)
    m = {1: 40, 2: 7, 3: 7, 4: 5}[k]
    for n in [40, BLOCK + 9, 3 * BLOCK]:
        sym = _source(rng, n, m, 0.6)
        data = _tuple_stream(sym, k)
        statuses = set()
        for _ in range(25):
            result = _same(_damaged(data, rng), n, monkeypatch)
            statuses.add(result[1] if result[0] != "ok" else "ok")
        # moving bytes between two blocks keeps the total: the blocks then over- or
        # under-run (or meet bad codes) in the decoders
        pos, nb = _block_sizes_offset(data)
        if nb >= 2:
            sizes = np.frombuffer(data[pos : pos + 4 * nb], "<u4").astype(np.int64)
            for delta in [1, -1, 3, -3]:
                moved = sizes.copy()
                moved[0] += delta
                moved[1] -= delta
                bad = data[:pos] + moved.astype("<u4").tobytes() + data[pos + 4 * nb :]
                result = _same(bad, n, monkeypatch)
                statuses.add(result[1] if result[0] != "ok" else "ok")
        assert len(statuses) >= 2


def _incomplete_stream(sym: np.ndarray, k: int) -> bytes:
    """A TUPLE stream of ``sym`` whose code table is incomplete: the table is built with one
    extra super-symbol that ``sym`` never uses, which gets the last code in canonical order
    (the all-ones patterns), and stored without it: all-ones bit patterns start no code."""
    counts = K.byte_histogram(sym)
    used = np.flatnonzero(counts)
    used = np.append(used, 255)  # one more symbol, the largest, never used
    assert counts[255] == 0
    m = used.size
    digit = np.zeros(256, np.int64)
    digit[used] = np.arange(m)
    hist = K.tuple_histogram(sym, digit, m, k, m**k)
    extra = int(np.flatnonzero(hist == 0)[-1])
    hist[extra] = 1
    lens = stream.huffman.code_lengths(hist)
    order = sorted(np.flatnonzero(lens), key=lambda s: (int(lens[s]), int(s)))
    assert order[-1] == extra
    codes = stream.huffman.canonical_codes(lens)
    units = BLOCK // k
    tuples = -(-sym.size // k)
    nb = -(-tuples // units)
    out = np.empty(sym.size * 2 + 64, np.uint8)
    ends = np.empty(nb, np.int64)
    total = K.tuple_encode(sym, digit, m, k, codes, lens, units, out, ends)
    stored = lens.copy()
    stored[extra] = 0
    head = bytes([m - 1]) + stream._symset_bytes(used) + bytes([k])
    head += stream.huffman.serialize_lengths(stored)
    body = head + stream._blocks_bytes(units, out[:total], ends)
    return bytes([stream.MODE_TUPLE]) + encode_uvarint(sym.size) + body


@pytest.mark.parametrize("k", [1, 3])
def test_bad_code_in_any_block_of_a_group(k: int, monkeypatch) -> None:
    """An incomplete code table, all-ones bytes (bit patterns that are no code) placed in
    one or two of the blocks decoded together (groups of four, two and one), at block
    starts, middles and ends: the first failing block decides, as in the reference
    decoder."""
    rng = np.random.default_rng(5 + k)
    # 7 blocks: four decoded together, then two, then one
    sym = _source(rng, 6 * BLOCK + 77, 7 if k > 1 else 60, 0.7 if k > 1 else 0.93)
    data = _incomplete_stream(sym, k)
    pos, nb = _block_sizes_offset(data)
    sizes = np.frombuffer(data[pos : pos + 4 * nb], "<u4").astype(np.int64)
    starts = pos + 4 * nb + np.concatenate(([0], np.cumsum(sizes)[:-1]))
    assert _same(data, sym.size, monkeypatch) == ("ok", sym.tobytes())
    seen = set()
    damage = [[(b, at)] for b in range(7) for at in (0, 3, 100, 2000, -40, -12, -7, -2)]
    damage += [[(0, at), (1, at)] for at in (3, 100, -12, -2)]
    damage += [[(0, -2), (1, 100)], [(0, -7), (1, 3)], [(2, -2), (3, 50)], [(1, 40), (3, 3)]]
    damage += [[(0, 100), (1, -2)], [(2, 9), (3, -2)], [(3, -2), (4, 100)]]
    damage += [[(4, -2), (5, 100)], [(5, 3), (6, -7)], [(1, -12), (5, -2)], [(3, 100), (6, 3)]]
    for spots in damage:
        bad = bytearray(data)
        for b, at in spots:
            i = int(starts[b]) + (at if at >= 0 else int(sizes[b]) + at)
            i = min(max(i, int(starts[b])), int(starts[b] + sizes[b]) - 1)
            j = min(i + 6, int(starts[b] + sizes[b]))
            bad[i:j] = b"\xff" * (j - i)
        result = _same(bytes(bad), sym.size, monkeypatch)
        assert _same(bytes(bad), sym.size, monkeypatch, pool=True) == result
        seen.add(result[1] if result[0] != "ok" else "ok")
    assert any("no Huffman code" in str(x) for x in seen)


def test_byte_table_matches_greedy_codes() -> None:
    """Each byte-table entry holds the output bytes of the whole codes the window starts
    with (as many as fit in BYTE_TABLE_MAX bytes) and their total length."""
    rng = np.random.default_rng(9)
    for m, k in [(7, 3), (5, 4), (200, 1), (2, 12)]:
        sym = _source(rng, 20000, m, 0.5)
        used = np.unique(sym)
        hist = np.bincount(rng.integers(0, used.size**k, 5000), minlength=used.size**k)
        lens = stream.huffman.code_lengths(hist)
        lut, bits = stream.huffman.decode_table(lens)
        expand = np.empty((used.size**k, k), np.uint8)
        digits = np.arange(used.size**k)
        for j in range(k - 1, -1, -1):
            expand[:, j] = used[digits % used.size]
            digits //= used.size
        w = K.BYTE_TABLE_BITS
        info, obytes = K.byte_table(lut, bits, expand, w)
        tables = K.tuple_tables(lens, used.astype(np.int64), k, w)
        assert tables[1] == bits
        for got, want in zip(tables[:1] + tables[2:], (lut, expand, info, obytes), strict=True):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
        for v in rng.integers(0, 1 << w, 300):
            used_bits, nbytes, out = 0, 0, []
            while True:
                window = (int(v) << used_bits) & ((1 << w) - 1)
                peek = window >> (w - bits) if bits <= w else window << (bits - w)
                e = int(lut[peek])
                ln = e & 15
                if ln == 0 or ln > w - used_bits or nbytes + k > K.BYTE_TABLE_MAX:
                    break
                out += list(expand[e >> 4])
                used_bits += ln
                nbytes += k
            assert int(info[v]) == (used_bits | nbytes << 8 if nbytes else 0)
            row = obytes[v * K.BYTE_TABLE_MAX : v * K.BYTE_TABLE_MAX + nbytes]
            assert list(row) == out


def test_blocks_on_this_thread_decodes_the_same_without_the_pool(monkeypatch):
    rng = np.random.default_rng(7)
    symbols = rng.choice(7, size=300_000, p=[0.5, 0.2, 0.1, 0.08, 0.06, 0.04, 0.02])
    data = stream.encode_symbols(symbols.astype(np.uint8))
    submitted = []
    pool = stream._pool()
    real_submit = pool.submit

    def submit(*args, **kwargs):
        submitted.append(1)
        return real_submit(*args, **kwargs)

    monkeypatch.setattr(pool, "submit", submit)
    parallel = stream.decode_symbols(data, symbols.size)
    used_pool = bool(submitted)
    submitted.clear()
    with stream.blocks_on_this_thread():
        serial = stream.decode_symbols(data, symbols.size)
    assert not submitted  # nothing handed to the entropy pool
    assert used_pool == (stream._pool()._max_workers > 1)
    np.testing.assert_array_equal(serial, parallel)
    np.testing.assert_array_equal(serial, symbols)


@pytest.mark.parametrize("window", [8, 9, 10, 11, 12])
def test_every_table_window_decodes_alike(window: int, monkeypatch) -> None:
    """A stream's byte-table window follows its length (``stream._window_bits``: a short
    stream builds a smaller table); whatever the window, TUPLE (codes longer than the window
    included) and ZRUN streams decode as the code-by-code reference does."""
    monkeypatch.setattr(stream, "_window_bits", lambda lookups, most: window)
    rng = np.random.default_rng(window)
    sym = np.repeat(np.arange(200, dtype=np.uint8), 2 ** (np.arange(200) % 14))
    sym = sym[rng.permutation(sym.size)]
    pairs = _source(rng, 3 * BLOCK, 9, 0.6)
    for source, k in [(sym, 1), (pairs, 2)]:
        data = _tuple_stream(source, k)
        assert _same(data, source.size, monkeypatch) == ("ok", source.tobytes())
    sparse = np.where(rng.random(4 * BLOCK) < 0.95, 0, rng.integers(1, 9, 4 * BLOCK))
    sparse = sparse.astype(np.uint8)
    assert _same(_zrun_stream(sparse), sparse.size, monkeypatch) == ("ok", sparse.tobytes())
