"""The ZRUN event-table decoder (``_kernels.zrun_decode_bytes``) against the event-by-event
decoders: identical output on valid streams, identical exceptions (type and message) on
damaged ones, for dense streams of short runs (where the table decodes most events), sparse
ones, long codes that do not fit the window, block edges and the thread pool."""

from __future__ import annotations

import numpy as np
import pytest

from orbax_lossy.entropy import _kernels as K
from orbax_lossy.entropy import huffman, stream
from orbax_lossy.entropy.varint import encode_uvarint

BLOCK = stream.BLOCK_SYMBOLS
LITTLE = stream.sys.byteorder == "little"


def _zrun_stream(sym: np.ndarray) -> bytes:
    zsym = int(np.argmax(K.byte_histogram(sym)))
    plan = stream._plan_zrun(sym, zsym)
    return bytes([stream.MODE_ZRUN]) + encode_uvarint(sym.size) + plan.build()


def _outcome(data: bytes, n: int, monkeypatch, *, table: bool, fast: bool = True) -> tuple:
    monkeypatch.setattr(stream, "ZRUN_TABLE", table)
    monkeypatch.setattr(stream, "_LITTLE_ENDIAN", fast and LITTLE)
    try:
        return ("ok", stream.decode_symbols(data, n).tobytes())
    except Exception as exc:  # noqa: BLE001 - compared by type and message
        return (type(exc), str(exc))


def _same(data: bytes, n: int, monkeypatch, *, pool: bool = False) -> tuple:
    """The table decoder, the branch-free one without the table and the plain reference
    agree (one kernel call for all blocks, or ranges of blocks on the pool)."""
    monkeypatch.setattr(stream, "PARALLEL_MIN_BLOCKS", 2 if pool else 1 << 30)
    new = _outcome(data, n, monkeypatch, table=True)
    assert _outcome(data, n, monkeypatch, table=False) == new
    assert _outcome(data, n, monkeypatch, table=False, fast=False) == new
    return new


def _dense(rng: np.random.Generator, n: int, p: float, m: int, zsym: int = 128) -> np.ndarray:
    """Runs of ``zsym`` (probability ``p``) between literals of ``m`` other values."""
    others = np.setdiff1d(rng.choice(256, m + 1, replace=False), [zsym])[:m].astype(np.uint8)
    lit = others[rng.integers(0, m, n)]
    return np.where(rng.random(n) < p, np.uint8(zsym), lit).astype(np.uint8)


def _lengths(rng: np.random.Generator) -> list[int]:
    edges = [1, 2, 15, 16, 17, 31, 33, 100, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 3]
    return edges + [int(rng.integers(1, 4 * BLOCK))]


@pytest.mark.parametrize("p", [0.5, 0.6, 0.75, 0.9])
def test_dense_streams_decode_like_the_reference(p: float, monkeypatch) -> None:
    rng = np.random.default_rng(int(p * 100))
    for m in [1, 2, 5, 40]:
        for n in _lengths(rng):
            sym = _dense(rng, n, p, m)
            if n > 64:
                sym[n - 40 :] = 128  # a block ending in a run
            data = _zrun_stream(sym)
            if data[0] != stream.MODE_ZRUN:
                continue
            assert _same(data, n, monkeypatch) == ("ok", sym.tobytes())
            if n > 2 * BLOCK:
                assert _same(data, n, monkeypatch, pool=True) == ("ok", sym.tobytes())


