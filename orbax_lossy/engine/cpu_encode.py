"""Host kernels for the encode of ``LC``, ``Step`` and linear-domain ``Cluster`` on float32
leaves of one CPU device.

On XLA:CPU the jitted encode program is the main cost of a lossy commit: LC's bucket
statistics are two scatters, and the program with its guard and error makes about ten passes
over the leaf (0.4-0.5 GB/s for LC(3) on the 2-core benchmark machine; docs/performance.md).
The numba kernels here do the same work in two passes over the value and its reference
(statistics, then symbols, reconstruction, guard and error together), on numpy views of the
CPU buffers, with the GIL released; saves run them on ``device.leaf_pool`` in place of the
XLA program where :func:`host_kernel` accepts the leaf. GPUs, TPUs, sharded leaves, several
processes, other dtypes and other codecs keep the XLA program.

What the kernels guarantee (``tests/test_cpu_encode.py`` checks each point against the XLA
programs):

* the reconstruction is what the codec's XLA ``decode`` computes from the returned fields and
  side arrays, bit for bit, so a restore (which decodes with XLA) returns the saved
  reference; it is computed with XLA:CPU's handling of subnormal float32 numbers (operands and
  results below the smallest normal number count as zero, DAZ/FTZ), which
  :func:`xla_flushes_subnormals` probes once per process;
* ``LC`` in the linear domain gives the XLA program's own symbols and representatives (each
  quantity is a maximum, a minimum, a comparison or one rounding); linear ``Cluster`` fits
  its centroids with the XLA program's own fit (a small program on a sample and the leaf's
  extremes) and assigns every element with the same comparisons, so its symbols, codebook
  and reconstruction are the XLA program's too; ``Step``'s step (a sum of
  squares) and ``LC``'s log-domain ratios (a logarithm) are computed in another order or by
  another library, so the step can differ in its last bits and an element on a boundary can
  take the neighbouring symbol: the codec's error bound holds all the same;
* the guard and the relative error are those of ``engine/device.py`` (``rel_error`` is
  accumulated in float64 here, in float32 there).

``ORBAX_LOSSY_HOST_ENCODE=0`` turns the kernels off (every leaf takes the XLA program).
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from orbax_lossy.codecs import cluster
from orbax_lossy.codecs.base import Codec
from orbax_lossy.codecs.cluster import Cluster
from orbax_lossy.codecs.lc import LC, kept_buckets
from orbax_lossy.codecs.step import CENTER, MAX_MULTIPLE, Step
from orbax_lossy.engine import device
from orbax_lossy.engine.kernel_cache import stable_cache
from orbax_lossy.entropy.stream import aligned_empty
from orbax_lossy.threads import available_cores, core_pool

#: environment variable: ``0`` runs every encode as an XLA program
ENV = "ORBAX_LOSSY_HOST_ENCODE"

# What a kernel codes, per element: the delta, the value, or the log-ratio to the reference.
LC_DELTA, LC_DIRECT, LC_LOG, STEP_DELTA, STEP_DIRECT, CLUSTER_DELTA, CLUSTER_DIRECT = range(7)
_F32 = np.finfo(np.float32)
TINY = np.float32(_F32.tiny)
FMAX = np.float32(_F32.max)
#: (sign, base-2 exponent) buckets of float32: ``2 * (maxexp - (minexp - nmant + 1) + 1)``
N_BUCKETS = 2 * (int(_F32.maxexp) - (int(_F32.minexp) - int(_F32.nmant) + 1) + 1)
#: a normal float32's bucket is ``2 * (biased exponent + BUCKET_OFFSET) + sign``
#: (``lc.segment_ids``: ``2 - maxexp - lo`` with ``lo = minexp - nmant + 1``)
BUCKET_OFFSET = 2 - int(_F32.maxexp) - (int(_F32.minexp) - int(_F32.nmant) + 1)


# ------------------------------------------------------------------------------ kernels

SIGN = np.uint32(0x80000000)
EXPONENT = np.uint32(0x7F800000)
#: the kernels index their per-bucket arrays by the top 9 bits (sign, biased exponent)
SLOTS = 512


@intrinsic
def _bits(typingctx, x):
    """The bit pattern of a float32 as a uint32."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _float(typingctx, u):
    """The float32 of a uint32 bit pattern."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _pick(typingctx, cond, a, b):
    """``a if cond else b`` as one ``select`` instruction. A conditional expression in an
    inlined helper compiled to a branch that made the log domain's write pass 4x slower."""
    both = typingctx.unify_types(a, b)
    if not isinstance(both, types.Number):
        return None

    def codegen(context, builder, sig, args):
        flag = context.cast(builder, args[0], sig.args[0], types.boolean)
        return builder.select(flag, context.cast(builder, args[1], sig.args[1], both),
                              context.cast(builder, args[2], sig.args[2], both))

    return both(cond, a, b), codegen


