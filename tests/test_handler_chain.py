"""Delta chains through a real ``ocp.CheckpointManager``: bases, deltas, bit-exact restore of
every step, restarts, broken chains and metadata."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_lossy as ol
from orbax_lossy import format as fmt
from orbax_lossy.format import payload
from orbax_lossy.format.manifest import read_manifest_body as read_manifest
from orbax_lossy.treepaths import flatten, path_str


def make_state(seed: int = 0) -> dict:
    k = jax.random.split(jax.random.key(seed), 4)
    return {
        "params": {
            "w": jax.random.normal(k[0], (48, 40), jnp.float32),
            "b": jax.random.normal(k[1], (40,), jnp.float32) * 0.1,
            "h": jax.random.normal(k[2], (16,), jnp.bfloat16),
        },
        "step": jnp.int32(0),
        "rng": k[3],
        "count": 0,
        "host": np.linspace(0.0, 1.0, 5),
    }


def advance(state: dict, t: int) -> dict:
    k = jax.random.split(jax.random.key(1000 + t), 4)
    p = state["params"]
    return {
        "params": {
            "w": p["w"] + 0.01 * jax.random.normal(k[0], p["w"].shape),
            "b": p["b"] - 0.003 * jax.random.normal(k[1], p["b"].shape),
            "h": (p["h"] + 0.02 * jax.random.normal(k[2], p["h"].shape)).astype(jnp.bfloat16),
        },
        "step": state["step"] + 1,
        "rng": jax.random.split(state["rng"])[0],
        "count": state["count"] + 3,
        "host": state["host"] * 1.5,
    }


def snapshot(handler: ol.LossyCheckpointHandler) -> dict:
    """The reconstruction the handler holds right after a save, by leaf path (host copies)."""
    ref = handler.reference
    assert ref is not None
    return {
        path_str(p): None if v is None else np.array(np.asarray(v))
        for p, v in zip(ref.paths, ref.values, strict=True)
    }


def check_restored(restored, expected_recon: dict, saved_state: dict, assert_bitwise, where):
    paths, leaves, _ = flatten(restored)
    s_paths, s_leaves, _ = flatten(saved_state)
    saved = {path_str(p): v for p, v in zip(s_paths, s_leaves, strict=True)}
    got = {path_str(p): v for p, v in zip(paths, leaves, strict=True)}
    assert set(got) == set(expected_recon), where
    for name, value in got.items():
        exp = expected_recon[name]
        if exp is None:  # host leaf: stored exactly, returned as its Python/numpy type
            assert type(value) is type(saved[name]), (where, name)
            assert_bitwise(np.asarray(value), np.asarray(saved[name]), f"{where} {name}")
        else:
            assert_bitwise(value, exp, f"{where} {name}")


def item_dir(root, step: int, item: str = "default") -> str:
    return os.path.join(os.fspath(root), str(step), item)


class ForbiddenReader(payload.PayloadReader):
    def __init__(self, directory):  # pragma: no cover - must never run during a save
        raise AssertionError(f"a save read payloads from {directory}")


@pytest.mark.parametrize("reference_on_host", [False, True])
def test_every_step_of_a_multi_base_chain_restores_bitwise(
    tmp_path, monkeypatch, assert_bitwise, reference_on_host
):
    handler = ol.LossyCheckpointHandler(base_interval=3, reference_on_host=reference_on_host)
    mngr = ol.checkpoint_manager(tmp_path, handler=handler, max_to_keep=None)
    steps = [0, 2, 4, 6, 8, 10, 12, 14]  # bases at 0, 6, 12
    recon, saved = {}, {}
    state = make_state()
    monkeypatch.setattr(payload, "PayloadReader", ForbiddenReader)  # no save reads old payloads
    for t, step in enumerate(steps):
        if t:
            state = advance(state, t)
        assert mngr.save(step, args=ol.LossySave(state))
        recon[step], saved[step] = snapshot(handler), state
        holder = np.ndarray if reference_on_host else jax.Array
        assert all(v is None or isinstance(v, holder) for v in handler.reference.values)
    mngr.wait_until_finished()
    monkeypatch.undo()
    assert mngr.all_steps() == steps

    # The chain structure is recorded on disk.
    kinds, deps, sizes = [], [], {}
    for t, step in enumerate(steps):
        m = read_manifest(item_dir(tmp_path, step))
        kinds.append(m["kind"])
        deps.append(m["reference"]["step"] if m["reference"] else None)
        assert m["step"] == step and m["chain_length"] == t % 3
        sizes[step] = os.path.getsize(os.path.join(item_dir(tmp_path, step), "data.p0.bin"))
    assert kinds == ["base", "delta", "delta"] * 2 + ["base", "delta"]
    assert deps == [None, 0, 2, None, 6, 8, None, 12]
    assert max(sizes[s] for s in (2, 4, 8, 10, 14)) < min(sizes[s] for s in (0, 6, 12)) / 2

    # Lossy where promised: deltas of float params differ from the input but stay close;
    # the base codes float params with Cluster(8): at most 255 values, relative L2 error
    # below 2e-2 (about 7e-3 on Gaussian data).
    base_codecs = {"/".join(str(k) for _, k in leaf["path"]): leaf["codec"]["id"]
                   for leaf in read_manifest(item_dir(tmp_path, 0))["leaves"]}
    assert base_codecs["params/w"] == "cluster"
    w0 = np.asarray(saved[0]["params"]["w"])
    assert not np.array_equal(recon[0]["params/w"], w0)
    assert len(np.unique(recon[0]["params/w"])) <= 255
    assert np.linalg.norm(recon[0]["params/w"] - w0) / np.linalg.norm(w0) <= 2e-2
    w = np.asarray(saved[10]["params"]["w"])
    assert not np.array_equal(recon[10]["params/w"], w)
    assert np.abs(recon[10]["params/w"] - w).max() < 0.05

    # Every step, same manager, fresh manager and typed target, is bit-for-bit what the
    # saving process held.
    fresh = ol.checkpoint_manager(tmp_path, max_to_keep=None)
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x,
        state,
    )
    for step in steps:
        check_restored(mngr.restore(step), recon[step], saved[step], assert_bitwise, step)
        check_restored(fresh.restore(step), recon[step], saved[step], assert_bitwise, step)
        typed = fresh.restore(step, args=ol.LossyRestore(target))
        assert jax.tree.structure(typed) == jax.tree.structure(state)
        check_restored(typed, recon[step], saved[step], assert_bitwise, f"typed {step}")
    mngr.close()
    fresh.close()


@pytest.mark.slow
def test_restore_without_args_in_a_fresh_process(tmp_path, assert_bitwise):
    handler = ol.LossyCheckpointHandler(base_interval=4)
    with ol.checkpoint_manager(tmp_path, handler=handler, max_to_keep=None) as mngr:
        state = make_state(3)
        expected = {}
        for step in range(6):
            state = advance(state, step) if step else state
            mngr.save(step, args=ol.LossySave(state))
            expected[step] = snapshot(handler)
    out = tmp_path / "out"
    code = textwrap.dedent(f"""
        import numpy as np, jax, orbax.checkpoint as ocp
        import orbax_lossy
        from orbax_lossy.treepaths import flatten, path_str
        mngr = ocp.CheckpointManager({os.fspath(tmp_path)!r})
        for step in (2, 5):
            r = mngr.restore(step)
            p, v, _ = flatten(r)
            v = [jax.random.key_data(x) if jax.dtypes.issubdtype(
                getattr(x, 'dtype', np.float32), jax.dtypes.prng_key) else x for x in v]
            np.savez({os.fspath(out)!r} + f'_{{step}}.npz',
                     **{{path_str(a): np.asarray(b) for a, b in zip(p, v)}})
        print(mngr.latest_step())
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "5"
    for step in (2, 5):
        got = np.load(f"{out}_{step}.npz")
        for name, exp in expected[step].items():
            if exp is not None:
                assert_bitwise(got[name], exp, f"{step} {name}")


