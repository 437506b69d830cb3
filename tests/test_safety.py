"""What is read back is what was saved, or a typed error (issue 11).

Guard against overflowing deltas, chain identity (swapped, repointed, reordered, retyped,
shrunk links), confinement to the checkpoint root, regular files only, bounded memory, one
writer per root, and the leaf types LossySave accepts and restores.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_lossy as ol
from orbax_lossy import format as fmt
from orbax_lossy.errors import RootLockedError
from orbax_lossy.format.manifest import read_manifest_body
from orbax_lossy.treepaths import flatten, path_str

REPO = pathlib.Path(__file__).resolve().parents[1]


def _bits(x) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(x))
    return a if a.dtype.kind in "biu" else a.view(np.dtype(f"u{a.dtype.itemsize}"))


def make_state(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "w": jnp.asarray(rng.standard_normal((48, 40)), jnp.float32),
            "h": jnp.asarray(rng.standard_normal(40), jnp.bfloat16),
        },
        "opt": {"mu": jnp.asarray(rng.standard_normal((48, 40)) * 0.01, jnp.float32)},
        "step": jnp.int32(0),
        "host": np.linspace(0.0, 1.0, 5),
        "count": 3,
    }


def advance(state: dict, t: int) -> dict:
    rng = np.random.default_rng(100 + t)
    p = state["params"]
    return {
        "params": {
            "w": p["w"] + jnp.asarray(0.01 * rng.standard_normal(p["w"].shape), jnp.float32),
            "h": (p["h"] + 0.02).astype(jnp.bfloat16),
        },
        "opt": {"mu": state["opt"]["mu"] * 0.9},
        "step": state["step"] + 1,
        "host": state["host"] * 1.5,
        "count": state["count"] + 1,
    }


def expected_of(handler: ol.LossyCheckpointHandler, state) -> dict[str, np.ndarray]:
    """What a restore of the step just saved must return, by leaf name (bit patterns)."""
    ref = handler.reference
    paths, leaves, _ = flatten(state)
    saved = {path_str(p): v for p, v in zip(paths, leaves, strict=True)}
    out = {}
    for p, v in zip(ref.paths, ref.values, strict=True):
        name = path_str(p)
        out[name] = _bits(saved[name] if v is None else v)
    return out


def save_chain(root, n: int = 4, chunk_bytes: int = 1024) -> list[dict[str, np.ndarray]]:
    """A base and ``n - 1`` deltas under ``root``; the expected values of every step."""
    handler = ol.LossyCheckpointHandler(base_interval=10, chunk_bytes=chunk_bytes)
    expected = []
    with ol.checkpoint_manager(root, handler=handler, max_to_keep=None,
                               enable_async_checkpointing=False) as mngr:
        state = make_state()
        for step in range(n):
            state = advance(state, step) if step else state
            mngr.save(step, args=ol.LossySave(state))
            mngr.wait_until_finished()
            expected.append(expected_of(handler, state))
    return expected


def item(root, step: int) -> str:
    return os.path.join(root, str(step), "default")


def restore_or_error(path: str, expected: dict[str, np.ndarray]) -> Exception | None:
    """None when the restore returns exactly ``expected``; the LossyError it raised otherwise.

    Anything else (wrong values, an untyped exception) fails the test.
    """
    try:
        restored = ol.LossyCheckpointHandler().restore(path)
    except ol.LossyError as e:
        return e
    paths, leaves, _ = flatten(restored)
    got = {path_str(p): _bits(v) for p, v in zip(paths, leaves, strict=True)}
    assert set(got) == set(expected), f"{path}: leaf names differ"
    for name, want in expected.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, (path, name)
        np.testing.assert_array_equal(got[name], want, err_msg=f"{path} {name}: wrong values")
    return None


def rewrite(item_dir: str, mutate) -> None:
    """Apply ``mutate`` to the manifest body and rewrite it with a valid checksum."""
    body = read_manifest_body(item_dir)
    mutate(body)
    fmt.write_envelope(os.path.join(item_dir, fmt.MANIFEST_NAME), "manifest", body)


def leaf_of(body: dict, name: str) -> dict:
    return next(x for x in body["leaves"] if "/".join(str(k) for _, k in x["path"]) == name)


# ------------------------------------------------------------------ guard


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_overflowing_delta_is_stored_exactly(tmp_path, dtype) -> None:
    """-3e38 -> +3e38 between saves: the delta overflows; the leaf is stored exactly."""
    big = float(jnp.finfo(dtype).max) * 0.9
    handler = ol.LossyCheckpointHandler(base_interval=10)
    with ol.checkpoint_manager(tmp_path, handler=handler, max_to_keep=None,
                               enable_async_checkpointing=False) as mngr:
        w = jnp.linspace(-1, 1, 256, dtype=jnp.float32).astype(dtype)
        mngr.save(0, args=ol.LossySave({"params": {"w": w - big, "v": w}}))
        mngr.wait_until_finished()
        after = {"params": {"w": jnp.full((256,), big, dtype), "v": w + 0.01}}
        mngr.save(1, args=ol.LossySave(after))
        mngr.wait_until_finished()
    body = read_manifest_body(item(tmp_path, 1))
    assert body["kind"] == "delta"
    assert leaf_of(body, "params/w")["codec"]["id"] == "exact"  # guarded
    assert leaf_of(body, "params/v")["codec"]["id"] != "exact"  # still lossy
    restored = ol.checkpoint_manager(tmp_path).restore(1)
    got = np.asarray(restored["params"]["w"])
    assert np.all(np.isfinite(got.astype(np.float32)))
    np.testing.assert_array_equal(_bits(got), _bits(after["params"]["w"]))


# ------------------------------------------------------------------ chain identity


@pytest.fixture
def chain(tmp_path):
    expected = save_chain(tmp_path)
    return tmp_path, expected


def test_intact_chain_restores_every_step(chain) -> None:
    root, expected = chain
    for step, exp in enumerate(expected):
        assert restore_or_error(item(root, step), exp) is None


def test_swapped_item_directories_are_refused(chain) -> None:
    root, expected = chain
    tmp = os.path.join(root, "swap")
    os.rename(item(root, 1), tmp)
    os.rename(item(root, 2), item(root, 1))
    os.rename(tmp, item(root, 2))
    for step in (1, 2, 3):
        assert isinstance(restore_or_error(item(root, step), expected[step]), ol.ChainError)
    assert restore_or_error(item(root, 0), expected[0]) is None


def test_swapped_step_directories_are_refused(chain) -> None:
    root, expected = chain
    os.rename(os.path.join(root, "1"), os.path.join(root, "x"))
    os.rename(os.path.join(root, "2"), os.path.join(root, "1"))
    os.rename(os.path.join(root, "x"), os.path.join(root, "2"))
    for step in (1, 2, 3):
        assert isinstance(restore_or_error(item(root, step), expected[step]), ol.ChainError)


@pytest.mark.parametrize("how", ["relpath", "relpath+step", "relpath+step-save_id"])
def test_reference_repointed_to_another_step_is_refused(chain, how) -> None:
    root, expected = chain

    def repoint(body):
        body["reference"]["relpath"] = "../../1/default"
        if "step" in how:
            body["reference"]["step"] = 1
        if "-save_id" in how:
            del body["reference"]["save_id"]

    rewrite(item(root, 3), repoint)
    assert isinstance(restore_or_error(item(root, 3), expected[3]), ol.ChainError)


def test_reordered_leaves_restore_by_path(chain) -> None:
    root, expected = chain
    for step in (1, 2, 3):
        rewrite(item(root, step), lambda b: b["leaves"].reverse())
    for step in range(4):
        assert restore_or_error(item(root, step), expected[step]) is None


@pytest.mark.parametrize("step", [0, 1, 2])
@pytest.mark.parametrize("change", ["dtype", "shape", "storage", "drop"])
def test_leaf_changed_mid_chain_is_refused(chain, step, change) -> None:
    root, expected = chain

    def mutate(body):
        leaf = leaf_of(body, "params/w")
        if change == "dtype":
            leaf["dtype"] = "bfloat16"
        elif change == "shape":  # shrink, keeping a consistent grid and coverage
            leaf["shape"] = [24, 40]
            leaf["chunk"] = list(fmt.chunk_shape_for((24, 40), 4, body["chunk_bytes"]))
            leaf["pieces"] = [p for p in leaf["pieces"] if p["box"][0][1] <= 24]
        elif change == "storage":
            leaf["kind"] = "numpy"
        else:
            body["leaves"].remove(leaf)

    rewrite(item(root, step), mutate)
    err = restore_or_error(item(root, 3), expected[3])
    assert isinstance(err, (ol.ChainError, ol.FormatError)), err


# ------------------------------------------------------------------ confinement


@pytest.mark.parametrize("relpath", ["/etc", "../../../elsewhere/0/default", "../../0/../0/default",
                                     "../../0/default/..", "../../0\x00/default"])
def test_reference_paths_stay_in_the_root(chain, relpath) -> None:
    root, expected = chain
    rewrite(item(root, 1), lambda b: b["reference"].update(relpath=relpath))
    assert isinstance(restore_or_error(item(root, 1), expected[1]), ol.ChainError)


def test_reference_to_a_checkpoint_outside_the_root_is_refused(tmp_path) -> None:
    root = tmp_path / "root"
    expected = save_chain(root, n=2)
    outside = tmp_path / "other"
    save_chain(outside, n=1)
    absolute = os.path.abspath(item(outside, 0))
    rewrite(item(root, 1), lambda b: b["reference"].update(relpath=absolute))
    assert isinstance(restore_or_error(item(root, 1), expected[1]), ol.ChainError)
    rel = os.path.relpath(absolute, item(root, 1))
    rewrite(item(root, 1), lambda b: b["reference"].update(relpath=rel))
    assert isinstance(restore_or_error(item(root, 1), expected[1]), ol.ChainError)


def test_symlinks_leaving_the_root_are_refused(tmp_path) -> None:
    root = tmp_path / "root"
    expected = save_chain(root, n=2)
    outside = tmp_path / "outside"
    shutil.move(os.path.join(root, "0"), outside)
    os.symlink(outside, os.path.join(root, "0"))  # the referenced step lives elsewhere
    assert isinstance(restore_or_error(item(root, 1), expected[1]), ol.ChainError)
    # A payload file that is a symlink out of the root.
    shutil.rmtree(tmp_path / "root")
    expected = save_chain(root, n=1)
    data = os.path.join(item(root, 0), fmt.data_file_name(0))
    shutil.move(data, tmp_path / "data.bin")
    os.symlink(tmp_path / "data.bin", data)
    assert isinstance(restore_or_error(item(root, 0), expected[0]), ol.FormatError)


def _finishes(fn, timeout: float = 60.0):
    result: list = []

    def run():
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - reported to the test
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "restore hung"
    return result[0]


@pytest.mark.parametrize("name", [fmt.MANIFEST_NAME, fmt.data_file_name(0)])
def test_fifo_instead_of_a_file_does_not_hang(chain, name) -> None:
    root, expected = chain
    for step in (0, 3):
        path = os.path.join(item(root, step), name)
        os.remove(path)
        os.mkfifo(path)
    for step in (0, 3):
        err = _finishes(lambda s=step: restore_or_error(item(root, s), expected[s]))
        assert isinstance(err, ol.FormatError), err


def test_nul_in_a_piece_file_name(chain) -> None:
    root, expected = chain
    rewrite(item(root, 2), lambda b: b["leaves"][0]["pieces"][0].update(file="data.p0.bin\x00x"))
    assert isinstance(restore_or_error(item(root, 3), expected[3]), ol.FormatError)


# ------------------------------------------------------------------ bounded memory and time


_BOMBS = r"""
import json, os, resource, sys
import orbax_lossy as ol
cases = json.loads(sys.argv[1])
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {}
for name, path in cases.items():
    try:
        ol.LossyCheckpointHandler().restore(path)
        out[name] = "restored"
    except ol.LossyError as e:
        out[name] = type(e).__name__
    except BaseException as e:
        out[name] = "UNTYPED " + type(e).__name__ + ": " + str(e)[:200]