@njit(inline="always")
def _flush(x, flush):
    """``x``, or a zero of its sign where it is subnormal and ``flush`` (XLA:CPU's DAZ/FTZ)."""
    if flush:  # a loop invariant; the select compiles without a branch
        u: np.uint32 = _bits(x)
        return _float(np.uint32(_pick((u & EXPONENT) == 0, u & SIGN, u)))
    return x


@njit(inline="always")
def _nonfinite(x):
    return (_bits(x) & EXPONENT) == EXPONENT


@njit(inline="always")
def _subnormal(x):
    u: np.uint32 = _bits(x)
    return ((u & EXPONENT) == 0) & ((u & ~SIGN) != 0)


@njit(inline="always")
def _coded(v, r, kind):
    """The quantity a kernel quantizes for one element. It is not flushed: a subnormal one
    falls in LC's dropped bucket and rounds to Step's multiple 0 either way, and only the
    reconstruction (flushed where XLA flushes) must match XLA bit for bit."""
    if kind in (LC_DIRECT, STEP_DIRECT):
        return v
    if kind == LC_LOG:  # one logarithm (the XLA program takes log(v) - log(r))
        both = (v > 0) & (r > 0)
        return _pick(both, np.float32(np.log(_pick(both, v / r, np.float32(1.0)))),
                     np.float32(0.0))
    return v - r


@njit(inline="always")
def _account(out, v, value, nonnegative, bad, broken, err, norm):
    """The write passes' guard and error for one element: ``out`` not finite; a
    non-negative leaf decoded negative, or zero where positive (``v`` flushed); the squared
    error against the unflushed ``value`` and its square."""
    bad |= _nonfinite(out)
    if nonnegative:
        broken |= ~((out >= 0) & ((v <= 0) | (out > 0)))
    d = np.float64(out) - np.float64(value)
    return bad, broken, err + d * d, norm + np.float64(value) * np.float64(value)


#: elements per step of the write passes' loops: their squared errors and norms accumulate in
#: that many independent sums (one chain of float64 additions bounds a loop by its latency)
UNROLL = 4


@functools.cache
def lc_statistics_kernel(kind: int, daz: bool) -> Callable[..., tuple]:
    """Pass 1 of LC, compiled for one kind and one handling of subnormal operands (numba
    folds the constants; with them as runtime arguments the passes ran 1.3-3.5x slower):
    ``kernel(value, reference, top, bottom, count, coded)`` gathers per slot (sign and
    biased exponent of the coded value) its largest and smallest coded value and count, into
    ``top`` (start -inf), ``bottom`` (+inf), ``count`` (0), and returns ``(finite,
    nonnegative, subnormal, newborn)``: every value, reference and ``value - reference``
    finite; every value ``>= 0``; some value or reference subnormal; the largest positive
    value whose reference is ``<= 0``. In the log domain the coded ratios are kept in
    ``coded`` (the reconstruction's buffer, which the write pass reads them from and
    overwrites): a logarithm is the costliest step of the kernels."""
    has_ref = kind in (LC_DELTA, LC_LOG)
    log = kind == LC_LOG

    @njit(inline="always")
    def element(value, reference, i, lane, top, bottom, count, coded, flags, newborn):
        bad, negative, subnormal = flags
        v = _flush(value[i], daz)
        r = _flush(reference[i], daz) if has_ref else np.float32(0.0)
        if log:
            bad |= _nonfinite(v) | _nonfinite(r) | _nonfinite(v - r)
        # (else the coded value, v - r or v, is not finite where v or r is not: its slot
        # tells, after the loop)
        negative |= v < 0
        subnormal |= _subnormal(value[i]) | (_subnormal(reference[i]) if has_ref else False)
        if log:
            newborn = max(newborn, _pick((r <= 0) & (v > 0), v, np.float32(0.0)))
        x = _coded(v, r, kind)
        if log:
            coded[i] = x
        slot = _bits(x) >> 23
        top[lane, slot] = max(top[lane, slot], x)
        bottom[lane, slot] = min(bottom[lane, slot], x)
        count[lane, slot] += 1
        return (bad, negative, subnormal), newborn

    @njit(nogil=True, error_model="numpy")  # cached by stable_cache
    def lc_statistics(value, reference, top, bottom, count, coded):
        # UNROLL elements at a time, each into its own row of slots: neighbours mostly fall
        # in the same slot, and one row would chain every update on the previous one's
        # store (the pass ran 1.5-2x slower so)
        tops = np.full((UNROLL, top.size), -np.inf, np.float32)
        bottoms = np.full((UNROLL, top.size), np.inf, np.float32)
        counts = np.zeros((UNROLL, top.size), np.int64)
        flags = (False, False, False)
        newborn = np.float32(0.0)
        n = value.size
        lanes = n - n % UNROLL
        for i in range(0, lanes, UNROLL):  # (a range(lo, hi) loop ran 1.7x slower)
            flags, newborn = element(value, reference, i, 0, tops, bottoms, counts, coded,
                                     flags, newborn)
            flags, newborn = element(value, reference, i + 1, 1, tops, bottoms, counts,
                                     coded, flags, newborn)
            flags, newborn = element(value, reference, i + 2, 2, tops, bottoms, counts,
                                     coded, flags, newborn)
            flags, newborn = element(value, reference, i + 3, 3, tops, bottoms, counts,
                                     coded, flags, newborn)
        for i in range(lanes, n):
            flags, newborn = element(value, reference, i, 0, tops, bottoms, counts, coded,
                                     flags, newborn)
        for lane in range(UNROLL):
            for slot in range(top.size):
                top[slot] = max(top[slot], tops[lane, slot])
                bottom[slot] = min(bottom[slot], bottoms[lane, slot])
                count[slot] += counts[lane, slot]
        bad, negative, subnormal = flags
        if not log:  # slots 255 and 511: infinities and NaNs of either sign
            bad |= (count[255] > 0) | (count[511] > 0)
        return not bad, not negative, subnormal, newborn

    return stable_cache(lc_statistics)


