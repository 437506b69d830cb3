"""Numba kernels of the entropy coder's two modes: tuple mode and zero-run mode.

The shared kernels (Huffman code lengths, code length tables, bit writer and reader, the
``STATUS_*`` values) live in :mod:`orbax_lossy.entropy._core_kernels` and are re-exported
here, so ``from orbax_lossy.entropy import _kernels as K`` reaches every kernel. The
conventions stated there hold here too: every kernel is ``@njit(nogil=True, cache=True)``
and never ``parallel=True``, codes are MSB-first in byte-aligned blocks, and decoders
report an integer status instead of raising.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic
from numba.typed import List

from orbax_lossy.entropy._core_kernels import STATUS_BAD_CODE as STATUS_BAD_CODE
from orbax_lossy.entropy._core_kernels import STATUS_OK as STATUS_OK
from orbax_lossy.entropy._core_kernels import STATUS_OVERRUN as STATUS_OVERRUN
from orbax_lossy.entropy._core_kernels import STATUS_RUN_TOO_LONG as STATUS_RUN_TOO_LONG
from orbax_lossy.entropy._core_kernels import STATUS_TRAILING as STATUS_TRAILING
from orbax_lossy.entropy._core_kernels import _block_status as _block_status
from orbax_lossy.entropy._core_kernels import _end_block as _end_block
from orbax_lossy.entropy._core_kernels import _put_bits as _put_bits
from orbax_lossy.entropy._core_kernels import _read_code as _read_code
from orbax_lossy.entropy._core_kernels import deserialize_lengths as deserialize_lengths
from orbax_lossy.entropy._core_kernels import huffman_code_lengths as huffman_code_lengths
from orbax_lossy.entropy._core_kernels import kraft_total as kraft_total
from orbax_lossy.entropy._core_kernels import serialize_lengths as serialize_lengths

#: number of run codes of the zero-run mode (runs 0..15 literal, then 4 buckets per octave)
RUN_ALPHABET = 68
#: the largest zero-run block the encoder uses; run lengths go up to this value
MAX_RUN_BLOCK = 1 << 16


def _run_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run-length code tables: code -> (base, extra bits), and run length -> code."""
    base = np.zeros(RUN_ALPHABET, np.int64)
    extra = np.zeros(RUN_ALPHABET, np.int64)
    base[:16] = np.arange(16)
    for code in range(16, RUN_ALPHABET):
        e, sub = 4 + (code - 16) // 4, (code - 16) % 4
        base[code] = (4 + sub) << (e - 2)
        extra[code] = e - 2
    r = np.arange(MAX_RUN_BLOCK + 1, dtype=np.int64)
    code_of = np.minimum(r, 15).astype(np.uint8)
    big = r >= 16
    octave = np.floor(np.log2(np.maximum(r, 1))).astype(np.int64)
    bucket = (r >> np.maximum(octave - 2, 0)) & 3
    code_of[big] = (16 + (octave[big] - 4) * 4 + bucket[big]).astype(np.uint8)
    return base, extra, code_of


RUN_BASE, RUN_EXTRA, RUN_CODE_OF = _run_tables()


# ------------------------------------------------------------------------------- histograms


@njit(nogil=True, cache=True)
def byte_histogram(symbols: np.ndarray) -> np.ndarray:
    """Counts of each byte value (``np.bincount(symbols, minlength=256)`` without widening
    the input to int64 first; four interleaved tables hide the store-to-load dependency)."""
    tables = np.zeros((4, 256), np.int64)
    n = symbols.size
    full = n - n % 4
    for i in range(0, full, 4):
        tables[0, symbols[i]] += 1
        tables[1, symbols[i + 1]] += 1
        tables[2, symbols[i + 2]] += 1
        tables[3, symbols[i + 3]] += 1
    for i in range(full, n):
        tables[0, symbols[i]] += 1
    return tables[0] + tables[1] + tables[2] + tables[3]


# ------------------------------------------------------------------------------- tuple mode


@njit(nogil=True, cache=True, inline="always")
def _tuple_value(symbols, digit, m, k, t):
    """Super-symbol of tuple ``t``: its ``k`` digits as a base-``m`` number, 0-padded at the end."""
    n = symbols.size
    v = 0
    for i in range(t * k, t * k + k):
        v = v * m + (digit[symbols[i]] if i < n else 0)
    return v


@njit(nogil=True, cache=True)
def tuple_histogram(symbols: np.ndarray, digit: np.ndarray, m: int, k: int, alpha: int):
    """Histogram of the k-tuples (base-``m`` numbers of the symbols' digits), tail 0-padded."""
    hist = np.zeros(alpha, np.int64)
    full = symbols.size // k
    for t in range(full):  # whole tuples, without the padding test of _tuple_value
        v = 0
        for i in range(t * k, t * k + k):
            v = v * m + digit[symbols[i]]
        hist[v] += 1
    if full * k < symbols.size:
        hist[_tuple_value(symbols, digit, m, k, full)] += 1
    return hist


@njit(nogil=True, cache=True)
def strided_tuple_histogram(symbols: np.ndarray, digit: np.ndarray, m: int, k: int, alpha: int,
                            stride: int, count: int):
    """Histogram of ``count`` whole k-tuples, the j-th starting at symbol ``j * stride * k``
    (a sample for pricing; no copy of the sampled tuples)."""
    hist = np.zeros(alpha, np.int64)
    for j in range(count):
        v = 0
        start = j * stride * k
        for i in range(start, start + k):
            v = v * m + digit[symbols[i]]
        hist[v] += 1
    return hist


@njit(nogil=True, cache=True)
def tuple_encode(
    symbols: np.ndarray,
    digit: np.ndarray,
    m: int,
    k: int,
    codes: np.ndarray,
    lens: np.ndarray,
    units_per_block: int,
    out: np.ndarray,
    block_ends: np.ndarray,
) -> int:
    """Huffman-code the k-tuples, block by block; returns the number of bytes written."""
    n = symbols.size
    units = (n + k - 1) // k
    pos = 0
    nb = block_ends.size
    for b in range(nb):
        u0 = b * units_per_block
        u1 = min(u0 + units_per_block, units)
        acc = np.uint64(0)
        nacc = 0
        for t in range(u0, u1):
            v = _tuple_value(symbols, digit, m, k, t)
            pos, acc, nacc = _put_bits(out, pos, acc, nacc, codes[v], lens[v])
        pos = _end_block(out, pos, acc, nacc, block_ends, b)
    return pos


@njit(nogil=True, cache=True, inline="always")
def _decode_codes(data, pos, end, buf, nbits, lut, shift, expand, out, o, count):
    """Decode ``count`` codes one lookup each, writing their ``expand`` rows at ``out[o:]``;
    returns ``(ok, pos, buf, nbits, o)`` (not ok: a bit pattern that is no code)."""
    k = expand.shape[1]
    for _ in range(count):
        s, ln, pos, buf, nbits = _read_code(data, pos, end, buf, nbits, lut, shift)
        if ln == 0:
            return False, pos, buf, nbits, o
        for j in range(k):
            out[o + j] = expand[s, j]
        o += k
    return True, pos, buf, nbits, o