def test_runs_of_every_length_near_block_ends(monkeypatch) -> None:
    rng = np.random.default_rng(7)
    # runs 0..40 (short ones from the table, 16+ with extra bits), literals at block edges
    runs = np.tile(np.arange(41), 3 * BLOCK // 41 // 21 + 1)
    rng.shuffle(runs)
    parts = [np.concatenate((np.zeros(r, np.uint8), [np.uint8(1 + r % 3)])) for r in runs]
    sym = np.concatenate(parts)[: 3 * BLOCK + 5]
    for end in [BLOCK - 1, BLOCK, 2 * BLOCK - 16, 2 * BLOCK - 17, 3 * BLOCK - 32]:
        sym[end - 1] = 2
    assert _same(_zrun_stream(sym), sym.size, monkeypatch) == ("ok", sym.tobytes())


def test_long_codes_do_not_fit_the_window(monkeypatch) -> None:
    """Literal codes of up to 15 bits (rare symbols) and run codes beyond 12 bits: the table
    holds no event for such windows and the decoder takes them one at a time."""
    rng = np.random.default_rng(11)
    n = 3 * BLOCK
    sym = np.where(rng.random(n) < 0.6, 0, 1).astype(np.uint8)
    rare = rng.choice(n, 300, replace=False)
    sym[rare] = rng.integers(2, 256, 300).astype(np.uint8)
    data = _zrun_stream(sym)
    assert data[0] == stream.MODE_ZRUN
    assert _same(data, n, monkeypatch) == ("ok", sym.tobytes())


def _damaged(data: bytes, rng: np.random.Generator) -> bytes:
    arr = bytearray(data)
    what = int(rng.integers(0, 4))
    if what == 0:  # flip bits in the payload
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


def test_damaged_dense_streams_fail_like_the_reference(monkeypatch) -> None:
    rng = np.random.default_rng(41)
    for n, p, m in [(300, 0.6, 2), (BLOCK + 40, 0.7, 3), (3 * BLOCK, 0.55, 2), (2 * BLOCK, 0.8, 9)]:
        sym = _dense(rng, n, p, m, zsym=0)
        data = _zrun_stream(sym)
        assert _same(data, n, monkeypatch) == ("ok", sym.tobytes())
        seen = set()
        for _ in range(40):
            bad = _damaged(data, rng)
            result = _same(bad, n, monkeypatch)
            assert _same(bad, n, monkeypatch, pool=True) == result
            seen.add(result[1] if result[0] != "ok" else "ok")
        assert len(seen) >= 2


def _plain_events(rlut, rbits, llut, lbits, zsym: int, window: int, bits: int) -> tuple:
    """(bits used, output bytes) of the whole short events a ``bits``-bit window starts
    with, decoded one code at a time (the table's definition)."""
    used, out = 0, b""
    while True:
        rest = bits - used
        peek = ((window << used) & ((1 << bits) - 1))
        e = int(rlut[peek >> (bits - rbits) if rbits <= bits else peek << (rbits - bits)])
        rln, r = e & 15, e >> 4
        if rln == 0 or rln > rest or r >= 16:
            break
        peek = (window << (used + rln)) & ((1 << bits) - 1)
        e = int(llut[peek >> (bits - lbits) if lbits <= bits else peek << (lbits - bits)])
        lln = e & 15
        if lln == 0 or rln + lln > rest or len(out) + r + 1 > K.BYTE_TABLE_MAX:
            break
        out += bytes([zsym]) * r + bytes([e >> 4])
        used += rln + lln
    return used, out


def test_event_table_matches_code_by_code_decoding() -> None:
    rng = np.random.default_rng(5)
    for m, p in [(2, 0.6), (3, 0.8), (30, 0.5)]:
        sym = _dense(rng, 50_000, p, m, zsym=7)
        zsym = 7
        rh, lh = K.zrun_histograms(sym, zsym, BLOCK, K.RUN_CODE_OF)
        rlut, rbits = huffman.decode_table(K.huffman_code_lengths(rh, 15))
        llut, lbits = huffman.decode_table(K.huffman_code_lengths(lh, 15))
        bits = K.ZRUN_TABLE_BITS
        info, obytes = K.zrun_byte_table(rlut, rbits, llut, lbits, zsym, bits)
        hits = 0
        for v in range(1 << bits):
            used, out = _plain_events(rlut, rbits, llut, lbits, zsym, v, bits)
            expect = used | (len(out) << 8) if out else 0
            assert int(info[v]) == expect
            row = obytes[v * K.BYTE_TABLE_MAX : (v + 1) * K.BYTE_TABLE_MAX].tobytes()
            assert row[: len(out)] == out
            hits += bool(out)
        assert hits > (1 << bits) // 2
