"""Many small symbol streams decoded in one kernel call (``stream.decode_symbols_many``,
``_kernels.decode_streams``), as a restore of many small leaves decodes a leaf's
links: the same arrays as ``decode_symbols`` one by one, never a stream that
``decode_symbols`` rejects, and the restore's values bit for bit."""

from __future__ import annotations

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from subprocess_env import cpu_env

import orbax_lossy as ol
from orbax_lossy.engine import reading
from orbax_lossy.engine import restore as restoring
from orbax_lossy.entropy import stream
from orbax_lossy.errors import LossyError
from orbax_lossy.format import payload
from orbax_lossy.treepaths import path_str


def _symbols(rng: np.random.Generator, n: int | None = None) -> np.ndarray:
    n = int(rng.choice([1, 2, 5, 17, 64, 240, 241, 1000, 4099, 47104])) if n is None else n
    m = int(rng.choice([2, 3, 4, 5, 8, 9, 33, 200]))
    p = rng.dirichlet(np.ones(m) * rng.choice([0.1, 1.0, 10.0]))
    return rng.choice(m, n, p=p).astype(np.uint8)


def _one(data: bytes, n: int, alphabet: int = 256) -> np.ndarray | None:
    try:
        return stream.decode_symbols(data, n, alphabet)
    except LossyError:
        return None


def _tuple_length(data: bytes) -> int:
    """``k`` of a TUPLE stream's header (mode, count, alphabet size, symbol set, k)."""
    pos = 1
    while data[pos] & 0x80:
        pos += 1
    m = data[pos + 1] + 1
    return data[pos + 2 + (m if m <= 32 else 32)]


def test_small_streams_decode_as_one_by_one() -> None:
    """Every one-block TUPLE and ZRUN stream decodes (into new arrays, or in place into
    outputs of its length) to exactly its symbols, except a TUPLE stream into an output too
    short for its last tuple's padding; RAW and CONST streams are left to
    ``decode_symbols``."""
    rng = np.random.default_rng(0)
    taken = zrun = 0
    for trial in range(60):
        syms = [_symbols(rng) for _ in range(int(rng.integers(1, 12)))]
        data = [stream.encode_symbols(s) for s in syms]
        outputs = [np.empty(s.size, np.uint8) if (trial + j) % 2 else None
                   for j, s in enumerate(syms)]
        got = stream.decode_symbols_many(data, [s.size for s in syms], [256] * len(syms),
                                         outputs)
        for s, d, out, g in zip(syms, data, outputs, got, strict=True):
            if d[0] not in (stream.MODE_TUPLE, stream.MODE_ZRUN):
                assert g is None
                continue
            if g is None:
                assert d[0] == stream.MODE_TUPLE and out is not None, "declined a stream"
                assert s.size % _tuple_length(d), "declined a stream"
                continue
            taken += 1
            zrun += d[0] == stream.MODE_ZRUN
            np.testing.assert_array_equal(g, s)
            if out is not None:
                assert g.ctypes.data == out.ctypes.data  # decoded in place
    assert taken > 150 and zrun > 10


def test_declined_streams_are_the_ones_it_cannot_take() -> None:
    """Several blocks (TUPLE or ZRUN), the CONST mode, an output too small for the last
    tuple's padding, a symbol above the alphabet: declined (``None``), and the output is
    never written beyond its end; a one-block ZRUN stream decodes."""
    rng = np.random.default_rng(1)
    many_blocks = rng.choice(3, 3 * stream.BLOCK_SYMBOLS, p=[0.6, 0.3, 0.1]).astype(np.uint8)
    many_runs = np.where(rng.random(3 * stream.BLOCK_SYMBOLS) < 0.98, 0, 1).astype(np.uint8)
    constant = np.full(100, 7, np.uint8)
    runs = np.where(rng.random(5000) < 0.98, 0, 1).astype(np.uint8)
    odd = rng.choice(3, 241, p=[0.7, 0.2, 0.1]).astype(np.uint8)  # k > 1 pads 241 symbols
    high = rng.choice([3, 9], 500).astype(np.uint8)
    cases = [many_blocks, many_runs, constant, runs, odd, high]
    data = [stream.encode_symbols(s) for s in cases]
    modes = [stream.MODE_TUPLE, stream.MODE_ZRUN, stream.MODE_CONST, stream.MODE_ZRUN]
    assert [d[0] for d in data[:4]] == modes
    fenced = [np.full(s.size + 64, 0xAB, np.uint8) for s in cases]
    outputs = [f[32:32 + s.size] for f, s in zip(fenced, cases, strict=True)]
    got = stream.decode_symbols_many(data, [s.size for s in cases],
                                     [256, 256, 256, 256, 256, 8], outputs)
    assert got[:3] == [None, None, None]
    assert got[3] is not None and got[3].ctypes.data == outputs[3].ctypes.data
    np.testing.assert_array_equal(got[3], runs)
    assert got[5] is None  # symbol 9 >= alphabet 8
    if got[4] is not None:  # (k = 1 was chosen for it: no padding)
        np.testing.assert_array_equal(got[4], odd)
    for f, s in zip(fenced, cases, strict=True):
        assert (f[:32] == 0xAB).all() and (f[32 + s.size:] == 0xAB).all()
    for d, s in zip(data[:5], cases[:5], strict=True):  # decode_symbols takes them all
        np.testing.assert_array_equal(stream.decode_symbols(d, s.size), s)


