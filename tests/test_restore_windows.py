"""A restore decodes a chain's links in windows (one program per leaf and window,
``device.decode_links``): whatever the window size, every step restores bit for bit what the
saving process held, including a leaf stored whole in the middle of the chain."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import orbax_lossy as ol
from orbax_lossy.engine import device
from orbax_lossy.engine import restore as restoring
from orbax_lossy.format.manifest import read_manifest
from orbax_lossy.treepaths import flatten, path_str

STEPS = 7  # a base and six deltas


def _states() -> list[dict]:
    """An AdamW train state (params, mu, nu, count) over STEPS optimizer steps; at step 3 one
    parameter holds a NaN, so that save stores it whole (the guard) and later links build on
    that instead of on the base."""
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(k[0], (64, 48), jnp.float32),
              "b": 0.1 * jax.random.normal(k[1], (48,), jnp.float32),
              "v": jax.random.normal(k[2], (300,), jnp.float32)}
    tx = optax.adamw(1e-2)
    opt = tx.init(params)
    out = []
    for t in range(STEPS):
        g = jax.tree.map(lambda p, t=t: jnp.sin(p * (t + 1)), params)
        updates, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, updates)
        saved = params
        if t == 3:
            saved = {**params, "v": params["v"].at[5].set(jnp.nan)}
        out.append({"params": saved, "opt_state": opt})
    return out


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """The chain on disk and, per step, the reconstruction the saver held after that save."""
    root = tmp_path_factory.mktemp("windows")
    saver = ol.LossyCheckpointHandler(base_interval=STEPS)
    mngr = ol.checkpoint_manager(root, handler=saver, max_to_keep=None)
    held = {}
    for step, state in enumerate(_states()):
        mngr.save(step, args=ol.LossySave(state))
        mngr.wait_until_finished()
        reference = saver.reference_for("default")
        held[step] = {path_str(p): None if v is None else np.array(np.asarray(v))
                      for p, v in zip(reference.paths, reference.values, strict=True)}
    mngr.close()
    return root, held


@pytest.mark.parametrize("window", ["small", "budget", "link", "two", "default", "widest"])
def test_every_step_restores_bitwise_with_any_window(chain, monkeypatch, assert_bitwise,
                                                     window) -> None:
    """Windows end at the newest link and hold ``W`` delta links each (the oldest window:
    the base and the rest), ``W`` = ``MAX_WINDOW_LINKS`` unless the memory budget allows
    fewer, or 1 for a state under ``FUSE_MIN_BYTES``; every restored leaf is bit-identical to
    the saver's reconstruction. ``default``: the budget counts one leaf's fields per link (a
    restore decodes leaf by leaf): the largest leaf that needs a reference (``params/w``,
    3072 one-byte symbols) against ``WINDOW_FRACTION`` (1/3) of the state's 41040 bytes
    gives windows of 4 links."""
    root, held = chain
    calls: list[int] = []
    real = device.decode_links

    def counting(fields, sides, reference, **statics):
        calls.append(len(fields))
        return real(fields, sides, reference, **statics)

    monkeypatch.setattr(device, "decode_links", counting)
    size = {"small": 1, "budget": 1, "link": 1, "two": 2, "default": 4,
            "widest": restoring.MAX_WINDOW_LINKS}[window]
    if window != "small":  # a state this small decodes link by link unless told otherwise
        monkeypatch.setattr(restoring, "FUSE_MIN_BYTES", 0)
    if window == "budget":  # the fields of one link exceed the budget: one link per window
        monkeypatch.setattr(restoring, "WINDOW_FRACTION", 1e-9)
    elif window == "widest":  # a budget that MAX_WINDOW_LINKS caps
        monkeypatch.setattr(restoring, "WINDOW_FRACTION", 1.0)
    elif window in ("link", "two"):
        monkeypatch.setattr(restoring, "MAX_WINDOW_LINKS", size)
    mngr = ol.checkpoint_manager(root, max_to_keep=None)
    kinds = [read_manifest(root / str(s) / "default").header.save_type for s in range(STEPS)]
    assert kinds == ["base"] + ["delta"] * (STEPS - 1)
    for step in range(STEPS):
        calls.clear()
        restored = mngr.restore(step)
        paths, leaves, _ = flatten(restored)
        flat = {path_str(p): v for p, v in zip(paths, leaves, strict=True)}
        for name, expected in held[step].items():
            if expected is not None:
                assert_bitwise(flat[name], expected, f"step {step} {name}")
        oldest = 1 + step % size  # the base and the links that do not fill a window
        assert max(calls) == (max(oldest, size) if step >= size else oldest), (step, calls)
    manifest = read_manifest(root / "3" / "default")
    v = next(leaf for leaf in manifest.leaves if leaf.name == "params/v")
    assert not v.codec.needs_reference  # the NaN save stored it whole
    mngr.close()


def test_recycling_windows_restores_bitwise(tmp_path, monkeypatch, assert_bitwise) -> None:
    """A restore recycles a window's uint8 host arrays for the links after it
    (``reading.HostBuffers``), with a window per link here: every link but the first decodes
    into arrays an earlier link used, and the restore still equals what was saved (an
    unchanged uint8 leaf stored in the base only lives on through every window)."""
    monkeypatch.setattr(restoring, "FUSE_MIN_BYTES", 0)
    monkeypatch.setattr(restoring, "MAX_WINDOW_LINKS", 1)  # a window (and recycling) per link
    rng = np.random.default_rng(0)
    mask = jnp.asarray(rng.integers(0, 256, size=(256, 64)), jnp.uint8)  # stored in the base
    states = [{"w": jnp.asarray(rng.normal(size=(256, 64)), jnp.float32) * (1 + 0.01 * t),
               "mask": mask} for t in range(5)]
    mngr = ol.checkpoint_manager(tmp_path, max_to_keep=None)
    for step, state in enumerate(states):
        mngr.save(step, args=ol.LossySave(state))
        mngr.wait_until_finished()
    mngr.close()
    recycled: list[int] = []
    real = restoring.reading.HostBuffers.recycle

    def counting(self, owners, live):
        recycled.extend(owners)
        return real(self, owners, live)

    monkeypatch.setattr(restoring.reading.HostBuffers, "recycle", counting)
    restored = ol.checkpoint_manager(tmp_path, max_to_keep=None).restore(4)
    assert recycled, "no window's arrays were recycled"
    assert_bitwise(restored["mask"], np.asarray(states[4]["mask"]), "the exact uint8 leaf")


def test_host_buffers_keep_an_array_a_live_value_uses() -> None:
    """``recycle`` gives back a lent array only if no live array uses its memory: on CPU a
    zero-copy upload of a host array *is* that memory (a program returning its input unchanged
    hands it back as the value)."""
    buffers = restoring.reading.HostBuffers()
    take = buffers.lender(0)
    kept, free = take((64, 16), np.dtype(np.uint8)), take((64, 16), np.dtype(np.uint8))
    kept[:] = 7
    value = jax.device_put(kept, jax.devices("cpu")[0])
    if value.unsafe_buffer_pointer() != kept.ctypes.data:
        pytest.skip("this runtime copies host arrays on upload")
    buffers.recycle([0], [value])
    again = buffers.lender(1)
    first, second = again((64, 16), np.dtype(np.uint8)), again((64, 16), np.dtype(np.uint8))
    assert first.ctypes.data == free.ctypes.data  # the free one comes back ...
    assert second.ctypes.data not in (kept.ctypes.data, free.ctypes.data)  # ... the kept never
    assert (np.asarray(value) == 7).all()


def test_an_exact_leaf_restores_as_its_decoded_array_and_donates_safely(tmp_path,
                                                                      monkeypatch) -> None:
    """On one CPU device an exact leaf's restore runs no program: its array is the memory its
    pieces decoded into. Donating it to a training step leaves the manager's reference (a
    copy) intact, so the next delta save and its restore hold what was saved."""
    w = jnp.linspace(-2.0, 3.0, 96 * 80, dtype=jnp.float32).reshape(96, 80)
    state = {"w": w, "count": jnp.asarray(7, jnp.int32)}
    # a lossless base (the default policy's bases store parameters with 8-bit clusters)
    mngr = ol.checkpoint_manager(tmp_path, max_to_keep=None, policy=ol.LeafPolicy.lossless())
    mngr.save(0, args=ol.LossySave(state))
    mngr.close()
    programs = []
    real = device.decode_links
    monkeypatch.setattr(device, "decode_links", lambda *a, **k: programs.append(1) or real(*a, **k))
    fresh = ol.checkpoint_manager(tmp_path, max_to_keep=None)  # lossy deltas from here on
    restored = fresh.restore(0)
    assert programs == []  # the base stores both leaves exactly
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(w))
    assert restored["w"].sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])
    stepped = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)(restored)
    np.testing.assert_array_equal(np.asarray(stepped["w"]), np.asarray(w) + 1)
    fresh.save(1, args=ol.LossySave(stepped))
    fresh.close()
    assert read_manifest(tmp_path / "1" / "default").header.save_type == "delta"
    again = ol.checkpoint_manager(tmp_path, max_to_keep=None).restore(1)
    np.testing.assert_allclose(np.asarray(again["w"]), np.asarray(w) + 1, rtol=0.05, atol=0.05)
    assert int(again["count"]) == 8


def test_a_failed_link_cancels_the_window_decoding_ahead(chain, tmp_path, monkeypatch) -> None:
    """A restore that fails on a damaged link drops the pieces it queued for the window
    after it (double buffering starts that window's decoding early): of the next window's
    pieces only those a worker had already started run; the error names the damaged step."""
    import concurrent.futures
    import re
    import shutil
    import threading

    from orbax_lossy.engine import reading
    from orbax_lossy.errors import ChecksumError

    root, _ = chain
    copy = tmp_path / "chain"
    shutil.copytree(root, copy)
    payload = copy / "2" / "default" / "data.p0.bin"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(data))
    monkeypatch.setattr(restoring, "FUSE_MIN_BYTES", 0)
    monkeypatch.setattr(restoring, "MAX_WINDOW_LINKS", 2)  # windows [0 1] [2 3] [4 5] [6]
    monkeypatch.setattr(reading, "POOL_MIN_ELEMENTS", 0)  # every piece on the pool
    gate = threading.Event()
    ran: list[int] = []
    real = reading.decode_piece

    def decode(reader, p, codec, field, dtype, where, data=None):
        step = int(re.search(r"\(step (\d+)\)", where).group(1))
        if step >= 4:  # the window after the damaged one waits until the restore has failed
            gate.wait(30)
            ran.append(step)
        return real(reader, p, codec, field, dtype, where, data)

    monkeypatch.setattr(reading, "decode_piece", decode)
    threads = 2
    handler = ol.LossyCheckpointHandler(encode_threads=threads)
    mngr = ol.checkpoint_manager(copy, handler=handler, max_to_keep=None)
    try:
        with pytest.raises(ChecksumError, match=r"step 2"):
            mngr.restore(STEPS - 1)
        queued = sum(1 for leaf in read_manifest(copy / "4" / "default").leaves
                     for _ in leaf.pieces) * 2  # pieces of links 4 and 5, at most
    finally:
        gate.set()
        # every task queued before this one has run or been cancelled once it has run
        pool = reading.piece_pool(threads)
        concurrent.futures.wait([pool.submit(lambda: None) for _ in range(threads)])
        mngr.close()
    assert queued > threads
    assert len(ran) <= threads, ran  # only pieces a worker held at the gate


def test_copy_tree_copies_every_array_in_one_call() -> None:
    """The restored values' copies (the next reference): equal values, dtypes and shardings in
    memory of their own, ``None`` entries kept in place."""
    values = [jnp.arange(12.0).reshape(3, 4), None, jnp.ones((5,), jnp.bfloat16),
              jnp.array(7, jnp.int32), None]
    copies = device.copy_tree(values)
    assert [c is None for c in copies] == [v is None for v in values]
    for v, c in zip(values, copies, strict=True):
        if v is None:
            continue
        assert c.dtype == v.dtype and c.shape == v.shape and c.sharding == v.sharding
        assert c.unsafe_buffer_pointer() != v.unsafe_buffer_pointer()
        np.testing.assert_array_equal(np.asarray(c), np.asarray(v))
    assert device.copy_tree([None, None]) == [None, None]
    assert device.copy_tree([]) == []


def test_the_longest_default_chain_decodes_in_one_window() -> None:
    """A base and the ``base_interval - 1`` deltas after it (the default interval's longest
    chain) are one window when the budget allows it: one job per leaf, not a window of the
    base and another of the deltas; longer chains keep windows that end at the newest link."""
    import inspect

    interval = inspect.signature(ol.LossyCheckpointHandler).parameters["base_interval"].default
    assert interval <= restoring.MAX_WINDOW_LINKS
    assert restoring._windows(interval, restoring.MAX_WINDOW_LINKS) == [range(0, interval)]
    assert restoring._windows(12, 10) == [range(0, 2), range(2, 12)]
    assert restoring._windows(10, 9) == [range(0, 1), range(1, 10)]