@functools.cache
def lc_write_kernel(kind: int, daz: bool, flush: bool, nonnegative: bool,
                    lift: bool) -> Callable[..., tuple]:
    """Pass 2 of LC, compiled per kind and flags: ``kernel((value, reference, table, reps,
    lift_symbol, born_symbol, born_value, symbols, recon))`` writes every element's symbol
    and reconstruction (into ``symbols``, ``recon``) and returns ``(recon finite, sign kept,
    ||recon - value||^2, ||value||^2)`` (sign kept: a non-negative leaf decodes
    non-negative, and positive where positive; True for other leaves).

    ``table``: slot -> symbol (0 for zeros, subnormals, inf, nan); ``reps``: symbol ->
    decoded delta or value, or (log domain) symbol -> factor; ``lift_symbol`` (where
    ``lift``): the symbol of the smallest kept positive bucket, for newborn elements of a
    non-negative leaf. Conditions are bitwise operations and selects: data-dependent
    branches mispredict.
    """
    has_ref = kind != LC_DIRECT

    @njit(inline="always")
    def element(args, i, bad, broken, err, norm):
        value, reference, table, reps, lift_symbol, born_symbol, born_value, symbols, recon = args
        v = _flush(value[i], daz)
        r = _flush(reference[i], daz) if has_ref else np.float32(0.0)
        s = table[_bits(recon[i] if kind == LC_LOG else _coded(v, r, kind)) >> 23]
        if kind == LC_DIRECT:
            out = reps[s]
        elif kind == LC_LOG:
            born = (r <= 0) & (v > 0)
            s = _pick(born, np.uint8(born_symbol), s)
            out = _pick(born, born_value, min(_flush(r * reps[s], flush), FMAX))  # nan stays
        else:
            if lift:
                s = _pick((s == 0) & (r <= 0) & (v > 0), np.uint8(lift_symbol), s)
            out = _flush(r + reps[s], flush)
            if nonnegative:  # an overshooting decrease keeps the (positive) reference
                overshoot = (r > 0) & ((out < 0) | ((out <= 0) & (v > 0)))
                s = _pick(overshoot, np.uint8(0), s)
                out = _pick(overshoot, reference[i], out)
        symbols[i] = s
        recon[i] = out
        return _account(out, v, value[i], nonnegative, bad, broken, err, norm)

    @njit(nogil=True, error_model="numpy")  # cached by stable_cache
    def lc_write(args):
        return _unrolled(element, args, args[0].size)

    return stable_cache(lc_write)


@njit(inline="always")
def _unrolled(element, args, n):
    """``element(args, i, ...)`` for every ``i < n``, UNROLL at a time, each of them into its
    own error and norm sums; ``(no element non-finite, none broken, error, norm)``."""
    bad = broken = False
    e0 = e1 = e2 = e3 = n0 = n1 = n2 = n3 = 0.0
    lanes = n - n % UNROLL
    for i in range(0, lanes, UNROLL):
        bad, broken, e0, n0 = element(args, i, bad, broken, e0, n0)
        bad, broken, e1, n1 = element(args, i + 1, bad, broken, e1, n1)
        bad, broken, e2, n2 = element(args, i + 2, bad, broken, e2, n2)
        bad, broken, e3, n3 = element(args, i + 3, bad, broken, e3, n3)
    for i in range(lanes, n):
        bad, broken, e0, n0 = element(args, i, bad, broken, e0, n0)
    return not bad, not broken, (e0 + e1) + (e2 + e3), (n0 + n1) + (n2 + n3)