@njit(nogil=True, cache=True)
def tuple_decode(
    data: np.ndarray,
    offsets: np.ndarray,
    lut: np.ndarray,
    lut_bits: int,
    expand: np.ndarray,
    units_per_block: int,
    total_units: int,
    out: np.ndarray,
    b0: int,
    b1: int,
) -> int:
    """Decode blocks ``b0..b1-1`` of a tuple stream into ``out`` (``total_units * k`` bytes).

    ``lut[peek(lut_bits)] = symbol << 4 | length`` (length 0: not a code). ``expand[s]`` are
    the ``k`` output bytes of super-symbol ``s``. Returns a ``STATUS_*`` value.
    """
    k = expand.shape[1]
    shift = np.uint64(64 - lut_bits)
    for b in range(b0, b1):
        pos = offsets[b]
        end = offsets[b + 1]
        u0 = b * units_per_block
        cnt = min(units_per_block, total_units - u0)
        o = u0 * k
        buf = np.uint64(0)
        nbits = 0
        ok, pos, buf, nbits, o = _decode_codes(data, pos, end, buf, nbits, lut, shift, expand,
                                               out, o, cnt)
        if not ok:
            return STATUS_BAD_CODE
        status = _block_status(offsets[b], end, pos, nbits)
        if status != STATUS_OK:
            return status
    return STATUS_OK


#: bits of the multi-code lookup table of ``tuple_decode_multi`` (4096 entries)
MULTI_BITS = 12
#: the most codes one multi-code lookup decodes
MULTI_CODES = 4


@njit(nogil=True, cache=True)
def multi_code_table(lut: np.ndarray, lut_bits: int):
    """Per ``MULTI_BITS``-bit window: how many whole codes it starts with (at most
    ``MULTI_CODES``), the bits they use and their symbols, decoded greedily with ``lut``.

    A window whose first code is longer than the window (or no code) gets count 0, and the
    decoder falls back to one ``lut`` lookup; so the table changes speed, never the result.
    """
    size = 1 << MULTI_BITS
    counts = np.zeros(size, np.uint8)
    used_bits = np.zeros(size, np.uint8)
    symbols = np.zeros((size, MULTI_CODES), np.int32)
    mask = (1 << MULTI_BITS) - 1
    for v in range(size):
        used = 0
        c = 0
        while c < MULTI_CODES:
            rest = MULTI_BITS - used
            if rest <= 0:
                break
            window = (v << used) & mask
            if lut_bits <= MULTI_BITS:
                peek = window >> (MULTI_BITS - lut_bits)
            else:
                peek = window << (lut_bits - MULTI_BITS)
            e = lut[peek]
            ln = e & 15
            if ln == 0 or ln > rest:
                break
            symbols[v, c] = e >> 4
            used += ln
            c += 1
        counts[v] = c
        used_bits[v] = used
    return counts, used_bits, symbols


@njit(nogil=True, cache=True)
def tuple_decode_multi(
    data: np.ndarray,
    offsets: np.ndarray,
    lut: np.ndarray,
    lut_bits: int,
    counts: np.ndarray,
    used_bits: np.ndarray,
    symbols: np.ndarray,
    expand: np.ndarray,
    units_per_block: int,
    total_units: int,
    out: np.ndarray,
    b0: int,
    b1: int,
) -> int:
    """``tuple_decode`` with up to ``MULTI_CODES`` codes per lookup (``multi_code_table``);
    bit-identical output and statuses, about twice as fast on skewed small alphabets."""
    k = expand.shape[1]
    shift = np.uint64(64 - lut_bits)
    mshift = np.uint64(64 - MULTI_BITS)
    for b in range(b0, b1):
        pos = offsets[b]
        end = offsets[b + 1]
        u0 = b * units_per_block
        remaining = min(units_per_block, total_units - u0)
        o = u0 * k
        buf = np.uint64(0)
        nbits = 0
        while remaining >= MULTI_CODES:
            while nbits <= 56:
                byte = data[pos] if pos < end else 0
                buf |= np.uint64(byte) << np.uint64(56 - nbits)
                pos += 1
                nbits += 8
            v = buf >> mshift
            c = counts[v]
            if c == 0:
                s, ln, pos, buf, nbits = _read_code(data, pos, end, buf, nbits, lut, shift)
                if ln == 0:
                    return STATUS_BAD_CODE
                for j in range(k):
                    out[o + j] = expand[s, j]
                o += k
                remaining -= 1
                continue
            for i in range(c):
                s = symbols[v, i]
                for j in range(k):
                    out[o + j] = expand[s, j]
                o += k
            ln = used_bits[v]
            buf <<= np.uint64(ln)
            nbits -= ln
            remaining -= c
        ok, pos, buf, nbits, o = _decode_codes(data, pos, end, buf, nbits, lut, shift, expand,
                                               out, o, remaining)
        if not ok:
            return STATUS_BAD_CODE
        status = _block_status(offsets[b], end, pos, nbits)
        if status != STATUS_OK:
            return status
    return STATUS_OK


# ------------------------------------------------------------- byte-table tuple decoding
# ``tuple_decode_bytes`` replaces the per-code output loops by one lookup per window that
# yields the window's whole output bytes (up to BYTE_TABLE_MAX), written with two unaligned
# 8-byte stores, and refills its bit buffer with one unaligned 8-byte load. Both need a
# little-endian host (the Python wrapper falls back to ``tuple_decode`` elsewhere).


@intrinsic
def _load_be64(typingctx, arr, idx):
    """``arr[idx:idx+8]`` (uint8, caller guarantees in bounds) as a big-endian uint64."""

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.bitcast(builder.gep(a.data, [args[1]]), ir.IntType(64).as_pointer())
        return builder.bswap(builder.load(ptr, align=1))

    return types.uint64(arr, idx), codegen


@intrinsic
def _store_u64(typingctx, arr, idx, val):
    """Store ``val`` in native byte order at ``arr[idx:idx+8]`` (caller guarantees in bounds)."""

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.bitcast(builder.gep(a.data, [args[1]]), ir.IntType(64).as_pointer())
        builder.store(args[2], ptr, align=1)
        return context.get_dummy_value()

    return types.void(arr, idx, val), codegen


@intrinsic
def _copy16(typingctx, dst, o, src, i):
    """``dst[o:o+16] = src[i:i+16]`` (uint8 arrays, caller guarantees in bounds), one
    unaligned 16-byte load and store."""

    def codegen(context, builder, sig, args):
        vec = ir.VectorType(ir.IntType(8), 16).as_pointer()
        d = context.make_array(sig.args[0])(context, builder, args[0])
        s = context.make_array(sig.args[2])(context, builder, args[2])
        src_ptr = builder.bitcast(builder.gep(s.data, [args[3]]), vec)
        dst_ptr = builder.bitcast(builder.gep(d.data, [args[1]]), vec)
        builder.store(builder.load(src_ptr, align=1), dst_ptr, align=1)
        return context.get_dummy_value()

    return types.void(dst, o, src, i), codegen


@intrinsic
def _fill16(typingctx, dst, o, val):
    """``dst[o:o+16] = val`` (uint8 array, caller guarantees in bounds), one 16-byte store."""

    def codegen(context, builder, sig, args):
        i8 = ir.IntType(8)
        byte = builder.trunc(args[2], i8) if args[2].type.width > 8 else args[2]
        vec = ir.Constant(ir.VectorType(i8, 16), None)
        for j in range(16):
            vec = builder.insert_element(vec, byte, ir.Constant(ir.IntType(32), j))
        d = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.bitcast(builder.gep(d.data, [args[1]]), vec.type.as_pointer())
        builder.store(vec, ptr, align=1)
        return context.get_dummy_value()

    return types.void(dst, o, val), codegen


