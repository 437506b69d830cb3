"""Single-thread entropy decoding speed: the byte-table decoders against the reference ones.

Synthetic symbol sources shaped like the LC codec's streams (delta symbols: geometric-ish
over 7 values, coded as k-tuples; base symbols: ~240 values, k = 1; a mostly-zero ZRUN
stream, and a dense ZRUN stream of short runs as ``Step(mode="direct")`` writes), each
encoded by ``encode_symbols`` (which picks the mode and k) and decoded on one thread
(``PARALLEL_MIN_BLOCKS`` raised) with the new kernels (``tuple_decode_bytes``,
``zrun_decode_bytes``) and with the reference, code-by-code ones (``tuple_decode`` /
``tuple_decode_multi`` / ``zrun_decode``, selected by the big-endian fallback switch). The
outputs are compared, then the best of ``--repeat`` runs is reported, table building
included::

    python benchmarks/decode_speed.py [--symbols 4000000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from orbax_lossy.entropy import stream


def _geometric(rng: np.random.Generator, n: int, m: int, ratio: float) -> np.ndarray:
    weights = ratio ** np.arange(m)
    values = rng.permutation(256)[:m].astype(np.uint8)
    return values[rng.choice(m, n, p=weights / weights.sum())]


def sources(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    base = np.clip(rng.normal(128, 40, n), 8, 247).astype(np.uint8)  # ~240 values, k = 1
    zrun = np.where(rng.random(n) < 0.97, 0, rng.integers(1, 16, n)).astype(np.uint8)
    # Step(mode="direct") first moments: one dominant symbol, short runs between two others
    dense = np.where(rng.random(n) < 0.7, 128, rng.choice([0, 255], n)).astype(np.uint8)
    return {
        "delta 7 sym r=0.25": _geometric(rng, n, 7, 0.25),
        "delta 7 sym r=0.40": _geometric(rng, n, 7, 0.40),
        "delta 7 sym r=0.60": _geometric(rng, n, 7, 0.60),
        "delta 15 sym r=0.70": _geometric(rng, n, 15, 0.70),
        "base ~240 sym": base,
        "zrun p0=0.97": zrun,
        "zrun p0=0.70 3 sym": dense,
    }


def _describe(data: bytes) -> str:
    buf = np.frombuffer(data, np.uint8)
    if buf[0] == stream.MODE_ZRUN:
        return "ZRUN"
    if buf[0] != stream.MODE_TUPLE:
        return f"mode {buf[0]}"
    _, pos = stream._read_uvarint(buf, 1, "n")
    used, pos = stream._read_symset(buf, pos)
    return f"TUPLE m={used.size} k={buf[pos]}"


def _best(data: bytes, n: int, fast: bool, repeat: int) -> tuple[float, np.ndarray]:
    stream._LITTLE_ENDIAN = fast
    out = stream.decode_symbols(data, n)  # warm up (compilation, caches)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        stream.decode_symbols(data, n)
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--symbols", type=int, default=4_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    fast_ok = stream._LITTLE_ENDIAN
    stream.PARALLEL_MIN_BLOCKS = 1 << 62  # one thread
    print(f"{'source':22s} {'stream':18s} {'bits/sym':>8s} {'ref Msym/s':>11s} "
          f"{'new Msym/s':>11s} {'speedup':>8s}")  # fmt: skip
    try:
        for name, sym in sources(args.symbols).items():
            data = stream.encode_symbols(sym)
            t_ref, ref = _best(data, sym.size, False, args.repeat)
            t_new, new = _best(data, sym.size, fast_ok, args.repeat)
            assert np.array_equal(ref, sym) and np.array_equal(new, sym), name
            bits = 8 * len(data) / sym.size
            print(f"{name:22s} {_describe(data):18s} {bits:8.2f} {sym.size / t_ref / 1e6:11.0f} "
                  f"{sym.size / t_new / 1e6:11.0f} {t_ref / t_new:7.2f}x")  # fmt: skip
    finally:
        stream._LITTLE_ENDIAN = fast_ok


if __name__ == "__main__":
    main()
