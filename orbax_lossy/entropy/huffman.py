"""Canonical, length-limited Huffman codes.

A code is fully described by its code lengths (0 = symbol unused, 1..15). Codes are assigned
canonically: symbols sorted by (length, symbol value) receive consecutive code values, MSB
first, so the code of the i-th symbol in that order is ``kraft_prefix_i >> (max_len - len_i)``
where ``kraft_prefix_i = sum_{j < i} 2^(max_len - len_j)``.

Serialised table (see :func:`serialize_lengths`): one nibble per length, zero runs coded as
``0, c`` (``c + 1`` zeros, ``c < 15``) or ``0, 15, hi, lo`` (``16 + hi*16 + lo`` zeros),
high nibble first, padded to whole bytes. A table is valid when it is complete or
incomplete (Kraft sum <= 1); over-subscribed tables are rejected.

Decoding uses a lookup table of ``2^table_bits`` int32 entries, ``table_bits`` being the
longest code length: entry ``e = symbol << 4 | length`` for every bit pattern whose prefix
is that symbol's code, ``0`` for patterns that start no code (incomplete tables).
"""

from __future__ import annotations

import numpy as np

from orbax_lossy.entropy import _kernels as K
from orbax_lossy.errors import FormatError, TruncatedError

#: longest code length the encoder produces and the decoder accepts
MAX_CODE_LEN = 15


def code_lengths(counts: np.ndarray, max_len: int = MAX_CODE_LEN) -> np.ndarray:
    """Length-limited Huffman code lengths (uint8, 0 for unused symbols) of a histogram."""
    if not 1 <= max_len <= MAX_CODE_LEN:
        raise ValueError(f"max_len must be in 1..{MAX_CODE_LEN}, got {max_len}")
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    if np.count_nonzero(counts) > (1 << max_len):
        raise ValueError(f"{np.count_nonzero(counts)} symbols do not fit in {max_len}-bit codes")
    return K.huffman_code_lengths(counts, max_len)


def kraft_sum(lengths: np.ndarray) -> int:
    """Kraft sum of the code lengths scaled by ``2^MAX_CODE_LEN`` (complete code: 2^15)."""
    total = int(K.kraft_total(np.ascontiguousarray(lengths, dtype=np.uint8).reshape(-1),
                              MAX_CODE_LEN))
    if total < 0:
        raise ValueError(f"a code length above {MAX_CODE_LEN}")
    return total


def _canonical_order(lens: np.ndarray) -> np.ndarray:
    used = np.flatnonzero(lens)
    return used[np.argsort(lens[used], kind="stable")]


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical code values (uint32, MSB-first, ``lengths[s]`` bits) for every symbol."""
    lens = np.asarray(lengths, dtype=np.int64)
    codes = np.zeros(lens.size, np.uint32)
    order = _canonical_order(lens)
    if order.size == 0:
        return codes
    weights = np.left_shift(1, MAX_CODE_LEN - lens[order], dtype=np.int64)
    prefix = np.concatenate(([0], np.cumsum(weights)[:-1]))
    codes[order] = (prefix >> (MAX_CODE_LEN - lens[order])).astype(np.uint32)
    return codes


def decode_table(lengths: np.ndarray) -> tuple[np.ndarray, int]:
    """Lookup table ``(lut, table_bits)`` for table-driven decoding (see module docstring).

    Raises FormatError if the lengths are out of range or over-subscribed.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.size and (lens.min() < 0 or lens.max() > MAX_CODE_LEN):
        raise FormatError(f"Huffman code length out of range 0..{MAX_CODE_LEN}")
    if kraft_sum(lens) > (1 << MAX_CODE_LEN):
        raise FormatError("Huffman code lengths are over-subscribed (Kraft sum > 1)")
    order = _canonical_order(lens)
    bits = int(lens.max()) if order.size else 1
    reps = np.left_shift(1, bits - lens[order], dtype=np.int64)
    entries = ((order.astype(np.int64) << 4) | lens[order]).astype(np.int32)
    lut = np.zeros(1 << bits, np.int32)
    filled = np.repeat(entries, reps)
    lut[: filled.size] = filled
    return lut, bits


def serialize_lengths(lengths: np.ndarray) -> bytes:
    """Serialise code lengths (values 0..15) as described in the module docstring."""
    lens = np.ascontiguousarray(lengths, dtype=np.uint8)
    return K.serialize_lengths(lens).tobytes()


def deserialize_lengths(data: np.ndarray, pos: int, alphabet: int) -> tuple[np.ndarray, int]:
    """Read a serialised table of ``alphabet`` lengths at ``data[pos:]``.

    Returns ``(lengths, position after the table)``; raises TruncatedError/FormatError.
    """
    lens = np.zeros(alphabet, np.uint8)
    end = K.deserialize_lengths(data, pos, alphabet, lens)
    if end == -1:
        raise TruncatedError("stream ends inside a Huffman code-length table")
    if end < 0:
        raise FormatError("Huffman code-length table has a zero run past the alphabet end")
    if kraft_sum(lens) > (1 << MAX_CODE_LEN):
        raise FormatError("Huffman code lengths are over-subscribed (Kraft sum > 1)")
    return lens, int(end)


def serialized_size(lengths: np.ndarray) -> int:
    """Size in bytes of :func:`serialize_lengths` of ``lengths``."""
    return len(serialize_lengths(lengths))