@intrinsic
def _fill64(typingctx, dst, o, val):
    """``dst[o:o+64] = val`` (uint8 array, caller guarantees in bounds), one 64-byte vector
    store (split by the backend into what the CPU has)."""

    def codegen(context, builder, sig, args):
        i8 = ir.IntType(8)
        byte = builder.trunc(args[2], i8) if args[2].type.width > 8 else args[2]
        vec = ir.Constant(ir.VectorType(i8, 64), None)
        for j in range(64):
            vec = builder.insert_element(vec, byte, ir.Constant(ir.IntType(32), j))
        d = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.bitcast(builder.gep(d.data, [args[1]]), vec.type.as_pointer())
        builder.store(vec, ptr, align=1)
        return context.get_dummy_value()

    return types.void(dst, o, val), codegen


#: window bits of the byte table of ``tuple_decode_bytes``
BYTE_TABLE_BITS = 12
#: the most output bytes one byte-table entry holds (two 8-byte stores)
BYTE_TABLE_MAX = 16


@njit(nogil=True, cache=True)
def byte_table(lut: np.ndarray, lut_bits: int | np.integer, expand: np.ndarray, window_bits: int):
    """Per ``window_bits``-bit window: the output bytes of the whole codes it starts with
    (greedy, at most ``BYTE_TABLE_MAX`` bytes), as ``info[v] = bits_used | n_bytes << 8``
    and ``obytes[v * BYTE_TABLE_MAX:]``.

    A window whose first code is longer than the window (or no code) gets ``info`` 0 and the
    decoder falls back to one ``lut`` lookup; so the table changes speed, never the result.
    """
    k = expand.shape[1]
    size = 1 << window_bits
    info = np.zeros(size, np.uint16)
    obytes = np.zeros(size * BYTE_TABLE_MAX, np.uint8)
    mask = size - 1
    # the k <= 8 bytes of each super-symbol as one native-order word (byte j at address j)
    alpha = expand.shape[0]
    packed = np.zeros(alpha, np.uint64)
    if k <= 8:
        for s in range(alpha):
            for j in range(k):
                packed.view(np.uint8)[8 * s + j] = expand[s, j]
    for v in range(size):
        used = 0
        nb = 0
        base = v * BYTE_TABLE_MAX
        lo = np.uint64(0)
        hi = np.uint64(0)
        while nb + k <= BYTE_TABLE_MAX:
            rest = window_bits - used
            if rest <= 0:
                break
            window = (v << used) & mask
            if lut_bits <= window_bits:
                peek = window >> (window_bits - lut_bits)
            else:
                peek = window << (lut_bits - window_bits)
            e = lut[peek]
            ln = e & 15
            if ln == 0 or ln > rest:
                break
            s = e >> 4
            if k <= 8:
                w = packed[s]
                if nb < 8:
                    lo |= w << np.uint64(8 * nb)
                    if nb + k > 8:
                        hi |= w >> np.uint64(8 * (8 - nb))
                else:
                    hi |= w << np.uint64(8 * (nb - 8))
            else:
                for j in range(k):
                    obytes[base + nb + j] = expand[s, j]
            nb += k
            used += ln
        if k <= 8:
            _store_u64(obytes, base, lo)
            _store_u64(obytes, base + 8, hi)
        if nb > 0:
            info[v] = used | (nb << 8)
    return info, obytes


@njit(nogil=True, cache=True)
def decode_lut(lens: np.ndarray):
    """``(lut, lut_bits)`` equal to ``huffman.decode_table(lens)`` for lengths as read by
    ``huffman.deserialize_lengths`` (so in range and not over-subscribed)."""
    alpha = lens.size
    bits = 0  # Python ints here and below: numba types them int64, numpy's stubs accept them
    for s in range(alpha):
        bits = max(bits, int(lens[s]))
    if bits == 0:
        bits = 1
    # canonical order (length, symbol): each length's entries start after the shorter ones
    count = np.zeros(16, np.int64)
    for s in range(alpha):
        count[lens[s]] += 1
    nxt = np.zeros(16, np.int64)
    p = 0
    for length in range(1, 16):
        nxt[length] = p
        if length <= bits:
            p += count[length] << (bits - length)
    lut = np.zeros(1 << bits, np.int32)
    for s in range(alpha):
        ln = int(lens[s])
        if ln:
            e = np.int32((s << 4) | ln)
            q = nxt[ln]
            lut[q : q + (1 << (bits - ln))] = e
            nxt[ln] = q + (1 << (bits - ln))
    return lut, bits


@njit(nogil=True, cache=True)
def tuple_tables(lens: np.ndarray, used: np.ndarray, k: int, window_bits: int):
    """Everything ``tuple_decode_bytes`` needs from a TUPLE stream's header, in one call:
    ``(lut, lut_bits, expand, info, obytes)``; ``lut, lut_bits`` equal
    ``huffman.decode_table(lens)`` (:func:`decode_lut`), ``expand`` the output bytes of each
    super-symbol and ``info, obytes`` the ``byte_table``."""
    alpha = lens.size
    m = used.size
    lut, bits = decode_lut(lens)
    expand = np.empty((alpha, k), np.uint8)
    digits = np.zeros(k, np.int64)  # of s, base m, counted up (no divisions)
    for s in range(alpha):
        for j in range(k):
            expand[s, j] = used[digits[j]]
        j = k - 1
        while j >= 0:
            digits[j] += 1
            if digits[j] < m:
                break
            digits[j] = 0
            j -= 1
    info, obytes = byte_table(lut, bits, expand, window_bits)
    return lut, bits, expand, info, obytes