@pytest.mark.parametrize("with_args", [False, True])
def test_restart_restores_latest_and_continues_the_chain(tmp_path, assert_bitwise, with_args):
    h1 = ol.LossyCheckpointHandler(base_interval=5)
    m1 = ol.checkpoint_manager(tmp_path, handler=h1, max_to_keep=None)
    state, recon, saved = make_state(7), {}, {}
    for step in range(3):
        state = advance(state, step) if step else state
        m1.save(step, args=ol.LossySave(state))
        recon[step], saved[step] = snapshot(h1), state
    m1.wait_until_finished()
    del m1, h1  # the "process" dies; a new one starts on the same directory

    h2 = ol.LossyCheckpointHandler(base_interval=5)
    m2 = ol.checkpoint_manager(tmp_path, handler=h2, max_to_keep=None)
    assert m2.latest_step() == 2
    if with_args:
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x,
            state,
        )
        restored = m2.restore(2, args=ol.LossyRestore(target))
    else:
        restored = m2.restore(2)
    check_restored(restored, recon[2], saved[2], assert_bitwise, "restored")
    # The new handler's reference is exactly the old process's reconstruction of step 2.
    assert snapshot(h2).keys() == recon[2].keys()
    for name, v in snapshot(h2).items():
        if v is not None:
            assert_bitwise(v, recon[2][name], name)

    # Continue training from the restored state: the next saves are deltas on step 2.
    state = restored
    for step in range(3, 6):
        state = advance(state, step)
        m2.save(step, args=ol.LossySave(state))
        recon[step], saved[step] = snapshot(h2), state
    m2.wait_until_finished()
    deps = [read_manifest(item_dir(tmp_path, s))["reference"] for s in range(6)]
    assert [d and d["step"] for d in deps] == [None, 0, 1, 2, 3, None]
    fresh = ol.checkpoint_manager(tmp_path, max_to_keep=None)
    for step in range(6):
        check_restored(fresh.restore(step), recon[step], saved[step], assert_bitwise, step)