def test_damaged_streams_are_declined_or_decode_as_one_by_one() -> None:
    """Bit flips, truncations and alphabets the symbols exceed: a stream is declined, or
    decodes to exactly what ``decode_symbols`` gives for it; never to anything
    ``decode_symbols`` rejects."""
    rng = np.random.default_rng(2)
    accepted = declined = 0
    for _ in range(300):
        syms = [_symbols(rng, int(rng.choice([64, 240, 1000, 4099]))) for _ in range(6)]
        data = []
        for s in syms:
            d = bytearray(stream.encode_symbols(s))
            for _ in range(int(rng.integers(1, 3))):
                d[int(rng.integers(1, len(d)))] ^= 1 << int(rng.integers(0, 8))
            if rng.random() < 0.2:
                del d[int(rng.integers(2, len(d))):]
            data.append(bytes(d))
        # an alphabet of the largest symbol itself, sometimes: that stream must fail
        alphabets = [int(s.max()) + int(rng.integers(0, 3)) for s in syms]
        got = stream.decode_symbols_many(data, [s.size for s in syms], alphabets, [None] * 6)
        for d, s, a, g in zip(data, syms, alphabets, got, strict=True):
            want = _one(d, s.size, a)
            if g is None:
                declined += 1
                continue
            accepted += 1
            assert want is not None, "accepted a stream that decode_symbols rejects"
            np.testing.assert_array_equal(g, want)
    assert accepted > 50 and declined > 50


_CHURN = """
import threading
import numpy as np
from orbax_lossy.entropy import stream

rng = np.random.default_rng(3)
syms, data = [], []
while len(syms) < 40:  # TUPLE streams (the kernel decodes those)
    m = int(rng.choice([3, 5, 8]))
    s = rng.choice(m, 240, p=rng.dirichlet(np.ones(m))).astype(np.uint8)
    d = stream.encode_symbols(s)
    if d[0] == stream.MODE_TUPLE:
        syms.append(s)
        data.append(d)
stop = threading.Event()

def churn():
    while not stop.is_set():
        arrays = [np.full(size, 0xFF, np.uint8) for size in (512, 4096, 1024, 8192) * 8]
        del arrays

workers = [threading.Thread(target=churn) for _ in range(2)]
for w in workers:
    w.start()
wrong = 0
try:
    for _ in range(300):
        got = stream.decode_symbols_many(data, [240] * 40, [256] * 40, [None] * 40)
        wrong += sum(g is None or not np.array_equal(g, s) for g, s in zip(got, syms))
finally:
    stop.set()
    for w in workers:
        w.join()
print("wrong", wrong)
"""


