"""Shared numba kernels of the entropy coder: Huffman code lengths, code length tables, bit I/O.

The tuple-mode and zero-run-mode kernels in :mod:`orbax_lossy.entropy._kernels` are built on
these; that module re-exports every name defined here, so callers import only ``_kernels``.

Every kernel is ``@njit(nogil=True, cache=True)`` and single threaded: parallelism comes from
the Python wrapper running independent blocks on a thread pool, which works because the
kernels release the GIL. ``parallel=True`` is deliberately not used (numba's workqueue
threading layer aborts when two Python threads enter parallel regions concurrently).

Bit order: codes are written MSB-first; a block starts on a byte boundary and its last byte is
padded with zero bits. Decoders never read outside ``data[start:end]`` of the block: bytes
past the end read as zero, and over-consumption is reported as an error status afterwards.

Decoders report problems through an integer status instead of raising, so that the Python
wrapper can raise the library's own exception types.
"""

from __future__ import annotations

import numpy as np
from numba import njit

STATUS_OK = 0
STATUS_BAD_CODE = 1  # a bit pattern that is not a code of the table
STATUS_OVERRUN = 2  # the block's symbols need more bits than the block holds
STATUS_RUN_TOO_LONG = 3  # a zero run crosses the end of its block
STATUS_TRAILING = 4  # the block holds whole bytes that its symbols do not use


# ----------------------------------------------------------------------------- Huffman lengths


@njit(nogil=True, cache=True)
def huffman_code_lengths(counts: np.ndarray, max_len: int) -> np.ndarray:
    """Length-limited Huffman code lengths (uint8) for ``counts`` (int64, any size).

    Unused symbols get length 0; a single used symbol gets length 1. Lengths above
    ``max_len`` are fixed with the Kraft-repair heuristic of miniz/zlib, then re-assigned so
    that more frequent symbols never get longer codes.
    """
    a = counts.size
    lens = np.zeros(a, np.uint8)
    idx = np.nonzero(counts > 0)[0]
    nz = idx.size
    if nz == 0:
        return lens
    if nz == 1:
        lens[idx[0]] = 1
        return lens
    order = idx[np.argsort(counts[idx], kind="mergesort")]  # ascending weight, stable
    nn = 2 * nz - 1
    weight = np.empty(nn, np.int64)
    parent = np.zeros(nn, np.int64)
    for i in range(nz):
        weight[i] = counts[order[i]]
    leaf = 0
    head = nz
    tail = nz
    for _ in range(nz - 1):
        pair = np.empty(2, np.int64)
        for j in range(2):
            if leaf < nz and (head == tail or weight[leaf] <= weight[head]):
                pair[j] = leaf
                leaf += 1
            else:
                pair[j] = head
                head += 1
        weight[tail] = weight[pair[0]] + weight[pair[1]]
        parent[pair[0]] = tail
        parent[pair[1]] = tail
        tail += 1
    depth = np.zeros(nn, np.int64)
    for node in range(nn - 2, -1, -1):
        depth[node] = depth[parent[node]] + 1
    num = np.zeros(max(max_len, 64) + 1, np.int64)
    for i in range(nz):
        d = depth[i]
        num[min(d, max_len)] += 1
    total = 0
    for length in range(1, max_len + 1):
        total += num[length] << (max_len - length)
    while total > (1 << max_len):
        num[max_len] -= 1
        for length in range(max_len - 1, 0, -1):
            if num[length] > 0:
                num[length] -= 1
                num[length + 1] += 2
                break
        total -= 1
    # most frequent symbols (end of ``order``) get the shortest codes
    pos = nz - 1
    for length in range(1, max_len + 1):
        for _ in range(num[length]):
            lens[order[pos]] = length
            pos -= 1
    return lens


# ----------------------------------------------------------------------- code length tables