def test_restart_without_restore_starts_a_new_base(tmp_path, assert_bitwise):
    with ol.checkpoint_manager(tmp_path, base_interval=10, max_to_keep=None) as m1:
        m1.save(0, args=ol.LossySave(make_state()))
        m1.save(1, args=ol.LossySave(advance(make_state(), 1)))
    h = ol.LossyCheckpointHandler(base_interval=10)
    with ol.checkpoint_manager(tmp_path, handler=h, max_to_keep=None) as m2:
        state = advance(make_state(), 2)
        m2.save(2, args=ol.LossySave(state))
        rec = snapshot(h)
    m = read_manifest(item_dir(tmp_path, 2))
    assert m["kind"] == "base" and m["reference"] is None
    check_restored(ol.checkpoint_manager(tmp_path).restore(2), rec, state, assert_bitwise, 2)


def _chain(tmp_path, n=4):
    with ol.checkpoint_manager(tmp_path, base_interval=10, max_to_keep=None) as mngr:
        state = make_state()
        for step in range(n):
            state = advance(state, step) if step else state
            mngr.save(step, args=ol.LossySave(state))


def test_deleted_base_raises_missing_step_error(tmp_path):
    _chain(tmp_path)
    shutil.rmtree(tmp_path / "0")
    mngr = ol.checkpoint_manager(tmp_path, max_to_keep=None)
    assert mngr.all_steps() == [1, 2, 3]
    with pytest.raises(ol.MissingStepError, match=r"step 0\b") as err:
        mngr.restore(3)
    assert err.value.step == 0
    assert isinstance(err.value, ol.ChainError)


def test_deleted_middle_step_names_it(tmp_path):
    _chain(tmp_path)
    os.remove(os.path.join(item_dir(tmp_path, 1), fmt.MANIFEST_NAME))
    with pytest.raises(ol.MissingStepError, match=r"depends on step 1\b") as err:
        ol.checkpoint_manager(tmp_path, max_to_keep=None).restore(3)
    assert err.value.step == 1


def test_missing_payload_file_raises_format_error(tmp_path):
    _chain(tmp_path)
    os.remove(os.path.join(item_dir(tmp_path, 0), "data.p0.bin"))
    mngr = ol.checkpoint_manager(tmp_path, max_to_keep=None)
    with pytest.raises(ol.FormatError, match="data.p0.bin"):
        mngr.restore(2)


