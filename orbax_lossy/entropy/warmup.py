"""Loading the host coders' numba kernels before their first use, in the background.

The first numba kernel a process calls initialises numba's CPU target (its registries
import ``numba.np.arraymath``, which imports ``scipy.linalg``: 0.38 s on the benchmark
machine) and loads the kernel's cached machine code. The first restore of a new process
waited 0.36 s for that inside its first piece, with every other piece queued behind it.

:func:`start` runs a tiny encode and decode through every stream mode and the lossless coder
once per process, on a daemon thread; the handler calls it when it is created, so the loading
overlaps what a job does between creating its checkpoint manager and its first restore or
commit (building its model and train state). A first use that comes sooner waits on numba's
own lock for the kernels the warm-up is loading, as it would have loaded them itself.
``ORBAX_LOSSY_WARMUP=0`` turns it off.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading

import numpy as np

ENV = "ORBAX_LOSSY_WARMUP"

_LOCK = threading.Lock()
_DONE: concurrent.futures.Future | None = None


def _samples() -> list[np.ndarray]:
    """Symbol arrays that take each stream mode: plain Huffman, k-tuples, zero runs."""
    rng = np.random.default_rng(0)
    spread = rng.integers(0, 200, 4096).astype(np.uint8)  # TUPLE, k = 1
    narrow = rng.choice(4, 4096, p=[0.55, 0.25, 0.15, 0.05]).astype(np.uint8)  # k > 1
    runs = np.where(rng.random(4096) < 0.97, 0, rng.integers(1, 8, 4096)).astype(np.uint8)
    return [spread, narrow, runs]


def warm() -> None:
    """Encode and decode the samples and a small float32 array (loads every host kernel a
    restore and a commit use first); raises if a round trip is not exact."""
    from orbax_lossy.codecs import lossless
    from orbax_lossy.entropy.stream import decode_symbols, decode_symbols_many, encode_symbols

    samples = _samples()
    streams = [encode_symbols(symbols) for symbols in samples]
    for symbols, data in zip(samples, streams, strict=True):
        if not np.array_equal(decode_symbols(data, symbols.size), symbols):
            raise AssertionError("warm-up: a symbol stream did not round-trip")
    # the kernel a restore of many small leaves decodes their links with
    together = decode_symbols_many(streams, [s.size for s in samples], [256] * len(samples),
                                   [None] * len(samples))
    for symbols, decoded in zip(samples, together, strict=True):
        if decoded is not None and not np.array_equal(decoded, symbols):
            raise AssertionError("warm-up: symbol streams decoded together did not round-trip")
    values = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)
    decoded = lossless.decode_array(lossless.encode_array(values), values.shape, values.dtype)
    if not np.array_equal(decoded.view(np.uint32), values.view(np.uint32)):
        raise AssertionError("warm-up: the lossless coder did not round-trip")


def _run(done: concurrent.futures.Future) -> None:
    try:
        warm()
    except BaseException as e:  # never fails the job: the first real use reports it
        logging.getLogger(__name__).debug("orbax_lossy warm-up failed: %r", e)
        done.set_exception(e)
    else:
        done.set_result(None)


def start() -> concurrent.futures.Future:
    """Start the warm-up once per process (unless ``ORBAX_LOSSY_WARMUP=0``); returns its
    future (already done when turned off or started before)."""
    global _DONE
    with _LOCK:
        if _DONE is None:
            _DONE = concurrent.futures.Future()
            if os.environ.get(ENV, "1") == "0":
                _DONE.set_result(None)
            else:
                threading.Thread(target=_run, args=(_DONE,), name="orbax_lossy_warmup",
                                 daemon=True).start()
        return _DONE