@njit(nogil=True, cache=True)
def serialize_lengths(lens: np.ndarray) -> np.ndarray:
    """Nibble-pack code lengths (0..15), run-length coding the zeros.

    Nibble ``1..15``: one length. ``0, c`` with ``c < 15``: ``c + 1`` zero lengths.
    ``0, 15, hi, lo``: ``16 + (hi << 4 | lo)`` zero lengths. High nibble first; a final odd
    nibble is padded with 0 (the reader stops after ``len(lens)`` entries).
    """
    a = lens.size
    nib = np.empty(2 * a + 8, np.uint8)
    k = 0
    i = 0
    while i < a:
        if lens[i] != 0:
            nib[k] = lens[i]
            k += 1
            i += 1
            continue
        z = 0
        while i + z < a and lens[i + z] == 0 and z < 271:
            z += 1
        i += z
        nib[k] = 0
        if z <= 15:
            nib[k + 1] = z - 1
            k += 2
        else:
            v = z - 16
            nib[k + 1] = 15
            nib[k + 2] = v >> 4
            nib[k + 3] = v & 15
            k += 4
    if k & 1:
        nib[k] = 0
        k += 1
    out = np.empty(k // 2, np.uint8)
    for j in range(k // 2):
        out[j] = (nib[2 * j] << 4) | nib[2 * j + 1]
    return out


@njit(nogil=True, cache=True)
def deserialize_lengths(data: np.ndarray, pos: int, a: int, lens: np.ndarray) -> int:
    """Inverse of :func:`serialize_lengths`, reading from ``data[pos:]`` into ``lens[:a]``.

    Returns the position after the table, ``-1`` if ``data`` ends first, ``-2`` if a zero run
    overshoots the alphabet.
    """
    nbytes = data.size
    k = 2 * pos  # nibble index
    end = 2 * nbytes
    i = 0
    while i < a:
        if k >= end:
            return -1
        v = (data[k >> 1] >> (4 * (1 - (k & 1)))) & 15
        k += 1
        if v != 0:
            lens[i] = v
            i += 1
            continue
        if k >= end:
            return -1
        c = (data[k >> 1] >> (4 * (1 - (k & 1)))) & 15
        k += 1
        if c < 15:
            z = c + 1
        else:
            if k + 2 > end:
                return -1
            hi = (data[k >> 1] >> (4 * (1 - (k & 1)))) & 15
            k += 1
            lo = (data[k >> 1] >> (4 * (1 - (k & 1)))) & 15
            k += 1
            z = 16 + ((hi << 4) | lo)
        if i + z > a:
            return -2
        for j in range(z):
            lens[i + j] = 0
        i += z
    return (k + 1) // 2


# ------------------------------------------------------------------- bit writer and reader
# Small kernels that the encoders and decoders below call in their inner loops; numba
# inlines them (``inline="always"``), so they cost nothing over writing the loop out.


@njit(nogil=True, cache=True)
def kraft_total(lens: np.ndarray, max_len: int) -> int:
    """Sum of ``2**(max_len - length)`` over the nonzero lengths (``2**max_len``: a complete
    code); ``-1`` if a length exceeds ``max_len``."""
    total = 0  # Python ints: numba types them int64, numpy's stubs accept them
    for i in range(lens.size):
        ln = int(lens[i])
        if ln > max_len:
            return -1
        if ln:
            total += 1 << (max_len - ln)
    return total


@njit(nogil=True, cache=True, inline="always")
def _put_bits(out, pos, acc, nacc, value, nbits):
    """Append the ``nbits`` low bits of ``value`` (MSB first), writing every whole byte.

    ``acc`` holds the ``nacc < 8`` pending bits; returns the new ``(pos, acc, nacc)``.
    """
    acc = (acc << np.uint64(nbits)) | np.uint64(value)
    nacc += nbits
    while nacc >= 8:
        nacc -= 8
        out[pos] = np.uint8((acc >> np.uint64(nacc)) & np.uint64(0xFF))
        pos += 1
    return pos, acc, nacc


@njit(nogil=True, cache=True, inline="always")
def _end_block(out, pos, acc, nacc, block_ends, b):
    """Write block ``b``'s pending bits zero padded to a byte, record and return its end."""
    if nacc > 0:
        out[pos] = np.uint8((acc << np.uint64(8 - nacc)) & np.uint64(0xFF))
        pos += 1
    block_ends[b] = pos
    return pos


@njit(nogil=True, cache=True, inline="always")
def _read_code(data, pos, end, buf, nbits, lut, shift):
    """Decode one prefix code with ``lut`` (see ``huffman.decode_table``).

    ``buf`` holds ``nbits`` unread bits MSB-aligned; it is refilled from ``data[pos:end]``
    (bytes past ``end`` read as zero), so a block's consumed bits are always
    ``8 * (pos - start) - nbits``. Returns ``(symbol, length, pos, buf, nbits)``; length 0
    means the bits start no code of the table (nothing is consumed then).
    """
    while nbits <= 56:
        byte = data[pos] if pos < end else 0
        buf |= np.uint64(byte) << np.uint64(56 - nbits)
        pos += 1
        nbits += 8
    e = lut[buf >> shift]
    ln = e & 15
    buf <<= np.uint64(ln)
    nbits -= ln
    return e >> 4, ln, pos, buf, nbits


@njit(nogil=True, cache=True, inline="always")
def _block_status(start, end, pos, nbits):
    """Status of a decoded block ``data[start:end]`` whose reader stopped at ``pos, nbits``."""
    used_bits = 8 * (pos - start) - nbits
    if used_bits > 8 * (end - start):
        return STATUS_OVERRUN
    if (used_bits + 7) // 8 != end - start:
        return STATUS_TRAILING
    return STATUS_OK