def test_item_metadata_reads_no_payload(tmp_path):
    _chain(tmp_path, n=3)
    for step in range(3):
        os.remove(os.path.join(item_dir(tmp_path, step), "data.p0.bin"))
    meta = ol.checkpoint_manager(tmp_path).item_metadata(2)
    state = make_state()
    def spec(m):
        return m.shape, m.dtype

    assert spec(meta["params"]["w"]) == ((48, 40), jnp.float32)
    assert spec(meta["params"]["h"]) == ((16,), jnp.bfloat16)
    assert spec(meta["step"]) == ((), jnp.int32)
    assert meta["rng"].shape == () and meta["rng"].dtype == state["rng"].dtype
    assert meta["host"].shape == (5,) and meta["host"].dtype == np.float64


def test_manifest_is_json_friendly_summary(tmp_path):
    """Step/kind/reference of every checkpoint can be listed without the payload."""
    _chain(tmp_path, n=2)
    summary = {
        s: {k: read_manifest(item_dir(tmp_path, s))[k] for k in ("step", "kind", "reference")}
        for s in range(2)
    }
    json.dumps(summary)
    assert summary[1]["reference"]["step"] == 0
    assert isinstance(ocp.CheckpointManager(tmp_path).all_steps(), list)


@pytest.mark.parametrize("pool_from", [1024, None])
def test_restore_decodes_large_pieces_ahead_on_the_pool(tmp_path, monkeypatch, assert_bitwise,
                                                        pool_from):
    """A link's pieces of at least ``reading.POOL_MIN_ELEMENTS`` elements are decoded on the
    piece pool ahead of its device program, also when a field is one piece (they used to be
    decoded on the restoring thread when the link's program needed them: 64 MB 9-delta
    restore 146 -> 111 ms on two cores); smaller pieces are decoded on the restoring thread,
    where they do not contend for the GIL with it (a 360-leaf 64 MB restore: 1.15 -> 0.84
    s)."""
    import threading

    from orbax_lossy.engine import reading

    if pool_from is not None:  # every piece of this test's leaves (64 and 4096 elements)
        monkeypatch.setattr(reading, "POOL_MIN_ELEMENTS", pool_from)
    threads_seen: dict[tuple, str] = {}
    decode_piece = reading.decode_piece

    def recording(reader, p, *args, **kwargs):
        threads_seen[p.box] = threading.current_thread().name
        return decode_piece(reader, p, *args, **kwargs)

    saver = ol.LossyCheckpointHandler(ol.LeafPolicy.create(defaults={"param": ol.LC(3)}),
                                      encode_threads=2)
    mngr = ol.checkpoint_manager(tmp_path, handler=saver, max_to_keep=None)
    state = {"w": jnp.linspace(-1.0, 1.0, 64 * 64, dtype=jnp.float32).reshape(64, 64),
             "b": jnp.ones((64,), jnp.float32)}
    for step in range(3):
        state = {k: v * 0.99 + 0.001 * step for k, v in state.items()}
        mngr.save(step, args=ol.LossySave(state))
    mngr.wait_until_finished()
    reference = saver.reference_for("default")
    expected = {path_str(p): np.asarray(v)
                for p, v in zip(reference.paths, reference.values, strict=True)}
    monkeypatch.setattr(reading, "decode_piece", recording)
    handler = ol.LossyCheckpointHandler(encode_threads=2)
    restored = ol.checkpoint_manager(tmp_path, handler=handler, max_to_keep=None).restore(2)
    large, small = threads_seen[((0, 64), (0, 64))], threads_seen[((0, 64),)]
    if pool_from is None:  # the defaults: both leaves are small
        assert large == small == "MainThread", threads_seen
    else:
        assert large.startswith("orbax_lossy_pieces"), threads_seen
        assert small == "MainThread", threads_seen
    for name in ("w", "b"):  # the chain's closed-loop reconstruction, bit for bit
        assert_bitwise(restored[name], expected[name], name)
    mngr.close()
