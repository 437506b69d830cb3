"""The encoder's k-tuple search on long streams: sampled pricing, exact output.

Past ``TUPLE_SAMPLE_TUPLES`` pairs, ``_candidate_plans`` prices every tuple size k > 1 on a
strided sample and builds exact plans only for the sizes within ``TUPLE_SAMPLE_MARGIN`` of
the best estimate. These tests hold the stream to within half a percent of the exhaustive
search (every k priced exactly) on the kinds of streams the codecs write, and check that the
chosen stream decodes bit for bit and is deterministic.
"""

from __future__ import annotations

import numpy as np
import pytest

from orbax_lossy.entropy import _kernels as K
from orbax_lossy.entropy import stream
from orbax_lossy.entropy.stream import decode_symbols, encode_symbols

N = 600_000  # > 2 * TUPLE_SAMPLE_TUPLES: the sampled path


def _streams() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    heavy = rng.standard_t(3, N)
    step = 2.5 * np.sqrt(np.mean(heavy**2))
    out = {
        # the Step default's parameter deltas: multiples of 2.5 RMS of a heavy-tailed delta
        "step multiples": (np.clip(np.round(heavy / step), -127, 127) + 128).astype(np.uint8),
        # a 4-symbol LC(2) stream, skewed (Huffman's whole bits are far above the entropy)
        "skewed 4 symbols": rng.choice(4, N, p=[0.9, 0.06, 0.03, 0.01]).astype(np.uint8),
        # 16 symbols, geometric: LC(4)-like
        "geometric 16": np.minimum(rng.geometric(0.45, N) - 1, 15).astype(np.uint8),
        # pairs that repeat, no symbol above 1/2: k = 2 captures the correlation, k = 1 cannot
        "correlated pairs": np.repeat(rng.choice(3, N // 2, p=[0.45, 0.35, 0.2]), 2).astype(
            np.uint8),
        # two symbols, very sparse: ZRUN against tuples of up to 12
        "sparse binary": (rng.random(N) < 0.02).astype(np.uint8),
    }
    return out


@pytest.mark.parametrize("name", list(_streams()))
def test_sampled_search_within_half_a_percent_of_exact(name: str, monkeypatch) -> None:
    sym = _streams()[name]
    data = encode_symbols(sym)
    assert np.array_equal(decode_symbols(data, sym.size), sym)
    assert encode_symbols(sym.copy()) == data  # deterministic
    monkeypatch.setattr(stream, "TUPLE_SAMPLE_TUPLES", sym.size)  # every k from its histogram
    exact = encode_symbols(sym)
    assert np.array_equal(decode_symbols(exact, sym.size), sym)
    assert len(data) <= 1.005 * len(exact), (name, len(data), len(exact))


def test_tuples_are_still_chosen_where_they_pay() -> None:
    """The correlated stream must come out as k >= 2 tuples, well below plain Huffman."""
    sym = _streams()["correlated pairs"]
    data = encode_symbols(sym)
    assert data[0] == stream.MODE_TUPLE
    counts = np.bincount(sym, minlength=256)
    used = np.flatnonzero(counts)
    digit = np.zeros(256, np.int64)
    digit[used] = np.arange(used.size)
    plain = stream._plan_tuple(sym, used, 1, counts[used], digit).size
    assert len(data) < 0.8 * plain


def test_sampled_estimate_tracks_exact_size() -> None:
    """The sampled price of a k-tuple plan is within 1% of its exact price."""
    sym = _streams()["geometric 16"]
    counts = np.bincount(sym, minlength=256)
    used = np.flatnonzero(counts)
    digit = np.zeros(256, np.int64)
    digit[used] = np.arange(used.size)
    m = used.size
    for k in (2, 3):
        if m**k > stream.MAX_TUPLE_ALPHABET:
            continue
        exact = stream._plan_tuple(sym, used, k, K.tuple_histogram(sym, digit, m, k, m**k),
                                   digit)
        estimate = stream._sampled_tuple_size(sym, m, k, digit)
        assert abs(estimate - exact.size) <= 0.01 * exact.size, (k, estimate, exact.size)
