"""Self-describing entropy-coded byte-symbol stream.

``encode_symbols`` codes a 1-D uint8 array with canonical, length-limited (15-bit) Huffman
codes in one of several modes, chosen per stream by the exact coded size computed from
histograms; ``decode_symbols`` inverts it bit-exactly. The stream carries no checksum (the
container checksums payloads) but every count, length, table and offset is validated.

Stream layout (``uvarint`` = unsigned LEB128, at most 9 bytes; ``u32le`` = little-endian)::

    stream  := mode:u8  n:uvarint  body          n = number of symbols, must equal decode's n
    mode 0 RAW    body := n bytes                (also used for n == 0)
    mode 1 CONST  body := symbol:u8              (n >= 1 copies of one symbol)
    mode 2 TUPLE  body := (m-1):u8 symset k:u8 table(m^k) blocks
    mode 3 ZRUN   body := zsym:u8 table(68) table(256) blocks

    symset  := m strictly increasing bytes          if m <= 32
             | 32-byte bitmap (bit s&7 of byte s>>3) with exactly m bits set, otherwise
    table(A):= A Huffman code lengths, nibble packed (see orbax_lossy.entropy.huffman)
    blocks  := units:uvarint  size:u32le[nb]  payload[sum(size)]   (nothing may follow)
             | 0:u8  payload                     one block of every unit (written since
                                                 format 4 when nb = 1; payload: the rest)

TUPLE: the m used symbols (``symset``, ascending) are numbered 0..m-1 ("digits"); the input,
padded with digit 0 to a multiple of k, is cut into k-tuples, each a super-symbol
``d_0*m^(k-1) + ... + d_(k-1)`` (so m^k <= 4096 for k > 1; k = 1 is plain Huffman).
ZRUN: ``zsym`` (the most frequent symbol) is coded by its run lengths: every other symbol
becomes the event (run of zsym before it, symbol); a block ending in zsym ends with a run
without symbol. A run r is coded with the run table: codes 0..15 are r itself; code
``16 + 4*(e-4) + s`` (e = floor(log2 r) in 4..16, s = next two bits of r) is followed by
the ``e - 2`` low bits of r, MSB first. The literal table gives zsym length 0.

Blocks: the coded units (TUPLE: k-tuples, ZRUN: input symbols) are cut into blocks of
``units`` units (last one shorter), ``nb = ceil(total_units / units)``. Each block is coded
independently with the stream's tables, MSB-first, starting on a byte boundary and zero
padded to whole bytes; ``size[b]`` is its byte length, so blocks decode independently (the
decoder runs ranges of blocks on a thread pool, GIL released). A block whose symbols need
more bits than it holds, or that holds more whole bytes than they need, is an error.

Mode choice: RAW costs n bytes, CONST one byte; TUPLE (k = 1, and k > 1 when plain
Huffman is measurably above the order-0 entropy) and ZRUN (when one symbol has probability
>= 1/2) are priced exactly from histograms (code lengths x counts + tables + block sizes,
block padding estimated at half a byte). The smallest wins, so the output is never more
than a few bytes larger than the input. On streams of more than ``2 * TUPLE_SAMPLE_TUPLES``
symbols the sizes k > 1 are priced on a strided sample of whole tuples, and only a size
priced within ``TUPLE_SAMPLE_MARGIN`` of the best (1.0: the best) gets an exact histogram
and plan: each k is a pass over the stream, and the exact search took about 40% of the
commit's entropy coding (512 MB state, default policy). On the codecs' streams the sampled choice
was the exact one or within 0.03% of its size.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import sys
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from orbax_lossy.entropy import _kernels as K
from orbax_lossy.entropy import huffman
from orbax_lossy.entropy.varint import encode_uvarint as _uvarint
from orbax_lossy.entropy.varint import read_uvarint
from orbax_lossy.errors import CodecError, FormatError, TruncatedError
from orbax_lossy.threads import available_cores

MODE_RAW = 0
MODE_CONST = 1
MODE_TUPLE = 2
MODE_ZRUN = 3

#: input symbols per block (TUPLE blocks hold ``BLOCK_SYMBOLS // k`` tuples)
BLOCK_SYMBOLS = 1 << 16
#: largest super-symbol alphabet of the TUPLE mode with k > 1
MAX_TUPLE_ALPHABET = 4096
#: the most units per block a decoder accepts
MAX_BLOCK_UNITS = 1 << 16
#: ZRUN is considered when the most frequent symbol has at least this probability
ZRUN_MIN_PROB = 0.5
#: k > 1 tuples are tried when plain Huffman exceeds the entropy by this factor
TUPLE_TRY_RATIO = 1.005
#: past ``2 * TUPLE_SAMPLE_TUPLES`` symbols, k > 1 is priced on a sample of this many tuples
TUPLE_SAMPLE_TUPLES = 1 << 17
#: sampled sizes within this factor of the best price get an exact histogram and plan
#: (1.0: only the best; the sample's error is ~0.1%, the sizes' differences often less)
TUPLE_SAMPLE_MARGIN = 1.0
#: streams with at least this many blocks are decoded on the thread pool
PARALLEL_MIN_BLOCKS = 4

#: decode ZRUN streams with an event table (``_kernels.zrun_decode_bytes``: whole short
#: events per lookup); False selects the event-by-event ``zrun_decode_fast`` (same output)
ZRUN_TABLE = True

#: the byte-table decoder's unaligned 8-byte loads and stores assume a little-endian host
_LITTLE_ENDIAN = sys.byteorder == "little"

_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


# ---------------------------------------------------------------------------- small helpers

#: decoded arrays start on this boundary: XLA:CPU takes such a host array as a device buffer
#: without copying it (a restore uploads its decoded fields with no copy on the CPU backend)
OUTPUT_ALIGNMENT = 64


def aligned_empty(shape: int | tuple[int, ...], dtype: np.dtype | type = np.uint8) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on ``OUTPUT_ALIGNMENT`` bytes
    (numpy's own allocations start 16 bytes into a block)."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(math.prod(shape)) * dtype.itemsize  # (math.prod: 3 us less than np.prod)
    raw = np.empty(nbytes + OUTPUT_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % OUTPUT_ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _read_uvarint(buf: np.ndarray, pos: int, what: str) -> tuple[int, int]:
    return read_uvarint(buf, pos, what, "symbol stream")


def _read_u8(buf: np.ndarray, pos: int, what: str) -> tuple[int, int]:
    if pos >= buf.size:
        raise TruncatedError(f"symbol stream ends before {what}")
    return int(buf[pos]), pos + 1


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            workers = available_cores()
            _POOL = concurrent.futures.ThreadPoolExecutor(workers, "orbax_lossy_entropy")
        return _POOL


def _status_error(status: int) -> FormatError:
    messages = {
        K.STATUS_BAD_CODE: "bit pattern that is no Huffman code of the table",
        K.STATUS_OVERRUN: "block needs more bits than its stored size",
        K.STATUS_RUN_TOO_LONG: "zero run crosses the end of its block",
        K.STATUS_TRAILING: "block has unused trailing bytes",
    }
    return FormatError(f"corrupt symbol stream: {messages.get(status, f'status {status}')}")


_LOCAL = threading.local()


@contextlib.contextmanager
def blocks_on_this_thread() -> Iterator[None]:
    """Decode every stream's blocks on the calling thread inside this context.

    For callers that already decode one stream per thread of their own pool (a restore's
    pieces): handing each stream's blocks to a second pool only adds hand-offs and GIL
    contention between the two pools' threads.
    """
    before = getattr(_LOCAL, "serial", False)
    _LOCAL.serial = True
    try:
        yield
    finally:
        _LOCAL.serial = before


@contextlib.contextmanager
def decode_into(destination: np.ndarray | None) -> Iterator[None]:
    """Inside this context, the first :func:`decode_symbols` call on this thread that decodes
    exactly ``destination.size`` symbols writes them into ``destination`` (a C-contiguous
    uint8 array, e.g. a slab of a larger host array) and returns a 1-D view of it, instead
    of a new array; ``None`` changes nothing.

    For a restore's pieces: a piece decoded straight into its place in the field's host array
    needs no second copy. A TUPLE stream whose padded length exceeds ``n`` (its last tuple is
    partial) still decodes into a new array.
    """
    before = getattr(_LOCAL, "destination", None)
    if destination is not None:
        if (destination.dtype != np.uint8 or not destination.flags.c_contiguous
                or not destination.flags.writeable):
            raise CodecError("a decode destination must be a writeable C-contiguous uint8 array")
        destination = destination.reshape(-1)
    _LOCAL.destination = destination
    try:
        yield
    finally:
        _LOCAL.destination = before


def _output(n: int, padded: int | None = None) -> np.ndarray:
    """The array ``n`` decoded symbols go to (``padded`` >= n bytes are written): the
    :func:`decode_into` destination where it fits exactly (it is used once), else new."""
    destination = getattr(_LOCAL, "destination", None)
    if destination is not None and destination.size == n and (padded is None or padded == n):
        _LOCAL.destination = None
        return destination
    return aligned_empty(n if padded is None else padded)


def _run_blocks(kernel: Callable[[int, int], int], nb: int) -> None:
    """Run ``kernel(b0, b1)`` over all blocks, in parallel ranges when worthwhile."""
    serial = getattr(_LOCAL, "serial", False)
    pool = _pool() if nb >= PARALLEL_MIN_BLOCKS and not serial else None
    workers = pool._max_workers if pool is not None else 1
    if pool is None or workers == 1:
        statuses = [kernel(0, nb)]
    else:
        # ranges of >= 2 blocks where that still gives every worker one: the TUPLE kernel
        # decodes blocks two or four at a time, faster per thread than one by one
        chunks = min(nb, 4 * workers, max(workers, nb // 2))
        bounds = [nb * i // chunks for i in range(chunks + 1)]
        futures = [pool.submit(kernel, bounds[i], bounds[i + 1]) for i in range(chunks)]
        statuses = [f.result() for f in futures]
    for status in statuses:
        if status != K.STATUS_OK:
            raise _status_error(status)


def _as_symbols(symbols: np.ndarray) -> np.ndarray:
    arr = np.asarray(symbols)
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise CodecError(f"symbols must be a 1-D uint8 array, got {arr.dtype} {arr.shape}")
    return np.ascontiguousarray(arr)


def order0_entropy_bits(symbols: np.ndarray) -> float:
    """Total order-0 (Shannon) entropy of the stream in bits: ``n * H(p_hat)``."""
    sym = _as_symbols(symbols)
    n = sym.size
    if n == 0:
        return 0.0
    counts = K.byte_histogram(sym)
    c = counts[counts > 0].astype(np.float64)
    return float(np.sum(c * np.log2(n / c)))


# ----------------------------------------------------------------------------- encoding


def _symset_bytes(used: np.ndarray) -> bytes:
    if used.size <= 32:
        return used.astype(np.uint8).tobytes()
    bits = np.zeros(256, np.uint8)
    bits[used] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def _blocks_bytes(units: int, payload: np.ndarray, block_ends: np.ndarray) -> bytes:
    if block_ends.size == 1:  # one block: its size is the rest of the stream
        return _uvarint(0) + payload.tobytes()
    sizes = np.diff(np.concatenate(([0], block_ends))).astype("<u4")
    return _uvarint(units) + sizes.tobytes() + payload.tobytes()


def _blocks_overhead(units: int, nb: int) -> float:
    """Bytes of :func:`_blocks_bytes` besides the payload, with half a byte of padding per
    block."""
    return (1 if nb == 1 else len(_uvarint(units)) + 4 * nb) + nb / 2


class _Plan:
    """A priced candidate encoding; ``build()`` produces the body bytes."""

    def __init__(self, size: float, mode: int, build: Callable[[], bytes]) -> None:
        self.size = size
        self.mode = mode
        self.build = build


def _plan_tuple(
    sym: np.ndarray, used: np.ndarray, k: int, hist: np.ndarray, digit: np.ndarray
) -> _Plan:
    m = used.size
    lens = huffman.code_lengths(hist)
    bits = int(hist @ lens.astype(np.int64))
    units = BLOCK_SYMBOLS // k
    nb = _ceil_div(_ceil_div(sym.size, k), units)
    table = huffman.serialize_lengths(lens)
    head = bytes([m - 1]) + _symset_bytes(used) + bytes([k]) + table
    size = len(head) + _blocks_overhead(units, nb) + bits / 8

    def build() -> bytes:
        codes = huffman.canonical_codes(lens)
        out = np.empty(bits // 8 + nb + 8, np.uint8)
        ends = np.empty(nb, np.int64)
        total = K.tuple_encode(sym, digit, m, k, codes, lens, units, out, ends)
        return head + _blocks_bytes(units, out[:total], ends)

    return _Plan(size, MODE_TUPLE, build)


def _plan_zrun(sym: np.ndarray, zsym: int) -> _Plan:
    block = BLOCK_SYMBOLS
    rh, lh = K.zrun_histograms(sym, zsym, block, K.RUN_CODE_OF)
    rlens = huffman.code_lengths(rh)
    llens = huffman.code_lengths(lh)
    bits = int(rh @ (rlens.astype(np.int64) + K.RUN_EXTRA) + lh @ llens.astype(np.int64))
    nb = _ceil_div(sym.size, block)
    head = bytes([zsym]) + huffman.serialize_lengths(rlens) + huffman.serialize_lengths(llens)
    size = len(head) + _blocks_overhead(block, nb) + bits / 8

    def build() -> bytes:
        rcodes = huffman.canonical_codes(rlens)
        lcodes = huffman.canonical_codes(llens)
        out = np.empty(bits // 8 + nb + 8, np.uint8)
        ends = np.empty(nb, np.int64)
        total = K.zrun_encode(
            sym, zsym, block, K.RUN_CODE_OF, K.RUN_EXTRA, rcodes, rlens, lcodes, llens, out, ends
        )
        return head + _blocks_bytes(block, out[:total], ends)

    return _Plan(size, MODE_ZRUN, build)


def _candidate_plans(sym: np.ndarray, counts: np.ndarray) -> list[_Plan]:
    n = sym.size
    used = np.flatnonzero(counts)
    m = used.size
    digit = np.zeros(256, np.int64)
    digit[used] = np.arange(m)
    plans = [_Plan(n, MODE_RAW, lambda: sym.tobytes())]
    plans.append(_plan_tuple(sym, used, 1, counts[used].astype(np.int64), digit))
    zsym = int(np.argmax(counts))
    if counts[zsym] >= ZRUN_MIN_PROB * n:
        plans.append(_plan_zrun(sym, zsym))
    c = counts[used].astype(np.float64)
    entropy_bytes = float(np.sum(c * np.log2(n / c))) / 8
    best = min(p.size for p in plans)
    if best <= TUPLE_TRY_RATIO * entropy_bytes + 64:
        return plans
    # k-tuples: the table grows with k, so stop after two sizes in a row without a gain
    sampled = n > 2 * TUPLE_SAMPLE_TUPLES
    priced: dict[int, float] = {}
    k, misses = 2, 0
    while m**k <= MAX_TUPLE_ALPHABET and misses < 2:
        if sampled:
            priced[k] = _sampled_tuple_size(sym, m, k, digit)
        else:
            plan = _plan_tuple(sym, used, k, K.tuple_histogram(sym, digit, m, k, m**k), digit)
            plans.append(plan)
            priced[k] = plan.size
        misses = 0 if priced[k] < best else misses + 1
        best = min(best, priced[k])
        k += 1
    if sampled:
        plans += [_plan_tuple(sym, used, k, K.tuple_histogram(sym, digit, m, k, m**k), digit)
                  for k, size in priced.items() if size <= TUPLE_SAMPLE_MARGIN * best]
    return plans


def _sampled_tuple_size(sym: np.ndarray, m: int, k: int, digit: np.ndarray) -> float:
    """Estimated bytes of ``sym`` coded as k-tuples: the Huffman-coded payload of a strided
    sample of at most ``TUPLE_SAMPLE_TUPLES`` whole tuples, scaled to the stream, plus the
    table and block sizes. Deterministic: the sample depends only on the stream's length.
    (Evenly spaced runs of contiguous tuples, tried instead, misjudged more often: 0.25%.)"""
    full = sym.size // k
    stride = _ceil_div(full, TUPLE_SAMPLE_TUPLES)
    count = _ceil_div(full, stride)
    hist = K.strided_tuple_histogram(sym, digit, m, k, m**k, stride, count)
    lens = huffman.code_lengths(hist)
    payload = int(hist @ lens.astype(np.int64)) / 8 * full / count
    units = BLOCK_SYMBOLS // k
    nb = _ceil_div(_ceil_div(sym.size, k), units)
    return len(huffman.serialize_lengths(lens)) + _blocks_overhead(units, nb) + payload


def encode_symbols(symbols: np.ndarray) -> bytes:
    """Entropy-code a 1-D uint8 array (any length) into a self-describing byte stream.

    The layout is described in the module docstring; the smallest of the candidate modes
    (RAW, CONST, TUPLE with k >= 1, ZRUN) is emitted.
    """
    sym = _as_symbols(symbols)
    n = sym.size
    if n == 0:
        return bytes([MODE_RAW]) + _uvarint(0)
    counts = K.byte_histogram(sym)
    if np.count_nonzero(counts) == 1:
        return bytes([MODE_CONST]) + _uvarint(n) + bytes([int(sym[0])])
    best = min(_candidate_plans(sym, counts), key=lambda p: p.size)
    return bytes([best.mode]) + _uvarint(n) + best.build()


# ----------------------------------------------------------------------------- decoding


def _read_symset(buf: np.ndarray, pos: int) -> tuple[np.ndarray, int]:
    mm1, pos = _read_u8(buf, pos, "alphabet size")
    m = mm1 + 1
    if m < 2:
        raise FormatError("TUPLE stream with fewer than 2 symbols")
    width = m if m <= 32 else 32
    if pos + width > buf.size:
        raise TruncatedError("symbol stream ends inside the symbol set")
    raw = buf[pos : pos + width]
    if m <= 32:
        used = raw.astype(np.int64)
        if (used[1:] <= used[:-1]).any():  # (not np.diff: 3 us less per stream)
            raise FormatError("symbol set is not strictly increasing")
    else:
        used = np.flatnonzero(np.unpackbits(raw, bitorder="little"))
        if used.size != m:
            raise FormatError(f"symbol bitmap has {used.size} symbols, header says {m}")
    return used, pos + width


def _read_blocks(buf: np.ndarray, pos: int, total_units: int) -> tuple[int, np.ndarray]:
    units, pos = _read_uvarint(buf, pos, "block size")
    if units == 0:  # one block (format 4): all units, the rest of the stream
        if not 1 <= total_units <= MAX_BLOCK_UNITS:
            raise FormatError(f"a one-block stream of {total_units} units (at most "
                              f"{MAX_BLOCK_UNITS})")
        return total_units, np.array([pos, buf.size], np.int64)
    if not 1 <= units <= MAX_BLOCK_UNITS:
        raise FormatError(f"block size {units} out of range 1..{MAX_BLOCK_UNITS}")
    nb = _ceil_div(total_units, units)
    if pos + 4 * nb > buf.size:
        raise TruncatedError(f"symbol stream ends inside the table of {nb} block sizes")
    sizes = buf[pos : pos + 4 * nb].view("<u4").astype(np.int64)
    pos += 4 * nb
    offsets = np.empty(nb + 1, np.int64)
    offsets[0] = pos
    np.cumsum(sizes, out=offsets[1:])
    offsets[1:] += pos
    if offsets[-1] > buf.size:
        raise TruncatedError(
            f"symbol stream holds {buf.size - pos} payload bytes, blocks need {offsets[-1] - pos}"
        )
    if offsets[-1] < buf.size:
        raise FormatError(f"{buf.size - offsets[-1]} trailing bytes after the symbol stream")
    return units, offsets


def _implied_mean_length(lens: np.ndarray) -> float:
    """Mean code length under the distribution the lengths imply (``p = 2**-length``)."""
    used = lens[lens > 0].astype(np.float64)
    return float(np.sum(used * np.exp2(-used)) / max(np.sum(np.exp2(-used)), 1e-300))


def _outside(symbol: int, alphabet: int) -> FormatError:
    return FormatError(f"symbol {symbol} outside the alphabet of {alphabet} symbols")


def _window_bits(lookups: int, most: int) -> int:
    """Window bits of a byte table (``K.byte_table``, ``K.zrun_byte_table``) for a stream of
    about ``lookups`` codes: a table costs about ``2**bits`` entries to build, 41 us at 12
    bits, more than decoding 46 k symbols took, so a short stream takes a smaller one (8-12
    bits; the table changes speed, never the result)."""
    return max(8, min(most, int(lookups).bit_length() - 6))


def _decode_tuple(buf: np.ndarray, pos: int, n: int, alphabet: int) -> np.ndarray:
    used, pos = _read_symset(buf, pos)
    if int(used[-1]) >= alphabet:  # every decoded symbol is one of the set (padding too)
        raise _outside(int(used[-1]), alphabet)
    m = used.size
    k, pos = _read_u8(buf, pos, "tuple length")
    if k < 1 or (k > 1 and m**k > MAX_TUPLE_ALPHABET):
        raise FormatError(f"invalid tuple length {k} for {m} symbols")
    alpha = m**k
    lens, pos = huffman.deserialize_lengths(buf, pos, alpha)
    total_units = _ceil_div(n, k)
    units, offsets = _read_blocks(buf, pos, total_units)
    out = _output(n, total_units * k)

    if _LITTLE_ENDIAN:  # the lengths are valid (deserialize_lengths), so no checks here
        window = _window_bits(total_units, K.BYTE_TABLE_BITS)
        lut, lut_bits, expand, info, obytes = K.tuple_tables(lens, used, k, window)

        def kernel(b0: int, b1: int) -> int:
            return K.tuple_decode_bytes(buf, offsets, lut, lut_bits, info, obytes, window,
                                        expand, units, total_units, out, b0, b1)

        _run_blocks(kernel, offsets.size - 1)
        return out[:n]

    lut, lut_bits = huffman.decode_table(lens)
    digits = np.arange(alpha, dtype=np.int64)
    expand = np.empty((alpha, k), np.uint8)
    for j in range(k - 1, -1, -1):
        expand[:, j] = used[digits % m]
        digits //= m
    if _implied_mean_length(lens) <= K.MULTI_BITS / 2:  # >= 2 codes per lookup expected
        counts, used_bits, codes = K.multi_code_table(lut, lut_bits)

        def kernel(b0: int, b1: int) -> int:
            return K.tuple_decode_multi(buf, offsets, lut, lut_bits, counts, used_bits, codes,
                                        expand, units, total_units, out, b0, b1)
    else:

        def kernel(b0: int, b1: int) -> int:
            return K.tuple_decode(buf, offsets, lut, lut_bits, expand, units, total_units, out,
                                  b0, b1)

    _run_blocks(kernel, offsets.size - 1)
    return out[:n]


def _decode_zrun(buf: np.ndarray, pos: int, n: int, alphabet: int) -> np.ndarray:
    zsym, pos = _read_u8(buf, pos, "run symbol")
    rlens, pos = huffman.deserialize_lengths(buf, pos, K.RUN_ALPHABET)
    llens, pos = huffman.deserialize_lengths(buf, pos, 256)
    if llens[zsym]:
        raise FormatError("ZRUN literal table gives the run symbol a code")
    top = max(zsym, int(np.flatnonzero(llens)[-1]) if llens.any() else 0)
    if top >= alphabet:  # every decoded symbol is the run symbol or has a literal code
        raise _outside(top, alphabet)
    rlut, rbits = huffman.decode_table(rlens)
    llut, lbits = huffman.decode_table(llens)
    block, offsets = _read_blocks(buf, pos, n)
    out = _output(n)

    if _LITTLE_ENDIAN and ZRUN_TABLE:
        window = _window_bits(n, K.ZRUN_TABLE_BITS)
        info, obytes = K.zrun_byte_table(rlut, rbits, llut, lbits, zsym, window)

        def kernel(b0: int, b1: int) -> int:
            return K.zrun_decode_bytes(
                buf, zsym, offsets, rlut, rbits, K.RUN_BASE, K.RUN_EXTRA, llut, lbits, info,
                obytes, window, block, n, out, b0, b1,
            )  # fmt: skip
    else:
        decode = K.zrun_decode_fast if _LITTLE_ENDIAN else K.zrun_decode

        def kernel(b0: int, b1: int) -> int:
            return decode(
                buf, zsym, offsets, rlut, rbits, K.RUN_BASE, K.RUN_EXTRA, llut, lbits, block,
                n, out, b0, b1,
            )  # fmt: skip

    _run_blocks(kernel, offsets.size - 1)
    return out


def decode_symbols_many(
    streams: Sequence[bytes | memoryview], counts: Sequence[int], alphabets: Sequence[int],
    outputs: Sequence[np.ndarray | None],
) -> list[np.ndarray | None]:
    """Decode many small streams in one kernel call: entry ``i`` is exactly
    ``decode_symbols(streams[i], counts[i], alphabets[i])``, written into ``outputs[i]``
    where that is a C-contiguous uint8 array of ``counts[i]`` elements (and the stream's
    padding fits it), or ``None`` where this call did not decode it: another mode, several
    blocks, or a stream that would not decode. The caller then decodes that one with
    :func:`decode_symbols`, which also reports what is wrong with it.

    For the one-block TUPLE and ZRUN streams of small pieces (a restore of many leaves
    decodes thousands): their headers and tables are read in the kernel, not in Python,
    and TUPLE streams decode four together, one lane each (``_kernels.decode_streams``).
    """
    count = len(streams)
    results: list[np.ndarray | None] = [None] * count
    if not count or not _LITTLE_ENDIAN:
        return results
    data = np.frombuffer(b"".join(streams), np.uint8)
    ends = np.cumsum(np.fromiter(map(len, streams), np.int64, count))
    starts = ends - np.fromiter(map(len, streams), np.int64, count)
    arrays = []
    addresses = np.empty(count, np.int64)
    capacities = np.empty(count, np.int64)
    for i, (n, out) in enumerate(zip(counts, outputs, strict=True)):
        if (out is None or out.dtype != np.uint8 or out.size != n
                or not out.flags.c_contiguous):
            out = aligned_empty(n + 16)  # room for a last tuple's padding (k <= 12)
        arrays.append(out)
        addresses[i] = out.__array_interface__["data"][0]
        capacities[i] = out.size
    status = np.empty(count, np.int64)
    decoded = K.decode_streams(data, starts, ends, np.asarray(counts, np.int64),
                               np.asarray(alphabets, np.int64), addresses, capacities, status)
    if decoded < 0:
        raise AssertionError("decode_streams lost its tables")
    for i in np.flatnonzero(status == K.STATUS_OK).tolist():
        out = arrays[i]
        results[i] = out if out.size == counts[i] else out[: counts[i]]
    return results


def decode_symbols(data: bytes | memoryview, n: int, alphabet: int = 256) -> np.ndarray:
    """Decode a stream of :func:`encode_symbols` into a uint8 array of length ``n``.

    Raises FormatError / TruncatedError for streams that are malformed, do not hold ``n``
    symbols, have trailing bytes, or can decode a symbol ``>= alphabet`` (checked on the
    stream's symbol set or code tables before decoding: no pass over the output, except in
    the RAW mode). Memory use is bounded by ``n`` and ``len(data)``.
    """
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise CodecError(f"symbol count must be a non-negative int, got {n!r}")
    n = int(n)
    try:
        buf = np.frombuffer(data, dtype=np.uint8)
    except (TypeError, ValueError) as exc:
        raise CodecError(f"symbol stream must be a bytes-like object: {exc}") from exc
    mode, pos = _read_u8(buf, 0, "the mode byte")
    stored, pos = _read_uvarint(buf, pos, "the symbol count")
    if stored != n:
        raise FormatError(f"symbol stream holds {stored} symbols, caller expects {n}")
    if mode == MODE_RAW:
        if buf.size - pos != n:
            err = TruncatedError if buf.size - pos < n else FormatError
            raise err(f"RAW symbol stream has {buf.size - pos} bytes for {n} symbols")
        out = _output(n)
        out[:] = buf[pos:]
        top = int(out.max()) if alphabet < 256 and n else 0
        if top >= alphabet:
            raise _outside(top, alphabet)
        return out
    if n == 0:
        raise FormatError(f"mode {mode} is invalid for an empty symbol stream")
    if mode == MODE_CONST:
        sym, pos = _read_u8(buf, pos, "the constant symbol")
        if sym >= alphabet:
            raise _outside(sym, alphabet)
        if pos != buf.size:
            raise FormatError(f"{buf.size - pos} trailing bytes after a CONST symbol stream")
        out = _output(n)
        out.fill(sym)
        return out
    if mode == MODE_TUPLE:
        return _decode_tuple(buf, pos, n, alphabet)
    if mode == MODE_ZRUN:
        return _decode_zrun(buf, pos, n, alphabet)
    raise FormatError(f"unknown symbol stream mode {mode}")