@njit(nogil=True, cache=True, inline="always")
def _bytes_safe_steps(pos, end, o, oend):
    """Lookups that are safe after one checked lookup: each writes <= BYTE_TABLE_MAX bytes
    and, with >= 41 valid bits left (a lookup uses <= 15), refills <= 2 bytes."""
    return min((end - 8 - pos) // 2 + 1, (oend - o) // BYTE_TABLE_MAX)


# The lookup step of tuple_decode_bytes works on raw addresses: a helper that takes the
# arrays themselves (numba inlining) leaves reference count calls in the loop and measured
# 13-17x slower than the step written out; with the arrays' addresses (``_address``, taken
# once per call) the helpers hold only integers, inline to the written-out step and measured
# 11-13% faster than it. Bounds are the caller's: every loop below keeps the reads inside
# the block and the writes inside the block's output.
#
#   refill: buf |= be64(data + pos) >> nbits    (56..63 valid bits after this)
#           pos += (63 - nbits) >> 3; nbits |= 56
#   lookup: e = info[buf >> wshift]
#           e != 0: copy 16 table bytes, advance by the entry's byte count and bits
#           e == 0: one code with lut (first code longer than the window), or, at a bit
#                   pattern that is no code, nothing at all: the state stays just before
#                   it, the loop sees a round without output and leaves the report to the
#                   exact path


def _element_pointer(builder, address, index, itemsize, ty):
    """LLVM pointer of type ``ty*`` to element ``index`` of ``itemsize`` bytes at
    ``address`` (an integer)."""
    offset = builder.mul(index, ir.Constant(index.type, itemsize)) if itemsize > 1 else index
    base = builder.inttoptr(address, ir.IntType(8).as_pointer())
    return builder.bitcast(builder.gep(base, [offset]), ty.as_pointer())


@intrinsic
def _address(typingctx, arr):
    """The data address of a C-contiguous array, as an integer (the caller keeps the array
    alive while the address is used)."""
    if not isinstance(arr, types.Array) or arr.layout != "C":
        return None

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.ptrtoint(a.data, ir.IntType(64))

    return types.intp(arr), codegen


@intrinsic
def _be64_at(typingctx, address, idx):
    """Bytes ``idx..idx+7`` at ``address`` as a big-endian uint64 (unaligned)."""

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(builder, args[0], args[1], 1, ir.IntType(64))
        return builder.bswap(builder.load(ptr, align=1))

    return types.uint64(address, idx), codegen


def _int_loader(name: str, bits: int, signed: bool):
    """An intrinsic ``name(address, idx)``: element ``idx`` of the ``bits``-bit integer array
    at ``address``, widened to int64 (sign-extended where ``signed``)."""

    def load(typingctx, address, idx):
        def codegen(context, builder, sig, args):
            ptr = _element_pointer(builder, args[0], args[1], bits // 8, ir.IntType(bits))
            widen = builder.sext if signed else builder.zext
            return widen(builder.load(ptr), ir.IntType(64))

        return types.int64(address, idx), codegen

    load.__name__ = load.__qualname__ = name
    return intrinsic(load)


_u16_at = _int_loader("_u16_at", 16, signed=False)  # the byte table's info entries
_i32_at = _int_loader("_i32_at", 32, signed=True)  # the code lookup table's entries


@intrinsic
def _copy_at(typingctx, dst, o, src, i, width):
    """Copy ``width`` (a literal 1 or 16) bytes from ``src + i`` to ``dst + o``, unaligned."""
    if not isinstance(width, types.IntegerLiteral) or width.literal_value not in (1, 16):
        return None
    n = width.literal_value

    def codegen(context, builder, sig, args):
        ty = ir.VectorType(ir.IntType(8), n) if n > 1 else ir.IntType(8)
        value = builder.load(_element_pointer(builder, args[2], args[3], 1, ty), align=1)
        builder.store(value, _element_pointer(builder, args[0], args[1], 1, ty), align=1)
        return context.get_dummy_value()

    return types.void(dst, o, src, i, width), codegen


@njit(nogil=True, cache=True, inline="always")
def _refill(data, buf, nbits, pos):
    """Top up the bit buffer from the stream bytes at address ``data``: returns
    ``(buf, nbits, pos)`` with 56..63 valid bits (8 bytes at ``pos`` must be readable)."""
    buf |= _be64_at(data, pos) >> np.uint64(nbits)
    return buf, nbits | 56, pos + ((63 - nbits) >> 3)


@njit(nogil=True, cache=True, inline="always")
def _lookup(tables, buf, nbits, o):
    """One byte-table step at output position ``o``; ``tables = (info, obytes, lut, expand,
    out, k, wshift, shift)`` with addresses for the arrays. Returns ``(buf, nbits, o)``;
    at a bit pattern that is no code, unchanged."""
    info, obytes, lut, expand, out, k, wshift, shift = tables
    v = buf >> wshift
    e: int = _u16_at(info, v)
    if e != 0:
        _copy_at(out, o, obytes, v * BYTE_TABLE_MAX, 16)
        ln = e & 255
        o += e >> 8
    else:
        e = _i32_at(lut, buf >> shift)
        ln = e & 15
        if ln != 0:
            row = (e >> 4) * k
            for j in range(k):
                _copy_at(out, o + j, expand, row + j, 1)
            o += k
    return buf << np.uint64(ln), nbits - ln, o


#: output bytes that a lanes round may write per lane: three lookups
_ROUND_BYTES = 3 * BYTE_TABLE_MAX


@njit(nogil=True, cache=True, inline="always")
def _round_steps(end, pos, oend, o):
    """Rounds (one refill, three lookups) that a lane may run unchecked: after a refill the
    buffer holds 64 stream bits, three lookups read <= 45 of them and leave >= 11 valid
    bits, so a refill advances <= 6 bytes; a round writes <= ``_ROUND_BYTES``."""
    return min((end - 8 - pos) // 6 + 1, (oend - o) // _ROUND_BYTES)


@njit(nogil=True, cache=True, inline="always")
def _lane_open(end, pos, oend, o):
    return pos + 8 <= end and o + _ROUND_BYTES <= oend


@njit(nogil=True, cache=True)
def _tuple_lanes4(data, offsets, tables, st, bufs, b):
    """The lookup rounds of ``tuple_decode_bytes`` over blocks ``b..b+3`` together: four
    dependency chains in flight (two measured 10-19% slower per thread). States are
    ``st[i] = pos, nbits, o, oend`` and ``bufs[i]``, updated in place; the rounds stop when
    a lane nears its block's end or output end, or makes no progress (a bit pattern that is
    no code), and the caller finishes each block on its own. (:func:`_stream_lanes4`
    inlined with one stream's tables for every lane: LLVM then keeps one copy of them.)"""
    _stream_lanes4(data, tables, tables, tables, tables, offsets[b + 1], offsets[b + 2],
                   offsets[b + 3], offsets[b + 4], st, bufs)


@njit(nogil=True, cache=True)
def _tuple_lanes2(data, offsets, tables, st, bufs, b):
    """:func:`_tuple_lanes4` for two blocks ``b, b+1``."""
    _stream_lanes2(data, tables, tables, offsets[b + 1], offsets[b + 2], st, bufs)


@njit(nogil=True, cache=True, inline="always")
def _finish_lookups(data, tables, end, pos, nbits, o, oend, buf):
    """Byte-table lookups of one block until 8 input or ``BYTE_TABLE_MAX`` output bytes
    remain: two per refill while 26+ bits are valid and two entries fit, else one (safe
    steps as in :func:`_bytes_safe_steps`). Returns ``(pos, nbits, o, buf)``."""
    while pos + 8 <= end and o + 2 * BYTE_TABLE_MAX <= oend:
        if nbits < 26:
            steps = 1
        else:
            steps = min((end - 8 - pos) // 4 + 1, (oend - o) // (2 * BYTE_TABLE_MAX))
        r = o
        for _ in range(steps):
            buf, nbits, pos = _refill(data, buf, nbits, pos)
            buf, nbits, o = _lookup(tables, buf, nbits, o)
            buf, nbits, o = _lookup(tables, buf, nbits, o)
        if o == r:  # stuck at a bit pattern that is no code
            break
    while pos + 8 <= end and o + BYTE_TABLE_MAX <= oend:
        steps = 1 if nbits < 41 else _bytes_safe_steps(pos, end, o, oend)
        r = o
        for _ in range(steps):
            buf, nbits, pos = _refill(data, buf, nbits, pos)
            buf, nbits, o = _lookup(tables, buf, nbits, o)
        if o == r:
            break
    return pos, nbits, o, buf


@njit(nogil=True, cache=True)
def tuple_decode_bytes(
    data: np.ndarray,
    offsets: np.ndarray,
    lut: np.ndarray,
    lut_bits: int,
    info: np.ndarray,
    obytes: np.ndarray,
    window_bits: int,
    expand: np.ndarray,
    units_per_block: int,
    total_units: int,
    out: np.ndarray,
    b0: int,
    b1: int,
) -> int:
    """``tuple_decode`` with one ``byte_table`` lookup per window; bit-identical output and
    statuses.

    Lookups run while 8 input bytes remain in the block (branch-free refill: the bit buffer
    keeps 56..63 valid bits, the bits below them are the stream's next bits, so the
    byte-wise refill of the exact tail ORs in the same values) and ``BYTE_TABLE_MAX``
    output bytes remain in the block (so blocks decoded by other threads are never
    touched); the rest of a block is decoded code by code as in ``tuple_decode``. Blocks
    are decoded four at a time (two or one at the end of the range), their lookups
    interleaved to overlap the dependency chains; a block stuck at a bad code stops the
    group, and the blocks are finished in order, so the first failing block decides the
    status as before.
    """
    k = expand.shape[1]
    shift = np.uint64(64 - lut_bits)
    wshift = np.uint64(64 - window_bits)
    tables = (_address(info), _address(obytes), _address(lut), _address(expand),
              _address(out), k, wshift, shift)
    stream = _address(data)
    # per block: reader state (pos, nbits), output position and end; the bit buffers
    st = np.zeros((4, 4), np.int64)
    bufs = np.zeros(4, np.uint64)
    b = b0
    while b < b1:
        lanes = 4 if b + 3 < b1 else (2 if b + 1 < b1 else 1)
        for i in range(lanes):
            u0 = (b + i) * units_per_block
            st[i, 0] = offsets[b + i]
            st[i, 1] = 0
            st[i, 2] = u0 * k
            st[i, 3] = (u0 + min(units_per_block, total_units - u0)) * k
            bufs[i] = 0
        if lanes == 4:
            _tuple_lanes4(stream, offsets, tables, st, bufs, b)
        elif lanes == 2:
            _tuple_lanes2(stream, offsets, tables, st, bufs, b)
        for i in range(lanes):  # finish the blocks in order, each on its own
            end = offsets[b + i + 1]
            oend = st[i, 3]
            pos, nbits, o, buf = _finish_lookups(stream, tables, end, st[i, 0], st[i, 1],
                                                 st[i, 2], oend, bufs[i])
            ok, pos, buf, nbits, o = _decode_codes(data, pos, end, buf, nbits, lut, shift,
                                                   expand, out, o, (oend - o) // k)
            if not ok:
                return STATUS_BAD_CODE
            status = _block_status(offsets[b + i], end, pos, nbits)
            if status != STATUS_OK:
                return status
        b += lanes
    # the arrays behind the addresses in ``tables`` are this call's arguments: alive here
    return STATUS_OK


# ----------------------------------------------------------- many small streams at once
# A restore of many small leaves decodes thousands of one-block TUPLE streams (46 k symbols
# each for a 360-leaf 64 MB state); one at a time, each is a single dependency chain plus
# its header's Python. ``decode_streams`` reads the headers, builds the tables and decodes
# the TUPLE streams four at a time, one lane each, and the ZRUN streams one by one, in one
# call.

#: ``decode_streams`` status of a stream it does not decode (another mode, several
#: blocks, a header or code it does not accept, too small an output): the caller decodes
#: that stream on its own (``stream.decode_symbols``), which reports what is wrong with it
STATUS_DECLINED = 100


@njit(nogil=True, cache=True, inline="always")
def _uvarint_at(data, pos, end):
    """``(value, position after it)`` of a canonical varint of at most 9 bytes at
    ``data[pos:end]``; ``(-1, pos)`` for anything else (as ``varint.read_uvarint`` reads)."""
    value = 0
    for i in range(9):
        if pos + i >= end:
            return -1, pos
        b = int(data[pos + i])
        value |= (b & 0x7F) << (7 * i)
        if not b & 0x80:
            if i and b == 0:
                return -1, pos
            return value, pos + i + 1
    return -1, pos


@njit(nogil=True, cache=True, inline="always")
def _kraft_ok(lens):
    """Whether lengths as ``huffman.deserialize_lengths`` accepts them are not
    over-subscribed (``huffman.MAX_CODE_LEN`` = 15)."""
    kraft = kraft_total(lens, 15)
    return 0 <= kraft <= (1 << 15)


@intrinsic
def _u8_pointer(typingctx, address):
    """The integer ``address`` as a ``uint8*`` (for ``numba.carray``; the caller keeps the
    memory alive)."""

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.CPointer(types.uint8)(address), codegen


@njit(nogil=True, cache=True)
def _zrun_stream(data, start, end, n, alphabet, out_address, capacity):
    """Decode the one-block ZRUN stream ``data[start:end]`` of ``n`` symbols below
    ``alphabet`` into ``capacity`` bytes at ``out_address``, as ``stream._decode_zrun``
    does; ``STATUS_OK``, else ``STATUS_DECLINED`` where ``decode_symbols`` would raise or
    take another path."""
    if n <= 0 or n > capacity or n > (1 << 16) or end - start < 3:  # MAX_BLOCK_UNITS
        return STATUS_DECLINED
    stored, pos = _uvarint_at(data, start + 1, end)
    if stored != n or pos >= end:
        return STATUS_DECLINED
    zsym = int(data[pos])
    head = data[:end]
    rlens = np.zeros(RUN_ALPHABET, np.uint8)
    pos = deserialize_lengths(head, pos + 1, RUN_ALPHABET, rlens)
    if pos < 0 or not _kraft_ok(rlens):
        return STATUS_DECLINED
    llens = np.zeros(256, np.uint8)
    pos = deserialize_lengths(head, pos, 256, llens)
    if pos < 0 or not _kraft_ok(llens) or llens[zsym] != 0:
        return STATUS_DECLINED
    top = zsym
    for s in range(256):
        if llens[s] != 0:
            top = max(top, s)
    if top >= alphabet or pos >= end or data[pos] != 0:  # one block: a block size of 0
        return STATUS_DECLINED
    rlut, rbits = decode_lut(rlens)
    llut, lbits = decode_lut(llens)
    window = max(8, min(ZRUN_TABLE_BITS, _bit_length(n) - 6))  # stream._window_bits
    info, obytes = zrun_byte_table(rlut, rbits, llut, lbits, zsym, window)
    offsets = np.empty(2, np.int64)
    offsets[0], offsets[1] = pos + 1, end
    out = carray(_u8_pointer(out_address), n)
    status = zrun_decode_bytes(data, zsym, offsets, rlut, rbits, RUN_BASE, RUN_EXTRA, llut,
                               lbits, info, obytes, window, n, n, out, 0, 1)
    return STATUS_OK if status == STATUS_OK else STATUS_DECLINED


@njit(nogil=True, cache=True)
def _tuple_header(data, start, end, n, alphabet):
    """The header of the TUPLE stream ``data[start:end]`` of ``n`` symbols, read as
    ``stream._decode_tuple`` reads it, for one block only: ``(ok, used, k, lens, begin)``
    with ``begin`` the block's first byte. Not ok where ``decode_symbols`` would raise or
    take another path."""
    none = np.zeros(0, np.int64)
    lens0 = np.zeros(0, np.uint8)
    if n <= 0 or end - start < 3 or data[start] != 2:  # MODE_TUPLE
        return False, none, 0, lens0, 0
    stored, pos = _uvarint_at(data, start + 1, end)
    if stored != n or pos >= end:
        return False, none, 0, lens0, 0
    m = int(data[pos]) + 1
    pos += 1
    if m < 2:
        return False, none, 0, lens0, 0
    width = m if m <= 32 else 32
    if pos + width > end:
        return False, none, 0, lens0, 0
    used = np.empty(m, np.int64)
    if m <= 32:
        for j in range(m):
            used[j] = data[pos + j]
            if j and used[j] <= used[j - 1]:
                return False, none, 0, lens0, 0
    else:
        c = 0
        for j in range(256):
            if (data[pos + (j >> 3)] >> (j & 7)) & 1:
                if c == m:
                    return False, none, 0, lens0, 0
                used[c] = j
                c += 1
        if c != m:
            return False, none, 0, lens0, 0
    pos += width
    if used[m - 1] >= alphabet or pos >= end:
        return False, none, 0, lens0, 0
    k = int(data[pos])
    pos += 1
    if k < 1:
        return False, none, 0, lens0, 0
    alpha = m
    for _ in range(k - 1):
        alpha *= m
        if alpha > 4096:  # stream.MAX_TUPLE_ALPHABET
            return False, none, 0, lens0, 0
    lens = np.zeros(alpha, np.uint8)
    pos = deserialize_lengths(data[:end], pos, alpha, lens)
    if pos < 0:
        return False, none, 0, lens0, 0
    if not _kraft_ok(lens):
        return False, none, 0, lens0, 0
    units = (n + k - 1) // k
    # one block: a block size of 0, then the block to the end of the stream
    if pos >= end or data[pos] != 0 or units > (1 << 16):  # stream.MAX_BLOCK_UNITS
        return False, none, 0, lens0, 0
    return True, used, k, lens, pos + 1


@njit(nogil=True, cache=True, inline="always")
def _stream_lanes4(data, t0, t1, t2, t3, e0, e1, e2, e3, st, bufs):
    """The lookup rounds of four blocks together, lane ``i`` reading the block that ends at
    ``e<i>`` with the tables ``t<i>``: the blocks of one stream (:func:`_tuple_lanes4`) or
    four streams (:func:`decode_streams`). Inlined: given one stream's tables four times as
    a separate function, it measured 9-12% slower on multi-block streams (four copies of the
    tables live per round)."""
    p0, n0, o0, f0 = st[0, 0], st[0, 1], st[0, 2], st[0, 3]
    p1, n1, o1, f1 = st[1, 0], st[1, 1], st[1, 2], st[1, 3]
    p2, n2, o2, f2 = st[2, 0], st[2, 1], st[2, 2], st[2, 3]
    p3, n3, o3, f3 = st[3, 0], st[3, 1], st[3, 2], st[3, 3]
    buf0, buf1, buf2, buf3 = bufs[0], bufs[1], bufs[2], bufs[3]
    steps = 1  # the first refill advances up to 7 bytes: one checked round
    while (_lane_open(e0, p0, f0, o0) and _lane_open(e1, p1, f1, o1)
           and _lane_open(e2, p2, f2, o2) and _lane_open(e3, p3, f3, o3)):
        r0, r1, r2, r3 = o0, o1, o2, o3
        for _ in range(steps):
            buf0, n0, p0 = _refill(data, buf0, n0, p0)
            buf0, n0, o0 = _lookup(t0, buf0, n0, o0)
            buf1, n1, p1 = _refill(data, buf1, n1, p1)
            buf1, n1, o1 = _lookup(t1, buf1, n1, o1)
            buf2, n2, p2 = _refill(data, buf2, n2, p2)
            buf2, n2, o2 = _lookup(t2, buf2, n2, o2)
            buf3, n3, p3 = _refill(data, buf3, n3, p3)
            buf3, n3, o3 = _lookup(t3, buf3, n3, o3)
            for _t in range(2):
                buf0, n0, o0 = _lookup(t0, buf0, n0, o0)
                buf1, n1, o1 = _lookup(t1, buf1, n1, o1)
                buf2, n2, o2 = _lookup(t2, buf2, n2, o2)
                buf3, n3, o3 = _lookup(t3, buf3, n3, o3)
        if o0 == r0 or o1 == r1 or o2 == r2 or o3 == r3:  # a lane is stuck at no code
            break
        steps = min(_round_steps(e0, p0, f0, o0), _round_steps(e1, p1, f1, o1),
                    _round_steps(e2, p2, f2, o2), _round_steps(e3, p3, f3, o3))
    st[0, 0], st[0, 1], st[0, 2], bufs[0] = p0, n0, o0, buf0
    st[1, 0], st[1, 1], st[1, 2], bufs[1] = p1, n1, o1, buf1
    st[2, 0], st[2, 1], st[2, 2], bufs[2] = p2, n2, o2, buf2
    st[3, 0], st[3, 1], st[3, 2], bufs[3] = p3, n3, o3, buf3


@njit(nogil=True, cache=True, inline="always")
def _stream_lanes2(data, t0, t1, e0, e1, st, bufs):
    """:func:`_stream_lanes4` for two streams."""
    p0, n0, o0, f0 = st[0, 0], st[0, 1], st[0, 2], st[0, 3]
    p1, n1, o1, f1 = st[1, 0], st[1, 1], st[1, 2], st[1, 3]
    buf0, buf1 = bufs[0], bufs[1]
    steps = 1
    while _lane_open(e0, p0, f0, o0) and _lane_open(e1, p1, f1, o1):
        r0, r1 = o0, o1
        for _ in range(steps):
            buf0, n0, p0 = _refill(data, buf0, n0, p0)
            buf0, n0, o0 = _lookup(t0, buf0, n0, o0)
            buf1, n1, p1 = _refill(data, buf1, n1, p1)
            buf1, n1, o1 = _lookup(t1, buf1, n1, o1)
            for _t in range(2):
                buf0, n0, o0 = _lookup(t0, buf0, n0, o0)
                buf1, n1, o1 = _lookup(t1, buf1, n1, o1)
        if o0 == r0 or o1 == r1:
            break
        steps = min(_round_steps(e0, p0, f0, o0), _round_steps(e1, p1, f1, o1))
    st[0, 0], st[0, 1], st[0, 2], bufs[0] = p0, n0, o0, buf0
    st[1, 0], st[1, 1], st[1, 2], bufs[1] = p1, n1, o1, buf1


@njit(nogil=True, cache=True)
def decode_streams(data, starts, ends, counts, alphabets, outs, capacities, status):
    """Decode the one-block TUPLE and ZRUN streams ``data[starts[i]:ends[i]]`` of
    ``counts[i]`` symbols below ``alphabets[i]`` into the arrays at addresses ``outs[i]``
    (of ``capacities[i]`` bytes; the caller keeps them alive): TUPLE streams four at a
    time, one lane each, ZRUN streams one by one. ``status[i]``: ``STATUS_OK`` where
    stream ``i`` decoded to exactly what ``stream.decode_symbols`` gives, else
    ``STATUS_DECLINED`` (the output may be partly written). Returns the number of TUPLE
    streams it decoded in lanes (-1: a bug)."""
    count = starts.size
    kept = List()  # per decoded stream: (lut, expand, info, obytes)
    tables = np.zeros((count, 8), np.int64)  # info, obytes, lut, expand, out, k, wshift, shift
    slot = np.zeros(count, np.int64)  # the stream's entry in ``kept``
    begin = np.zeros(count, np.int64)
    valid = np.zeros(count, np.int64)
    nvalid = 0
    for i in range(count):
        status[i] = STATUS_DECLINED
        if ends[i] > starts[i] and data[starts[i]] == 3:  # MODE_ZRUN: decoded here, alone
            status[i] = _zrun_stream(data, starts[i], ends[i], counts[i], alphabets[i],
                                     outs[i], capacities[i])
            continue
        ok, used, k, lens, first = _tuple_header(data, starts[i], ends[i], counts[i],
                                                 alphabets[i])
        units = (counts[i] + k - 1) // k if ok else 0
        if not ok or units * k > capacities[i]:
            continue
        window = max(8, min(BYTE_TABLE_BITS, _bit_length(units) - 6))  # stream._window_bits
        lut, bits, expand, info, obytes = tuple_tables(lens, used, k, window)
        kept.append((lut, expand, info, obytes))
        tables[i, 0], tables[i, 1] = _address(info), _address(obytes)
        tables[i, 2], tables[i, 3] = _address(lut), _address(expand)
        tables[i, 4], tables[i, 5] = outs[i], k
        tables[i, 6], tables[i, 7] = 64 - window, 64 - bits
        slot[i] = len(kept) - 1
        begin[i] = first
        valid[nvalid] = i
        nvalid += 1
    stream: int = _address(data)
    st = np.zeros((4, 4), np.int64)
    bufs = np.zeros(4, np.uint64)
    g = 0
    while g < nvalid:
        lanes = 4 if g + 3 < nvalid else (2 if g + 1 < nvalid else 1)
        for a in range(lanes):
            i = valid[g + a]
            st[a, 0], st[a, 1], st[a, 2] = begin[i], 0, 0
            st[a, 3] = ((counts[i] + tables[i, 5] - 1) // tables[i, 5]) * tables[i, 5]
            bufs[a] = 0
        t0 = _table_tuple(tables, valid[g])
        if lanes == 4:
            _stream_lanes4(stream, t0, _table_tuple(tables, valid[g + 1]),
                          _table_tuple(tables, valid[g + 2]), _table_tuple(tables, valid[g + 3]),
                          ends[valid[g]], ends[valid[g + 1]], ends[valid[g + 2]],
                          ends[valid[g + 3]], st, bufs)
        elif lanes == 2:
            _stream_lanes2(stream, t0, _table_tuple(tables, valid[g + 1]), ends[valid[g]],
                          ends[valid[g + 1]], st, bufs)
        for a in range(lanes):  # finish each stream on its own
            i = valid[g + a]
            t = _table_tuple(tables, i)
            end, oend = ends[i], st[a, 3]
            pos, nbits, o, buf = _finish_lookups(stream, t, end, st[a, 0], st[a, 1], st[a, 2],
                                                 oend, bufs[a])
            lut, expand = kept[slot[i]][:2]
            out = carray(_u8_pointer(outs[i]), oend)
            ok, pos, buf, nbits, o = _decode_codes(data, pos, end, buf, nbits, lut, t[7],
                                                   expand, out, o, (oend - o) // t[5])
            if ok and _block_status(begin[i], end, pos, nbits) == STATUS_OK:
                status[i] = STATUS_OK
        g += lanes
    # The lanes read the tables through their addresses only. Numba frees a variable after
    # its last use, so ``kept`` is used here, after the decoding: the tables stay alive
    # until now (lists of tables unused after the first loop were freed there, and a
    # restore decoded from freed memory).
    return nvalid if len(kept) == nvalid else -1


@njit(nogil=True, cache=True, inline="always")
def _table_tuple(tables, i):
    """Stream ``i``'s row of ``tables`` as the tuple :func:`_lookup` takes."""
    return (tables[i, 0], tables[i, 1], tables[i, 2], tables[i, 3], tables[i, 4],
            tables[i, 5], np.uint64(tables[i, 6]), np.uint64(tables[i, 7]))


@njit(nogil=True, cache=True, inline="always")
def _bit_length(x):
    b = 0
    while x:
        x >>= 1
        b += 1
    return b


# ---------------------------------------------------------------------------- zero-run mode


@njit(nogil=True, cache=True)
def zrun_histograms(symbols: np.ndarray, zsym: int, block: int, run_code_of: np.ndarray):
    """Histograms of run codes and literals of the zero-run events, plus total extra bits."""
    n = symbols.size
    rh = np.zeros(RUN_ALPHABET, np.int64)
    lh = np.zeros(256, np.int64)
    for b0 in range(0, n, block):
        b1 = min(b0 + block, n)
        r = 0
        for i in range(b0, b1):
            s = symbols[i]
            if s == zsym:
                r += 1
            else:
                rh[run_code_of[r]] += 1
                lh[s] += 1
                r = 0
        if r > 0:
            rh[run_code_of[r]] += 1
    return rh, lh


@njit(nogil=True, cache=True)
def zrun_encode(
    symbols: np.ndarray,
    zsym: int,
    block: int,
    run_code_of: np.ndarray,
    run_extra: np.ndarray,
    rcodes: np.ndarray,
    rlens: np.ndarray,
    lcodes: np.ndarray,
    llens: np.ndarray,
    out: np.ndarray,
    block_ends: np.ndarray,
) -> int:
    """Code each block as events (run code [+ extra bits], literal); returns bytes written."""
    n = symbols.size
    pos = 0
    for b in range(block_ends.size):
        b0 = b * block
        b1 = min(b0 + block, n)
        acc = np.uint64(0)
        nacc = 0
        r = 0
        i = b0
        s = symbols[0] if n > 0 else np.uint8(0)
        while True:
            last = i >= b1
            if not last:
                s = symbols[i]
                i += 1
                if s == zsym:
                    r += 1
                    continue
            elif r == 0:
                break
            c = run_code_of[r]
            pos, acc, nacc = _put_bits(out, pos, acc, nacc, rcodes[c], rlens[c])
            x = run_extra[c]
            if x > 0:
                pos, acc, nacc = _put_bits(out, pos, acc, nacc, r & ((1 << x) - 1), x)
            if last:
                break
            pos, acc, nacc = _put_bits(out, pos, acc, nacc, lcodes[s], llens[s])
            r = 0
        pos = _end_block(out, pos, acc, nacc, block_ends, b)
    return pos


@njit(nogil=True, cache=True)
def zrun_decode(
    data: np.ndarray,
    zsym: int,
    offsets: np.ndarray,
    rlut: np.ndarray,
    rbits: int,
    run_base: np.ndarray,
    run_extra: np.ndarray,
    llut: np.ndarray,
    lbits: int,
    block: int,
    n: int,
    out: np.ndarray,
    b0: int,
    b1: int,
) -> int:
    """Decode blocks ``b0..b1-1`` of a zero-run stream into ``out``; returns a ``STATUS_*``."""
    rshift = np.uint64(64 - rbits)
    lshift = np.uint64(64 - lbits)
    z = np.uint8(zsym)
    for b in range(b0, b1):
        pos = offsets[b]
        end = offsets[b + 1]
        o = b * block
        oend = min(o + block, n)
        buf = np.uint64(0)
        nbits = 0
        while o < oend:
            c, ln, pos, buf, nbits = _read_code(data, pos, end, buf, nbits, rlut, rshift)
            if ln == 0:
                return STATUS_BAD_CODE
            r = run_base[c]
            x = run_extra[c]
            if x > 0:
                r += np.int64(buf >> np.uint64(64 - x))
                buf <<= np.uint64(x)
                nbits -= x
            if r > oend - o:
                return STATUS_RUN_TOO_LONG
            for j in range(o, o + r):
                out[j] = z
            o += r
            if o == oend:
                break
            lit, ln, pos, buf, nbits = _read_code(data, pos, end, buf, nbits, llut, lshift)
            if ln == 0:
                return STATUS_BAD_CODE
            out[o] = np.uint8(lit)
            o += 1
        status = _block_status(offsets[b], end, pos, nbits)
        if status != STATUS_OK:
            return status
    return STATUS_OK


@njit(nogil=True, cache=True)
def zrun_decode_fast(
    data: np.ndarray,
    zsym: int,
    offsets: np.ndarray,
    rlut: np.ndarray,
    rbits: int,
    run_base: np.ndarray,
    run_extra: np.ndarray,
    llut: np.ndarray,
    lbits: int,
    block: int,
    n: int,
    out: np.ndarray,
    b0: int,
    b1: int,
) -> int:
    """``zrun_decode`` with the branch-free 8-byte refill of ``tuple_decode_bytes`` while 8
    input bytes remain in the block, and runs written 16 bytes at a time while the block's
    output has room (bytes past the run are overwritten by what follows); bit-identical
    output and statuses."""
    rshift = np.uint64(64 - rbits)
    lshift = np.uint64(64 - lbits)
    z = np.uint8(zsym)
    for b in range(b0, b1):
        pos = offsets[b]
        end = offsets[b + 1]
        o = b * block
        oend = min(o + block, n)
        buf = np.uint64(0)
        nbits = 0
        while o < oend:
            if pos + 8 <= end:
                buf |= _load_be64(data, pos) >> np.uint64(nbits)
                pos += (63 - nbits) >> 3
                nbits |= 56
            else:
                while nbits <= 56:
                    byte = data[pos] if pos < end else 0
                    buf |= np.uint64(byte) << np.uint64(56 - nbits)
                    pos += 1
                    nbits += 8
            e = rlut[buf >> rshift]
            ln = e & 15
            if ln == 0:
                return STATUS_BAD_CODE
            buf <<= np.uint64(ln)
            nbits -= ln
            c = e >> 4
            r = run_base[c]
            x = run_extra[c]
            if x > 0:  # >= 41 valid bits left
                r += np.int64(buf >> np.uint64(64 - x))
                buf <<= np.uint64(x)
                nbits -= x
            if r > oend - o:
                return STATUS_RUN_TOO_LONG
            if o + r + 16 <= oend:
                j = o
                while j < o + r:
                    _fill16(out, j, z)
                    j += 16
            else:
                for j in range(o, o + r):
                    out[j] = z
            o += r
            if o == oend:
                break
            if pos + 8 <= end:
                buf |= _load_be64(data, pos) >> np.uint64(nbits)
                pos += (63 - nbits) >> 3
                nbits |= 56
            else:
                while nbits <= 56:
                    byte = data[pos] if pos < end else 0
                    buf |= np.uint64(byte) << np.uint64(56 - nbits)
                    pos += 1
                    nbits += 8
            e = llut[buf >> lshift]
            ln = e & 15
            if ln == 0:
                return STATUS_BAD_CODE
            buf <<= np.uint64(ln)
            nbits -= ln
            out[o] = np.uint8(e >> 4)
            o += 1
        status = _block_status(offsets[b], end, pos, nbits)
        if status != STATUS_OK:
            return status
    return STATUS_OK


#: window bits of the event table of ``zrun_decode_bytes``
ZRUN_TABLE_BITS = 12


@njit(nogil=True, cache=True)
def zrun_byte_table(
    rlut: np.ndarray, rbits: int, llut: np.ndarray, lbits: int, zsym: int, window_bits: int
):
    """Per ``window_bits``-bit window of a zero-run stream: the output bytes of the whole
    events (a run of 0..15 without extra bits, then its literal) it starts with, greedy, at
    most ``BYTE_TABLE_MAX`` bytes, as ``info[v] = bits_used | n_bytes << 8`` and
    ``obytes[v * BYTE_TABLE_MAX:]``, zsym-filled past the events.

    A window whose first event is a long run (extra bits), a bit pattern that is no code or
    does not fit the window gets ``info`` 0 and the decoder takes one event the plain way;
    so the table changes speed, never the result.
    """
    size = 1 << window_bits
    info = np.zeros(size, np.uint16)
    obytes = np.full(size * BYTE_TABLE_MAX, zsym, np.uint8)
    mask = size - 1
    for v in range(size):
        used = 0
        nb = 0
        base = v * BYTE_TABLE_MAX
        while True:
            rest = window_bits - used
            window = (v << used) & mask
            if rbits <= window_bits:
                e = rlut[window >> (window_bits - rbits)]
            else:
                e = rlut[window << (rbits - window_bits)]
            rln = e & 15
            r = e >> 4
            if rln == 0 or rln > rest or r >= 16:  # codes below 16 are runs without extra bits
                break
            window = (v << (used + rln)) & mask
            if lbits <= window_bits:
                e = llut[window >> (window_bits - lbits)]
            else:
                e = llut[window << (lbits - window_bits)]
            lln = e & 15
            if lln == 0 or rln + lln > rest or nb + r + 1 > BYTE_TABLE_MAX:
                break
            obytes[base + nb + r] = e >> 4  # the run's bytes are zsym already
            nb += r + 1
            used += rln + lln
        if nb > 0:
            info[v] = used | (nb << 8)
    return info, obytes


@njit(nogil=True, cache=True)
def zrun_decode_bytes(
    data: np.ndarray,
    zsym: int,
    offsets: np.ndarray,
    rlut: np.ndarray,
    rbits: int,
    run_base: np.ndarray,
    run_extra: np.ndarray,
    llut: np.ndarray,
    lbits: int,
    info: np.ndarray,
    obytes: np.ndarray,
    window_bits: int,
    block: int,
    n: int,
    out: np.ndarray,
    b0: int,
    b1: int,
) -> int:
    """``zrun_decode_fast`` that first tries one ``zrun_byte_table`` lookup per step (while
    16 output bytes of the block remain: whole short events, written with one 16-byte copy
    whose bytes past them are overwritten by what follows); bit-identical output and
    statuses (an event decoded from the table is decoded exactly as the plain path would)."""
    rshift = np.uint64(64 - rbits)
    lshift = np.uint64(64 - lbits)
    wshift = np.uint64(64 - window_bits)
    z = np.uint8(zsym)
    for b in range(b0, b1):
        pos = offsets[b]
        end = offsets[b + 1]
        o = b * block
        oend = min(o + block, n)
        buf = np.uint64(0)
        nbits = 0
        while o < oend:
            if pos + 8 <= end:
                buf |= _load_be64(data, pos) >> np.uint64(nbits)
                pos += (63 - nbits) >> 3
                nbits |= 56
                if o + 2 * BYTE_TABLE_MAX <= oend:  # >= 56 bits: two lookups of <= 12
                    v = buf >> wshift
                    e = np.int64(info[v])
                    if e != 0:
                        _copy16(out, o, obytes, v * BYTE_TABLE_MAX)
                        ln = e & 255
                        buf <<= np.uint64(ln)
                        nbits -= ln
                        o += e >> 8
                        v = buf >> wshift
                        e = np.int64(info[v])
                        if e != 0:
                            _copy16(out, o, obytes, v * BYTE_TABLE_MAX)
                            ln = e & 255
                            buf <<= np.uint64(ln)
                            nbits -= ln
                            o += e >> 8
                        continue
            else:
                while nbits <= 56:
                    byte = data[pos] if pos < end else 0
                    buf |= np.uint64(byte) << np.uint64(56 - nbits)
                    pos += 1
                    nbits += 8
            e = rlut[buf >> rshift]
            ln = e & 15
            if ln == 0:
                return STATUS_BAD_CODE
            buf <<= np.uint64(ln)
            nbits -= ln
            c = e >> 4
            r = run_base[c]
            x = run_extra[c]
            if x > 0:  # >= 41 valid bits left
                r += np.int64(buf >> np.uint64(64 - x))
                buf <<= np.uint64(x)
                nbits -= x
            if r > oend - o:
                return STATUS_RUN_TOO_LONG
            if o + r + 64 <= oend:  # long runs of sparse streams: 64 bytes a step
                j = o
                while j < o + r:
                    _fill64(out, j, z)
                    j += 64
            elif o + r + 16 <= oend:
                j = o
                while j < o + r:
                    _fill16(out, j, z)
                    j += 16
            else:
                for j in range(o, o + r):
                    out[j] = z
            o += r
            if o == oend:
                break
            if pos + 8 <= end:
                buf |= _load_be64(data, pos) >> np.uint64(nbits)
                pos += (63 - nbits) >> 3
                nbits |= 56
            else:
                while nbits <= 56:
                    byte = data[pos] if pos < end else 0
                    buf |= np.uint64(byte) << np.uint64(56 - nbits)
                    pos += 1
                    nbits += 8
            e = llut[buf >> lshift]
            ln = e & 15
            if ln == 0:
                return STATUS_BAD_CODE
            buf <<= np.uint64(ln)
            nbits -= ln
            out[o] = np.uint8(e >> 4)
            o += 1
        status = _block_status(offsets[b], end, pos, nbits)
        if status != STATUS_OK:
            return status
    return STATUS_OK