@functools.cache
def step_statistics_kernel(kind: int, daz: bool) -> Callable[..., tuple]:
    """Pass 1 of Step, compiled per kind: ``kernel(value, reference)`` returns ``(finite,
    nonnegative, subnormal, amax, sum of squares)`` of the coded values (flags as
    :func:`lc_statistics_kernel`)."""
    has_ref = kind == STEP_DELTA

    @njit(nogil=True, cache=True, error_model="numpy")
    def step_statistics(value, reference):
        bad = False
        negative = False
        subnormal = False
        amax = np.float32(0.0)
        sumsq = 0.0
        for i in range(value.size):  # (a range(lo, hi) loop ran 1.7x slower)
            v = _flush(value[i], daz)
            r = _flush(reference[i], daz) if has_ref else np.float32(0.0)
            bad |= _nonfinite(v) | _nonfinite(r) | _nonfinite(v - r)
            negative |= v < 0
            subnormal |= _subnormal(value[i]) | _subnormal(r)
            x = _coded(v, r, kind)
            amax = max(amax, abs(x))
            sumsq += np.float64(x) * np.float64(x)
        return not bad, not negative, subnormal, amax, sumsq

    return step_statistics


@functools.cache
def step_write_kernel(kind: int, daz: bool, flush: bool,
                      nonnegative: bool) -> Callable[..., tuple]:
    """Pass 2 of Step, compiled per kind and flags: ``kernel((value, reference, step, levels,
    symbols, recon))`` writes symbols (nearest multiple of ``step`` plus 128) and the
    reconstruction; returns as :func:`lc_write_kernel`."""
    has_ref = kind == STEP_DELTA
    low = np.float32(-MAX_MULTIPLE)
    high = np.float32(MAX_MULTIPLE)

    @njit(inline="always")
    def element(args, i, bad, broken, err, norm):
        value, reference, step, levels, symbols, recon = args
        v = _flush(value[i], daz)
        r = _flush(reference[i], daz) if has_ref else np.float32(0.0)
        q = min(max(np.rint(_coded(v, r, kind) / step), low), high)
        s = np.uint8(np.int32(q) + CENTER)
        out = levels[s]
        if has_ref:
            out = _flush(r + out, flush)
        symbols[i] = s
        recon[i] = out
        return _account(out, v, value[i], nonnegative, bad, broken, err, norm)

    @njit(nogil=True, error_model="numpy")  # cached by stable_cache
    def step_write(args):
        return _unrolled(element, args, args[0].size)

    return stable_cache(step_write)


#: decision bounds the Cluster kernel searches (``2**8 - 1``: 8 bits at most, padded)
BOUND_SLOTS = 255


@functools.cache
def cluster_write_kernel(kind: int, flush: bool, nonnegative: bool) -> Callable[..., tuple]:
    """The one pass of linear-domain Cluster, compiled per kind and flags: ``kernel((value,
    reference, bounds, codebook, addend, symbols, recon))`` writes every element's symbol (0
    for an exact zero, else 1 + the number of decision ``bounds`` below it: the XLA program's
    ``searchsorted``, here a branchless binary search over ``bounds`` padded with ``+inf`` to
    ``2**bits - 1`` entries) and its reconstruction (``codebook[symbol]``, or the reference
    plus ``addend[symbol]``, the codebook as XLA's adds read it); returns as
    :func:`lc_write_kernel`, the operands' finiteness included."""
    has_ref = kind == CLUSTER_DELTA

    @njit(inline="always")
    def element(args, i, bad, broken, err, norm):
        value, reference, bounds, codebook, addend, symbols, recon = args
        v = _flush(value[i], flush)
        r = _flush(reference[i], flush) if has_ref else np.float32(0.0)
        x = _flush(v - r, flush) if has_ref else v
        bad |= _nonfinite(v) | _nonfinite(r) | _nonfinite(v - r)
        # 8 steps over BOUND_SLOTS entries, written out (unsigned indices: no wraparound
        # test); each comparison selects, it does not branch
        pos: Any = np.uint64(0)  # (Any: numpy 2.5's stubs type uint64 + _pick as float64)
        pos += _pick(bounds[pos + np.uint64(127)] < x, np.uint64(128), np.uint64(0))
        pos += _pick(bounds[pos + np.uint64(63)] < x, np.uint64(64), np.uint64(0))
        pos += _pick(bounds[pos + np.uint64(31)] < x, np.uint64(32), np.uint64(0))
        pos += _pick(bounds[pos + np.uint64(15)] < x, np.uint64(16), np.uint64(0))
        pos += _pick(bounds[pos + np.uint64(7)] < x, np.uint64(8), np.uint64(0))
        pos += _pick(bounds[pos + np.uint64(3)] < x, np.uint64(4), np.uint64(0))
        pos += _pick(bounds[pos + np.uint64(1)] < x, np.uint64(2), np.uint64(0))
        pos += _pick(bounds[pos] < x, np.uint64(1), np.uint64(0))
        s = np.uint8(_pick(x != 0, pos + np.uint64(1), np.uint64(0)))
        out = _flush(r + addend[s], flush) if has_ref else codebook[s]
        symbols[i] = s
        recon[i] = out
        return _account(out, v, value[i], nonnegative, bad, broken, err, norm)

    @njit(nogil=True, error_model="numpy")  # cached by stable_cache
    def cluster_write(args):
        return _unrolled(element, args, args[0].size)

    return stable_cache(cluster_write)


# ------------------------------------------------------------------------------ tables