out["growth_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
print(json.dumps(out))
"""


def _one_leaf(root, shape, dtype=np.float32) -> str:
    with ocp.Checkpointer(ol.LossyCheckpointHandler()) as ckptr:
        ckptr.save(os.path.join(root, "0", "default"),
                   args=ol.LossySave({"w": jnp.zeros(shape, dtype)}))
    return os.path.join(root, "0", "default")


def _claim(item_dir: str, shape, chunk_bytes: int = 1 << 30, payload: bytes | None = None):
    """Rewrite a one-leaf item to claim ``shape``; every grid cell points at one small piece."""
    if payload is not None:
        pathlib.Path(item_dir, fmt.data_file_name(0)).write_bytes(payload)

    def mutate(body):
        body["chunk_bytes"] = chunk_bytes
        leaf = body["leaves"][0]
        piece = leaf["pieces"][0]
        if payload is not None:
            piece.update(offset=0, length=len(payload), crc32=fmt.crc32(payload))
        chunk = fmt.chunk_shape_for(shape, 4, chunk_bytes)
        leaf.update(shape=list(shape), chunk=list(chunk))
        leaf["pieces"] = [dict(piece, box=[list(b) for b in box])
                          for box in fmt.grid_pieces(fmt.full_box(shape), chunk)]

    rewrite(item_dir, mutate)


def test_claims_of_huge_allocations_fail_fast_with_small_memory(tmp_path) -> None:
    """Tiny inputs claiming huge arrays: a typed error, and the process stays small."""
    import zlib

    cases = {}
    # A 39-byte payload claiming a 1 GiB piece.
    cases["piece"] = _one_leaf(tmp_path / "piece", (8,))
    _claim(cases["piece"], (1 << 14, 1 << 14), payload=bytes(range(39)))
    # A manifest claiming 2**40 elements (4096 grid cells, all pointing at one piece).
    cases["elements"] = _one_leaf(tmp_path / "elements", (8,))
    _claim(cases["elements"], (1 << 20, 1 << 20))
    # A huge side array.
    cases["side"] = _one_leaf(tmp_path / "side", (8,))
    rewrite(cases["side"], lambda b: b["leaves"][0].update(
        side={"rep": {"dtype": "float32", "shape": [1 << 24], "data": bytes(4 << 24)}}))
    # A zlib bomb: 256 MiB of zeros in a few hundred kB.
    cases["bomb"] = _one_leaf(tmp_path / "bomb", (8,))
    z = zlib.compressobj(9)
    body = z.compress(b"\x81\xa6leaves\xdb" + (256 << 20).to_bytes(4, "big"))
    for _ in range(256):
        body += z.compress(bytes(1 << 20))
    body += z.flush()
    import msgpack

    env = msgpack.packb({"magic": fmt.MAGIC, "kind": "manifest", "version": 2,
                         "crc32": fmt.crc32(body), "encoding": "zlib", "body": body})
    pathlib.Path(cases["bomb"], fmt.MANIFEST_NAME).write_bytes(env)
    # A body of millions of empty containers (each a few bytes stored, ~60 in memory).
    cases["containers"] = _one_leaf(tmp_path / "containers", (8,))
    n = 6 << 20
    raw = b"\x81\xa6leaves\xdd" + n.to_bytes(4, "big") + b"\x90" * n
    body = zlib.compress(raw, 9)
    env = msgpack.packb({"magic": fmt.MAGIC, "kind": "manifest", "version": 2,
                         "crc32": fmt.crc32(body), "encoding": "zlib", "body": body})
    pathlib.Path(cases["containers"], fmt.MANIFEST_NAME).write_bytes(env)
    # Many leaves, each with a side array at the per-leaf limit.
    cases["sides"] = _one_leaf(tmp_path / "sides", (8,))

    def many(b):
        leaf = b["leaves"][0]
        b["leaves"] = [dict(leaf, path=[["d", f"w{i}"]], side={"rep": {
            "dtype": "uint8", "shape": [1 << 20], "data": bytes(1 << 20)}}) for i in range(256)]

    rewrite(cases["sides"], many)
    proc = subprocess.run([sys.executable, "-c", _BOMBS, json.dumps(
        {k: str(v) for k, v in cases.items()})], capture_output=True, text=True, timeout=600,
        cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    growth = out.pop("growth_mb")
    for name, result in out.items():
        assert result in ("FormatError", "TruncatedError", "ChecksumError", "ChainError"), (
            name, result)
    assert growth < 500, f"peak memory grew by {growth:.0f} MB"


def test_restore_time_is_linear_in_the_number_of_leaves(tmp_path, monkeypatch) -> None:
    """Count the work per leaf (piece reads, region reads) rather than timing it."""
    from orbax_lossy.engine import reading

    calls = {"regions": 0, "pieces_seen": 0}
    real_read_region = reading.read_region

    def counting(reader, pieces, *args, **kwargs):
        calls["regions"] += 1
        calls["pieces_seen"] += len(pieces)
        return real_read_region(reader, pieces, *args, **kwargs)

    monkeypatch.setattr(reading, "read_region", counting)
    per_leaf = []
    for n in (250, 1000):
        state = {f"l{i}": (jnp.full((4,), float(i)) if i % 2 else np.float32(i))
                 for i in range(n)}
        path = tmp_path / str(n) / "0" / "default"
        with ocp.Checkpointer(ol.LossyCheckpointHandler()) as ckptr:
            ckptr.save(path, args=ol.LossySave(state))
        calls.update(regions=0, pieces_seen=0)
        restored = ol.LossyCheckpointHandler().restore(path)
        assert len(restored) == n and type(restored["l0"]) is np.float32
        per_leaf.append((calls["regions"] / n, calls["pieces_seen"] / n))
    assert per_leaf[0] == per_leaf[1]  # the same work per leaf at 4x the leaves


# ------------------------------------------------------------------ one writer per root


def test_second_handler_in_a_root_is_refused_until_the_first_closes(tmp_path) -> None:
    state = make_state()
    m1 = ol.checkpoint_manager(tmp_path, max_to_keep=None, enable_async_checkpointing=False)
    m1.save(0, args=ol.LossySave(state))
    m2 = ol.checkpoint_manager(tmp_path, max_to_keep=None, enable_async_checkpointing=False)
    with pytest.raises(RootLockedError, match=str(tmp_path)):
        m2.save(1, args=ol.LossySave(state))
    assert os.path.isfile(tmp_path / ".orbax-lossy.lock")
    m1.close()
    m3 = ol.checkpoint_manager(tmp_path, max_to_keep=None, enable_async_checkpointing=False)
    m3.save(2, args=ol.LossySave(state))  # the root is free again
    m3.close()
    assert sorted(ol.checkpoint_manager(tmp_path).all_steps()) == [0, 2]


_OTHER_WRITER = r"""
import sys
import jax.numpy as jnp
import orbax.checkpoint as ocp
import orbax_lossy as ol
try:
    with ocp.Checkpointer(ol.LossyCheckpointHandler()) as c:
        c.save(sys.argv[1] + "/7/default", args=ol.LossySave({"x": jnp.zeros(3)}))
    print("SAVED")
except ol.LossyError as e:
    print(type(e).__name__, e)
"""


def test_writer_in_another_process_is_refused(tmp_path) -> None:
    handler = ol.LossyCheckpointHandler()
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(tmp_path / "0" / "default", args=ol.LossySave({"x": jnp.ones(3)}))
        proc = subprocess.run([sys.executable, "-c", _OTHER_WRITER, str(tmp_path)],
                              capture_output=True, text=True, timeout=300, cwd=REPO,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert "RootLockedError" in proc.stdout, proc.stdout + proc.stderr[-2000:]
        assert f"pid {os.getpid()}" in proc.stdout and str(tmp_path) in proc.stdout
    assert not os.path.exists(tmp_path / "7" / "default" / fmt.MANIFEST_NAME)


# ------------------------------------------------------------------ leaf types


@pytest.mark.parametrize("leaf, what", [
    (np.array(["a", "b"]), "dtype <U1"),
    (np.array([object(), 1], dtype=object), "an object array"),
    (1 << 64, "outside the 64-bit range"),
    (-(1 << 63) - 1, "outside the 64-bit range"),
    ("text", "type str"),
    (1 + 2j, "type complex"),
    (np.datetime64("2020-01-01"), "datetime64"),
])
def test_lossysave_refuses_what_the_commit_cannot_write(leaf, what) -> None:
    with pytest.raises(ol.InvalidArgumentError, match=rf"'params/x'.*{what}"):
        ol.LossySave({"params": {"x": leaf, "ok": jnp.zeros(2)}})


def test_restored_leaves_keep_their_types(tmp_path) -> None:
    state = {
        "f32": np.float32(1.5), "i64": np.int64(-7), "u8": np.uint8(200), "b": np.bool_(True),
        "c64": np.complex64(1 + 2j), "pyint": 5, "big": (1 << 64) - 1, "neg": -(1 << 63),
        "pyfloat": 0.25, "pybool": False, "none": None, "nested": {"gone": None, "x": jnp.ones(2)},
        "arr": np.arange(3, dtype=np.int16),
    }
    with ocp.Checkpointer(ol.LossyCheckpointHandler()) as ckptr:
        ckptr.save(tmp_path / "0" / "default", args=ol.LossySave(state))
        for target in (None, state):
            restored = ckptr.restore(tmp_path / "0" / "default",
                                     args=ol.LossyRestore(item=target))
            for key in ("f32", "i64", "u8", "b", "c64", "pyint", "big", "neg", "pyfloat",
                        "pybool", "arr"):
                assert type(restored[key]) is type(state[key]), (target is None, key)
                assert np.asarray(restored[key]).dtype == np.asarray(state[key]).dtype, key
                assert restored[key] == state[key] if np.ndim(state[key]) == 0 else True
            assert restored["none"] is None and restored["nested"]["gone"] is None
            np.testing.assert_array_equal(restored["arr"], state["arr"])
    meta = ol.LossyCheckpointHandler().metadata(tmp_path / "0" / "default")
    assert meta["none"] is None


def test_none_leaves_keep_delta_chains(tmp_path) -> None:
    handler = ol.LossyCheckpointHandler(base_interval=10)
    with ol.checkpoint_manager(tmp_path, handler=handler, max_to_keep=None,
                               enable_async_checkpointing=False) as mngr:
        state = {"params": {"w": jnp.linspace(0, 1, 64)}, "extra": None}
        for step in range(3):
            mngr.save(step, args=ol.LossySave(state))
            state = {"params": {"w": state["params"]["w"] + 0.01}, "extra": None}
        restored = mngr.restore(2)
    assert read_manifest_body(item(tmp_path, 2))["kind"] == "delta"
    assert restored["extra"] is None