def test_tables_live_until_the_last_stream_is_decoded() -> None:
    """The kernel reads its tables through addresses; they must stay alive until it is done
    (numba frees a variable after its last use). Other threads allocate and fill memory
    of the tables' sizes while it decodes, in a process with one malloc arena, so freed
    tables are reused at once (with the tables freed early this measured hundreds of wrong
    streams, or a crash)."""
    env = dict(cpu_env(), MALLOC_ARENA_MAX="1")
    out = subprocess.run([sys.executable, "-c", _CHURN], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["wrong", "0"], out.stdout


def _lc_chain(root, leaves: int, shape: tuple[int, int], steps: int,
              seed: int) -> dict[str, np.ndarray]:
    """A base and ``steps - 1`` LC(3) deltas of ``leaves`` small leaves under ``root``; the
    saver's reconstruction of the newest step, by leaf name."""
    rng = np.random.default_rng(seed)
    state = {f"w{j}": jnp.asarray(rng.standard_normal(shape), jnp.float32)
             for j in range(leaves)}
    saver = ol.LossyCheckpointHandler(ol.LeafPolicy.create(defaults={"param": ol.LC(3)}),
                                      base_interval=10)
    mngr = ol.checkpoint_manager(root, handler=saver, max_to_keep=None)
    for step in range(steps):
        state = {k: v + 0.01 * jnp.asarray(rng.standard_normal(shape), jnp.float32)
                 for k, v in state.items()}
        mngr.save(step, args=ol.LossySave(state))
        mngr.wait_until_finished()
    mngr.close()
    reference = saver.reference_for("default")
    return {path_str(p): np.asarray(v)
            for p, v in zip(reference.paths, reference.values, strict=True)}


def test_a_restore_of_many_small_leaves_decodes_them_together(tmp_path, monkeypatch) -> None:
    """A chain of many small leaves (one piece per leaf and link) restores bit for bit to
    the saver's reconstruction, with the leaves' links decoded together (windows of
    several links: states of ``FUSE_MIN_BYTES`` and more)."""
    held = _lc_chain(tmp_path, leaves=12, shape=(48, 40), steps=5, seed=4)
    decoded = []
    real = reading.decode_symbols_many

    def spy(*args):
        out = real(*args)
        decoded.append(sum(x is not None for x in out))
        return out

    monkeypatch.setattr(restoring, "FUSE_MIN_BYTES", 0)  # windows of several links
    monkeypatch.setattr(reading, "decode_symbols_many", spy)
    restored = ol.checkpoint_manager(tmp_path, max_to_keep=None).restore(
        4, args=ol.LossyRestore())  # the newest of 5 steps
    for name, value in restored.items():
        np.testing.assert_array_equal(np.asarray(value).view(np.uint32),
                                      held[name].view(np.uint32))
    # the 12 leaves' 4 delta links (a stream whose last tuple pads past its leaf's array
    # is left to decode_symbols: 1920 symbols in tuples of 7, say)
    assert sum(decoded) >= 40


@pytest.mark.parametrize("threads", [1, 2])
def test_pieces_it_declines_decode_the_usual_way(tmp_path, monkeypatch, threads) -> None:
    """With the kernel declining every stream, the restore reads each piece once and
    decodes it as before (the bytes it read are kept, not read again)."""
    held = _lc_chain(tmp_path, leaves=6, shape=(64, 32), steps=3, seed=5)
    monkeypatch.setattr(restoring, "FUSE_MIN_BYTES", 0)
    monkeypatch.setattr(reading, "decode_symbols_many", lambda s, *a: [None] * len(s))
    decodes, reads = [], []
    real_decode, real_read = reading.decode_piece, payload.PayloadReader.read

    def decode(reader, p, *args):
        where, data = args[-2:]  # (the step directory and leaf, the bytes read ahead)
        decodes.append((where, p.file, p.offset, data is not None))
        return real_decode(reader, p, *args)

    def read(self, ref, where):
        reads.append((where, ref.file, ref.offset))
        return real_read(self, ref, where)

    monkeypatch.setattr(reading, "decode_piece", decode)
    monkeypatch.setattr(payload.PayloadReader, "read", read)
    handler = ol.LossyCheckpointHandler(encode_threads=threads)
    restored = ol.checkpoint_manager(tmp_path, handler=handler, max_to_keep=None).restore(
        2, args=ol.LossyRestore())
    for name, value in restored.items():
        np.testing.assert_array_equal(np.asarray(value).view(np.uint32),
                                      held[name].view(np.uint32))
    assert len(decodes) == len(set(decodes)) == len(reads) == len(set(reads))
    assert any(pre_read for *_, pre_read in decodes)  # declined pieces: bytes passed on