def _flush_array(x: np.ndarray, flush: bool) -> np.ndarray:
    if not flush:
        return x
    return np.where(np.abs(x) < TINY, np.copysign(np.float32(0), x), x).astype(x.dtype)


def _slot_buckets() -> tuple[np.ndarray, np.ndarray]:
    """The kernels' slots of normal numbers and their ``lc.segment_ids`` buckets."""
    sign, field = np.divmod(np.arange(SLOTS), 256)
    normal = (field > 0) & (field < 255)
    return np.nonzero(normal)[0], (2 * (field + BUCKET_OFFSET) + sign)[normal]


NORMAL_SLOTS, SLOT_BUCKETS = _slot_buckets()


def lc_tables(top: np.ndarray, bottom: np.ndarray, count: np.ndarray, bits: int,
              reserve: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """``lc.promote``'s tables from the per-slot statistics: ``(slot -> symbol, symbol ->
    representative, lift symbol)``, in the same float32 arithmetic (tests compare them with
    the XLA program)."""
    b_top = np.full(N_BUCKETS, -np.inf, np.float32)
    b_bottom = np.full(N_BUCKETS, np.inf, np.float32)
    b_count = np.zeros(N_BUCKETS, np.int64)
    b_top[SLOT_BUCKETS] = top[NORMAL_SLOTS]
    b_bottom[SLOT_BUCKETS] = bottom[NORMAL_SLOTS]
    b_count[SLOT_BUCKETS] = count[NORMAL_SLOTS]
    negative = np.arange(N_BUCKETS) % 2 == 1
    keep = kept_buckets(b_count, bits, reserve)
    rank = np.cumsum(keep[::-1].astype(np.int64))[::-1]
    symbol_of_bucket = np.where(keep, rank, 0).astype(np.uint8)
    max_mag = np.where(negative, -b_bottom, b_top).astype(np.float32)
    min_mag = np.where(negative, -b_top, b_bottom).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        midrange = (max_mag + min_mag) * np.float32(0.5)
    reps = np.zeros(2**bits, np.float32)
    for b in np.nonzero(keep)[0]:
        reps[symbol_of_bucket[b]] = -midrange[b] if negative[b] else midrange[b]
    table = np.zeros(SLOTS, np.uint8)
    table[NORMAL_SLOTS] = symbol_of_bucket[SLOT_BUCKETS]
    positive_kept = keep & ~negative
    lift = int(symbol_of_bucket[int(np.argmax(positive_kept))]) if positive_kept.any() else 0
    return table, reps, lift


def step_of(amax: np.float32, sumsq: float, n: int, rel: float, flush: bool) -> np.float32:
    """``step.step_size`` from the kernel's statistics (float32 steps, as the XLA program;
    the mean square in float64)."""
    amax = np.float32(amax)
    if not amax > 0:
        return np.float32(1.0)
    rms = np.float32(math.sqrt(sumsq / n)) if n else amax
    with np.errstate(over="ignore", under="ignore"):
        step = min(np.float32(np.float32(rel) * rms), amax)
        floor = _flush_array(np.asarray([amax / np.float32(MAX_MULTIPLE)], np.float32), flush)
    return np.float32(max(step, floor[0]))


def step_levels(step: np.float32, flush: bool) -> np.ndarray:
    """``step.levels``: the 256 decoded values ``(symbol - 128) * step`` in float32, with
    XLA's flushing of a subnormal step and of subnormal products."""
    operand = _flush_array(np.asarray([step], np.float32), flush)[0]
    with np.errstate(over="ignore", under="ignore"):
        values = (np.arange(2 * CENTER, dtype=np.int32) - CENTER).astype(np.float32) * operand
    return _flush_array(values.astype(np.float32), flush)


# ------------------------------------------------------------------------------ dispatch


def _probe_flush() -> bool:
    cpu = jax.local_devices(backend="cpu")[0]
    a = jax.device_put(np.asarray([1e-39, 1e-38, 2.0], np.float32), cpu)
    b = jax.device_put(np.asarray([0.0, -9.99e-39, 1.0], np.float32), cpu)
    out, positive = jax.jit(lambda x, y: (x + y, x > 0))(a, b)
    out, positive = np.asarray(out), np.asarray(positive)
    return bool(out[0] == 0 and out[1] == 0 and not positive[0])


_FLUSH: bool | None = None
_FLUSH_LOCK = threading.Lock()


def xla_flushes_subnormals() -> bool:
    """Whether XLA:CPU treats subnormal float32 operands and results as zero (probed once per
    process with one tiny program, in the commit thread of the first save that uses a host
    kernel)."""
    global _FLUSH
    with _FLUSH_LOCK:
        if _FLUSH is None:
            _FLUSH = _probe_flush()
        return _FLUSH


def _kind(codec: Codec) -> int | None:
    if isinstance(codec, Cluster):
        if codec.domain != "linear":
            return None
        return CLUSTER_DELTA if codec.mode == "delta" else CLUSTER_DIRECT
    if isinstance(codec, Step):
        return STEP_DELTA if codec.mode == "delta" else STEP_DIRECT
    if isinstance(codec, LC):
        if codec.domain == "log":
            return LC_LOG
        return LC_DELTA if codec.mode == "delta" else LC_DIRECT
    return None


def _on_one_cpu(x: Any) -> bool:
    if not isinstance(x, jax.Array):
        return False
    devices = x.sharding.device_set
    return len(devices) == 1 and getattr(next(iter(devices)), "platform", None) == "cpu"


def host_kernel(value: Any, reference: Any, codec: Codec) -> int | None:
    """The kernel kind that encodes this leaf on the host, or None (the XLA program does):
    a float32 ``jax.Array`` on one CPU device of a single-process run, coded with ``LC`` or
    ``Step``, its reference (for delta codecs) of the same shape and dtype."""
    if os.environ.get(ENV, "1") == "0" or jax.process_count() > 1:
        return None
    kind = _kind(codec)
    if kind is None or not _on_one_cpu(value) or value.dtype != jnp.float32 or value.size == 0:
        return None
    if codec.needs_reference and (reference is None or tuple(np.shape(reference)) != value.shape
                                  or np.dtype(reference.dtype) != np.float32):
        return None
    return kind


#: a leaf of at least this many elements runs each pass on every core, in ranges
SPLIT_ELEMENTS = 1 << 21


def _ranges(n: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into one range per core, at most one per ``SPLIT_ELEMENTS``; a leaf
    below ``2 * SPLIT_ELEMENTS`` is one range without asking for the cores (a
    ``sched_getaffinity`` call, asked several times a leaf: ~10 ms of GIL a 360-leaf save)."""
    if n < 2 * SPLIT_ELEMENTS:
        return [(0, n)]
    parts = min(available_cores(), n // SPLIT_ELEMENTS)
    cuts = [n * k // parts for k in range(parts + 1)]
    return list(itertools.pairwise(cuts))


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """Workers for the ranges of large leaves. The kernels hold no lock and wait for
    nothing, so the save's leaf workers can share them without deadlock."""
    return core_pool("kernel")


def _run(kernel: Any, n: int, args_of: Callable[[slice, int], tuple]) -> list[Any]:
    """``kernel(*args_of(part, k))`` for the ranges ``part`` (numbered ``k``) covering
    ``[0, n)``: on every core for a large leaf, else on this thread. The kernels take
    slices of the per-element arrays and loop over their whole size."""
    parts = [slice(lo, hi) for lo, hi in _ranges(n)]
    if len(parts) == 1:
        return [kernel(*args_of(parts[0], 0))]
    futures = [_pool().submit(kernel, *args_of(part, k)) for k, part in enumerate(parts)]
    return [f.result() for f in futures]


def _flat(x: Any) -> np.ndarray:
    """A flat float32 numpy view of a CPU array's buffer (no copy)."""
    return np.asarray(x).reshape(-1)


def _lc_statistics(v: np.ndarray, r: np.ndarray, kind: int, daz: bool,
                   coded: np.ndarray) -> tuple:
    """:func:`lc_statistics_kernel` over the ranges, each into its own arrays (merged where a
    large leaf has several ranges; a small leaf's one range is returned as it is)."""
    parts = [(np.full(SLOTS, -np.inf, np.float32), np.full(SLOTS, np.inf, np.float32),
              np.zeros(SLOTS, np.int64)) for _ in _ranges(v.size)]
    flags = _run(lc_statistics_kernel(kind, daz), v.size,
                 lambda part, k: (v[part], r[part], *parts[k], coded[part]))
    if len(parts) == 1:  # a small leaf: one range, nothing to merge (Python per leaf)
        f = flags[0]
        return (bool(f[0]), bool(f[1]), bool(f[2]), np.float32(f[3]), *parts[0])
    top = np.max([p[0] for p in parts], axis=0)
    bottom = np.min([p[1] for p in parts], axis=0)
    count = np.sum([p[2] for p in parts], axis=0)
    return (all(f[0] for f in flags), all(f[1] for f in flags), any(f[2] for f in flags),
            np.float32(max(f[3] for f in flags)), top, bottom, count)


def _combine_writes(results: list[tuple]) -> tuple[bool, bool, float, float]:
    return (all(x[0] for x in results), all(x[1] for x in results),
            sum(x[2] for x in results), sum(x[3] for x in results))


def _lc_measure(v: np.ndarray, r: np.ndarray, kind: int, flush: bool,
                coded: np.ndarray) -> tuple:
    """LC's pass 1 as XLA sees the operands: ``(daz, finite, nonnegative, newborn, top,
    bottom, count)`` (measured again with operands flushed where some are subnormal)."""
    finite, nonnegative, subnormal, newborn, top, bottom, count = _lc_statistics(
        v, r, kind, False, coded)
    daz = flush and subnormal
    if daz:  # XLA reads subnormal operands as zeros: measure what it would
        finite, nonnegative, _, newborn, top, bottom, count = _lc_statistics(
            v, r, kind, True, coded)
    return daz, finite, nonnegative, newborn, top, bottom, count


def _lc_write(v: np.ndarray, r: np.ndarray, kind: int, bits: int, flush: bool,
              measured: tuple, symbols: np.ndarray, recon: np.ndarray) -> tuple:
    """LC's tables for ``bits`` and pass 2: ``(side, finite, kept, err, norm)``."""
    daz, _, nonnegative, newborn, top, bottom, count = measured
    reserve = 1 if kind == LC_LOG else 0
    table, reps, lift = lc_tables(top, bottom, count, bits, reserve)
    if kind == LC_LOG:
        with np.errstate(over="ignore", under="ignore"):
            factor = np.exp(reps).astype(np.float32)
        factor[0] = factor[-1] = 1
        reps = _flush_array(factor, flush)
        side = {"factor": reps, "born": np.asarray([newborn], np.float32)}
    else:
        side = {"rep": reps}
    born = (2**bits - 1, np.float32(newborn))
    write = lc_write_kernel(kind, daz, flush, bool(nonnegative), bool(nonnegative) and lift > 0)
    return (side, *_combine_writes(_run(write, v.size, lambda part, k: (
        (v[part], r[part], table, reps, lift, *born, symbols[part], recon[part]),))))


def _result(value: jax.Array, v: np.ndarray, symbols: np.ndarray, recon: np.ndarray,
            side: dict[str, np.ndarray], safe: bool, err: float, norm: float) -> dict[str, Any]:
    """``device.encode_tree``'s result for one leaf, with ``recon`` as the numpy array the
    kernel wrote: :func:`~orbax_lossy.engine.save.reconstruction` puts the reconstructions of
    a save's leaves on their devices in one batched call (a ``jax.device_put`` per leaf was
    29% of the encode workers' GIL time in a 360-leaf save), and an adaptive trial reads it
    as it is."""
    if not safe:  # stored exactly for this save (never garbage), as the XLA guard decides
        recon[:] = v
        rel_error = 0.0
        side = {}
    else:
        rel_error = math.sqrt(err) / max(math.sqrt(norm), 1e-30) if norm > 0 else math.sqrt(err)
    return {
        "fields": {"sym": symbols.reshape(value.shape)},
        "side": side,
        "recon": recon.reshape(value.shape),
        "safe": np.bool_(safe),
        "rel_error": np.float32(rel_error),
        "same": np.bool_(False),
    }


@functools.partial(jax.jit, static_argnames=("sample", "delta"))
def _cluster_sample(value: jax.Array, reference: jax.Array, *, sample: int,
                    delta: bool) -> tuple[jax.Array, jax.Array]:
    """The XLA program's own sample of linear-domain Cluster (``Cluster.encode`` up to its
    sort, ``cluster.fit_sample``): it reads the leaf for its extremes and a strided sample."""
    x = value - reference if delta else value
    t, usable = cluster.coded_domain(x, "linear")
    return cluster.fit_sample(t, usable, sample, cluster.everywhere_usable(x, "linear"))


@functools.partial(jax.jit, static_argnames=("bits", "iters"))
def _cluster_tables(ascending: jax.Array, n_valid: jax.Array, *, bits: int,
                    iters: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The XLA program's fit from the sorted sample: ``(decision bounds, codebook, finite)``
    (float32 leaves), so the kernel's symbols and reconstruction are the XLA program's."""
    centroids = cluster.centroids_of_sorted(ascending, n_valid, 2**bits - 1, iters)
    bounds = cluster.midpoints(centroids)
    codebook = cluster.codebook_values(centroids, "linear", ascending.dtype, ascending.dtype)
    return bounds, codebook, jnp.all(jnp.isfinite(bounds))


def _cluster_encode(value: jax.Array, reference: Any, codec: Cluster, kind: int,
                    v: np.ndarray, r: np.ndarray, flush: bool, symbols: np.ndarray,
                    recon: np.ndarray) -> tuple | None:
    """Cluster's fit (XLA) and its one kernel pass: ``(side, finite, kept, err, norm,
    nonnegative)``, or None where a decision bound is not finite (the XLA program's search
    then decides; the leaf takes it)."""
    delta = kind == CLUSTER_DELTA
    values, n_valid = jax.device_get(_cluster_sample(
        value, reference if delta else value, sample=codec.sample, delta=delta))
    if np.isnan(values).any():  # (bounds that are not finite, most likely)
        return None
    # numpy sorts the sample: 0.9 ms for a 46 k-element leaf, against 3 ms for the XLA
    # programs' integer-key sort (cluster.ascending) and 8.6 ms for XLA:CPU's float sort.
    # Without NaN (and without zeros: they are not usable, +inf here) equal values are equal
    # bits, so every sort gives the same array.
    bounds, codebook, finite = jax.device_get(_cluster_tables(
        np.sort(values), n_valid, bits=codec.bits, iters=codec.iters))
    if not finite:
        return None
    padded = np.full(BOUND_SLOTS, np.inf, np.float32)
    padded[: bounds.size] = _flush_array(np.asarray(bounds, np.float32), flush)
    codebook = np.asarray(codebook, np.float32)
    addend = _flush_array(codebook, flush)
    nonnegative = bool(np.all(v >= 0))
    write = cluster_write_kernel(kind, flush, nonnegative)
    finite, kept, err, norm = _combine_writes(_run(write, v.size, lambda part, k: (
        (v[part], r[part], padded, codebook, addend, symbols[part], recon[part]),)))
    return {"codebook": codebook}, finite, kept, err, norm, nonnegative


def encode(value: jax.Array, reference: Any, codec: Codec, kind: int) -> dict[str, Any]:
    """Encode one leaf with a host kernel: the result of ``device.encode_tree`` for it
    (``fields``, ``side``, ``recon``, ``safe``, ``rel_error``, ``same``), with numpy fields and
    (except where a Cluster fit falls back to the XLA program) a numpy ``recon``."""
    flush = xla_flushes_subnormals()
    v = _flat(value)
    r = _flat(reference) if codec.needs_reference else v
    n = v.size
    symbols = aligned_empty(n, np.uint8)
    recon = aligned_empty(n, np.float32)
    side: dict[str, np.ndarray] = {}
    err = norm = 0.0
    if kind in (STEP_DELTA, STEP_DIRECT):
        assert isinstance(codec, Step)

        def statistics(daz: bool) -> tuple:
            parts = _run(step_statistics_kernel(kind, daz), n, lambda part, k: (v[part], r[part]))
            return (all(p[0] for p in parts), all(p[1] for p in parts),
                    any(p[2] for p in parts), np.float32(max(p[3] for p in parts)),
                    sum(p[4] for p in parts))

        finite, nonnegative, subnormal, amax, sumsq = statistics(False)
        daz = flush and subnormal
        if daz:  # XLA reads subnormal operands as zeros: measure what it would
            finite, nonnegative, _, amax, sumsq = statistics(True)
        safe = bool(finite)
        if safe:
            step = step_of(amax, sumsq, n, float(codec.rel), flush)
            levels = step_levels(step, flush)
            write = step_write_kernel(kind, daz, flush, bool(nonnegative))
            finite, kept, err, norm = _combine_writes(_run(write, n, lambda part, k: (
                (v[part], r[part], step, levels, symbols[part], recon[part]),)))
            side = {"step": np.asarray([step], np.float32)}
            safe = bool(finite) and (not nonnegative or bool(kept))
    elif kind in (CLUSTER_DELTA, CLUSTER_DIRECT):
        assert isinstance(codec, Cluster)
        done = _cluster_encode(value, reference, codec, kind, v, r, flush, symbols, recon)
        if done is None:  # bounds not finite: the XLA program, whose search decides
            out = device.encode_tree([value], [reference], plan=(codec,),
                                     shardings=(value.sharding,))[0]
            out = {**out, "fields": {k: np.asarray(f) for k, f in out["fields"].items()}}
            if not bool(out["safe"]):  # stored exactly, as _result reports it
                out.update(side={}, rel_error=np.float32(0.0))
            return out
        side, finite, kept, err, norm, nonnegative = done
        safe = bool(finite) and (not nonnegative or bool(kept))
    else:
        assert isinstance(codec, LC)
        measured = _lc_measure(v, r, kind, flush, recon)
        safe = bool(measured[1])
        if safe:
            side, finite, kept, err, norm = _lc_write(v, r, kind, codec.bits, flush, measured,
                                                      symbols, recon)
            safe = bool(finite) and (not measured[2] or bool(kept))
    return _result(value, v, symbols, recon, side, safe, err, norm)


def encode_lc_widths(value: jax.Array, reference: jax.Array, codecs: Sequence[LC],
                     kind: int) -> Iterator[dict[str, Any]]:
    """:func:`encode` of one leaf with each of ``codecs`` (LC codecs of one kind that differ
    only in ``bits``), one after another, sharing one statistics pass (the per-bucket
    statistics do not depend on the alphabet): an adaptive policy's trials. Each result's
    buffers are new."""
    flush = xla_flushes_subnormals()
    v = _flat(value)
    r = _flat(reference) if kind != LC_DIRECT else v
    n = v.size
    coded = aligned_empty(n, np.float32)  # the log domain's ratios, kept for every width
    measured = _lc_measure(v, r, kind, flush, coded)
    for codec in codecs:
        assert isinstance(codec, LC) and _kind(codec) == kind
        symbols = aligned_empty(n, np.uint8)
        recon = aligned_empty(n, np.float32)
        side: dict[str, np.ndarray] = {}
        err = norm = 0.0
        safe = bool(measured[1])
        if safe:
            if kind == LC_LOG:
                recon[:] = coded
            side, finite, kept, err, norm = _lc_write(v, r, kind, codec.bits, flush, measured,
                                                      symbols, recon)
            safe = bool(finite) and (not measured[2] or bool(kept))
        yield _result(value, v, symbols, recon, side, safe, err, norm)
