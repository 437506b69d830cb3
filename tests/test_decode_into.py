"""``stream.decode_into``: a stream decoded straight into a caller's array (a restore's
pieces go to their place in the field's host array without a second copy)."""

from __future__ import annotations

import numpy as np
import pytest

from orbax_lossy.entropy import stream
from orbax_lossy.errors import CodecError, FormatError

BLOCK = stream.BLOCK_SYMBOLS


def _streams() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    n = 3 * BLOCK + 12  # a multiple of 2, 3 and 4
    return {
        "raw": rng.integers(0, 256, 5000).astype(np.uint8),
        "const": np.full(777, 9, np.uint8),
        "tuple k=1": np.clip(rng.normal(128, 40, n), 0, 255).astype(np.uint8),
        "tuple small": rng.choice(np.array([0, 1, 2, 5], np.uint8), n, p=[0.6, 0.2, 0.15, 0.05]),
        "zrun": np.where(rng.random(n) < 0.8, 128, rng.integers(0, 3, n)).astype(np.uint8),
    }


@pytest.mark.parametrize("name", list(_streams()))
def test_decodes_into_a_slab_of_a_larger_array(name: str) -> None:
    sym = _streams()[name]
    data = stream.encode_symbols(sym)
    host = np.full(sym.size + 64, 77, np.uint8)
    slab = host[32 : 32 + sym.size]
    with stream.decode_into(slab):
        out = stream.decode_symbols(data, sym.size)
        again = stream.decode_symbols(data, sym.size)  # the destination is used once
    assert np.shares_memory(out, slab) and np.array_equal(slab, sym)
    assert not np.shares_memory(again, host) and np.array_equal(again, sym)
    assert np.all(host[:32] == 77) and np.all(host[32 + sym.size :] == 77)  # nothing past it


def test_other_sizes_and_padded_tuples_get_new_arrays() -> None:
    rng = np.random.default_rng(1)
    sym = rng.choice(np.array([0, 1, 2], np.uint8), 10_001, p=[0.7, 0.2, 0.1])
    data = stream.encode_symbols(sym)
    dest = np.zeros(sym.size, np.uint8)
    with stream.decode_into(dest):
        out = stream.decode_symbols(data, sym.size)
    assert np.array_equal(out, sym)
    if data[0] == stream.MODE_TUPLE and sym.size % data[4 + (data[3] + 1)] != 0:
        assert not np.shares_memory(out, dest)  # the last tuple is partial: padded output
    small = stream.encode_symbols(sym[:100])
    dest = np.zeros(sym.size, np.uint8)
    with stream.decode_into(dest):
        out = stream.decode_symbols(small, 100)
    assert not np.shares_memory(out, dest) and np.array_equal(out, sym[:100])


def test_a_damaged_stream_still_raises() -> None:
    sym = _streams()["zrun"]
    data = bytearray(stream.encode_symbols(sym))
    data[-3000:] = b"\xff" * 3000
    with pytest.raises(FormatError), stream.decode_into(np.zeros(sym.size, np.uint8)):
        stream.decode_symbols(bytes(data), sym.size)


def test_destination_must_be_contiguous_uint8() -> None:
    with pytest.raises(CodecError), stream.decode_into(np.zeros((8, 8), np.uint8)[:, :4]):
        pass
    with pytest.raises(CodecError), stream.decode_into(np.zeros(8, np.int16)):
        pass
    with stream.decode_into(None):
        assert np.array_equal(stream.decode_symbols(stream.encode_symbols(np.ones(5, np.uint8)),
                                                    5), np.ones(5, np.uint8))
