"""Fuzzing the checkpoint directory: a restore returns what was saved, or a LossyError.

Each trial copies a pristine base + 3-delta chain, damages it once and restores its newest
step (in a worker thread, with a timeout). Damage kinds:

- ``raw``: bit flips, truncation, appended garbage, zeroed or random ranges, deleted or
  emptied files, of a manifest or a payload file of any step;
- ``manifest``: one value of a manifest body changed (type, key, range, another slot's
  value, list order) with the checksum recomputed (``format.envelope.pack_envelope``);
- ``link``: swapped item or step directories, references repointed to another step;
- ``bomb``: a zlib bomb, a body of empty containers, a claim of 2**40 elements;
- ``forged`` (relaxed): payload or side-array bytes altered *with* their checksum
  recomputed. A checksum cannot see this (docs/format.md), so the values may differ; the
  restore must still end in values or a LossyError, never an untyped exception or a hang.

Every other trial must return values bit-identical to the pristine restore (itself checked
against the handler's reference at save time), or raise a LossyError subclass.

Seeded and bounded: ``ORBAX_LOSSY_FUZZ_TRIALS`` (default 400) trials within
``ORBAX_LOSSY_FUZZ_SECONDS`` (default 50) seconds, seed ``ORBAX_LOSSY_FUZZ_SEED`` (default 0).
Run more with e.g. ``ORBAX_LOSSY_FUZZ_TRIALS=5000 ORBAX_LOSSY_FUZZ_SECONDS=3600``.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import pathlib
import random
import shutil
import threading
import time
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest

import orbax_lossy as ol
from orbax_lossy import format as fmt
from orbax_lossy.format.manifest import read_manifest_body
from orbax_lossy.treepaths import flatten, path_str

TRIALS = int(os.environ.get("ORBAX_LOSSY_FUZZ_TRIALS", "400"))
SECONDS = float(os.environ.get("ORBAX_LOSSY_FUZZ_SECONDS", "50"))
SEED = int(os.environ.get("ORBAX_LOSSY_FUZZ_SEED", "0"))
TRIAL_TIMEOUT = 60.0
STEPS = 4


def _bits(x) -> np.ndarray:
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    a = np.ascontiguousarray(np.asarray(x))
    return a if a.dtype.kind in "biu" else a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _state(t: int) -> dict:
    rng = np.random.default_rng(t)
    w = np.linspace(-1, 1, 48 * 40).reshape(48, 40) + 0.01 * t * rng.standard_normal((48, 40))
    return {
        "params": {
            "w": jnp.asarray(w, jnp.float32),
            "h": jnp.asarray(np.linspace(0, 2, 40) + 0.02 * t, jnp.bfloat16),
        },
        "opt": {"mu": jnp.asarray(0.01 * rng.standard_normal((48, 40)), jnp.float32),
                "count": jnp.int32(t)},
        "rng": jax.random.key(t),
        "host": np.linspace(0.0, 1.0, 5) * (t + 1),
        "lr": np.float32(0.1 * (t + 1)),
        "count": 3 + t,
        "nothing": None,
    }


def _signature(tree) -> dict[str, tuple]:
    paths, leaves, _ = flatten(tree, keep_none=True)
    return {path_str(p): (type(v).__name__, None if v is None else _bits(v))
            for p, v in zip(paths, leaves, strict=True)}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[pathlib.Path, dict]:
    """A base and three deltas, and the signature of the newest step's exact restore."""
    root = tmp_path_factory.mktemp("fuzz") / "pristine"
    handler = ol.LossyCheckpointHandler(base_interval=10, chunk_bytes=1024)
    with ol.checkpoint_manager(root, handler=handler, max_to_keep=None,
                               enable_async_checkpointing=False) as mngr:
        for step in range(STEPS):
            mngr.save(step, args=ol.LossySave(_state(step)))
            mngr.wait_until_finished()
        ref = handler.reference
        recon = {path_str(p): v for p, v in zip(ref.paths, ref.values, strict=True)}
    os.remove(root / ".orbax-lossy.lock")
    tree = ol.LossyCheckpointHandler().restore(_item(root, STEPS - 1))
    expected = _signature(tree)
    saved = _signature(_state(STEPS - 1))
    for name, (kind, bits) in expected.items():  # the pristine restore is the saved recon
        want = saved[name][1] if recon.get(name) is None else _bits(recon[name])
        assert kind == saved[name][0], name
        if bits is not None:
            np.testing.assert_array_equal(bits, want, err_msg=name)
    assert read_manifest_body(_item(root, STEPS - 1))["kind"] == "delta"
    return root, expected, tree


def _item(root, step: int) -> str:
    return os.path.join(root, str(step), "default")


# ------------------------------------------------------------------ damage


def _files(root) -> list[str]:
    out = []
    for step in range(STEPS):
        for name in (fmt.MANIFEST_NAME, fmt.data_file_name(0)):
            path = os.path.join(_item(root, step), name)
            if os.path.exists(path):
                out.append(path)
    return out


def raw_damage(rng: random.Random, root) -> str:
    path = rng.choice(_files(root))
    data = bytearray(pathlib.Path(path).read_bytes())
    op = rng.choice(["flip", "flip", "truncate", "append", "zero", "random", "delete", "empty"])
    if op == "flip" and data:
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif op == "truncate":
        data = data[: rng.randrange(len(data) + 1)]
    elif op == "append":
        data += rng.randbytes(rng.randint(1, 64))
    elif op in ("zero", "random") and data:
        a = rng.randrange(len(data))
        b = min(len(data), a + rng.randint(1, 64))
        data[a:b] = bytes(b - a) if op == "zero" else rng.randbytes(b - a)
    elif op == "delete":
        os.remove(path)
        return f"raw delete {path}"
    else:
        data = bytearray()
    pathlib.Path(path).write_bytes(bytes(data))
    return f"raw {op} {path}"


def _slots(node: Any, trail: tuple = ()) -> list[tuple]:
    """Every (container, key, trail) in a manifest body."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for k, v in items:
        out.append((node, k, (*trail, k)))
        if isinstance(v, dict | list):
            out.extend(_slots(v, (*trail, k)))
    return out


_VALUES = [None, True, False, 0, 1, -1, 2, 255, 1 << 31, (1 << 63) - 1, -(1 << 63),
           (1 << 64) - 1, 1 << 40, 0.5, -0.0, float("nan"), float("inf"), 1e308, "", "x",
           "float32", "bfloat16", "delta", "base", "device", "../../0/default", "data.p1.bin",
           b"", b"\x00" * 8, [], [0], [1, 2], [[0, 1]], {}, {"id": "exact"}, {"x": 1}]


def manifest_mutation(rng: random.Random, root) -> tuple[str, bool]:
    """One value of one manifest changed, checksum recomputed; (description, strict)."""
    step = rng.randrange(STEPS)
    item = _item(root, step)
    body = read_manifest_body(item)
    slots = _slots(body)
    node, key, trail = rng.choice(slots)
    old = node[key]
    op = rng.choice(["delete", "value", "value", "other", "int", "int", "list"])
    if op == "delete":
        del node[key]
    elif op == "int" and isinstance(old, int) and not isinstance(old, bool):
        node[key] = rng.choice([old + 1, old - 1, old * 2, -old, old ^ (1 << rng.randrange(40)),
                                0, old + (1 << 32)])
    elif op == "list" and isinstance(old, list) and old:
        if rng.random() < 0.5 and len(old) > 1:
            i, j = rng.sample(range(len(old)), 2)
            old[i], old[j] = old[j], old[i]
        elif rng.random() < 0.5:
            old.append(copy.deepcopy(rng.choice(old)))
        else:
            old.pop(rng.randrange(len(old)))
    elif op == "other":
        node[key] = copy.deepcopy(_value_of(rng.choice(slots)))
    else:
        node[key] = copy.deepcopy(rng.choice(_VALUES))
    # Side-array contents are values a checksum cannot vouch for (docs/format.md): a change
    # inside a "side" map, or a whole "side" map replaced, is a relaxed trial.
    strict = "side" not in trail and not (op == "other" and key == "side")
    fmt.write_envelope(os.path.join(item, fmt.MANIFEST_NAME), "manifest", body)
    new = _value_of((node, key, trail)) if op != "delete" else "<removed>"
    return f"manifest step {step} {op} at {trail!r}: {str(old)[:60]} -> {str(new)[:60]}", strict


def _value_of(slot: tuple) -> Any:
    node, key, _ = slot
    try:
        return node[key]
    except (KeyError, IndexError):
        return None


def link_damage(rng: random.Random, root) -> str:
    op = rng.choice(["swap_items", "swap_steps", "repoint", "repoint_step", "delete_step"])
    a, b = rng.sample(range(STEPS), 2)
    if op == "swap_items":
        tmp = os.path.join(root, "tmp_item")
        os.rename(_item(root, a), tmp)
        os.rename(_item(root, b), _item(root, a))
        os.rename(tmp, _item(root, b))
    elif op == "swap_steps":
        tmp = os.path.join(root, "tmp_step")
        os.rename(os.path.join(root, str(a)), tmp)
        os.rename(os.path.join(root, str(b)), os.path.join(root, str(a)))
        os.rename(tmp, os.path.join(root, str(b)))
    elif op.startswith("repoint"):
        src = rng.randrange(1, STEPS)
        dst = rng.choice([s for s in range(STEPS) if s != src - 1])
        item = _item(root, src)
        body = read_manifest_body(item)
        body["reference"]["relpath"] = f"../../{dst}/default"
        if op == "repoint_step":
            body["reference"]["step"] = dst
        fmt.write_envelope(os.path.join(item, fmt.MANIFEST_NAME), "manifest", body)
        return f"link {op} {src} -> {dst}"
    else:
        shutil.rmtree(os.path.join(root, str(rng.randrange(STEPS - 1))))
    return f"link {op} {a} {b}"


@functools.cache
def _bomb_body(kind: str) -> bytes:
    """The compressed body of a zlib bomb (the same bytes every time: built once)."""
    if kind == "zlib":
        z = zlib.compressobj(9)
        size = 64 << 20
        raw = z.compress(b"\x81\xa6leaves\xdb" + size.to_bytes(4, "big"))
        for _ in range(64):
            raw += z.compress(bytes(1 << 20))
        return raw + z.flush()
    n = 4 << 20
    return zlib.compress(b"\x81\xa6leaves\xdd" + n.to_bytes(4, "big") + b"\x90" * n, 9)


def bomb(rng: random.Random, root) -> str:
    step = rng.randrange(STEPS)
    item = _item(root, step)
    kind = rng.choice(["zlib", "containers", "elements"])
    if kind == "elements":
        body = read_manifest_body(item)
        body["chunk_bytes"] = 1 << 30
        leaf = next(x for x in body["leaves"] if x["codec"]["id"] == "exact"
                    and x["kind"] == "device" and x["shape"])
        shape = (1 << 20, 1 << 20)
        chunk = fmt.chunk_shape_for(shape, np.dtype(leaf["dtype"]).itemsize, 1 << 30)
        piece = leaf["pieces"][0]
        leaf.update(shape=list(shape), chunk=list(chunk), pieces=[
            dict(piece, box=[list(b) for b in box])
            for box in fmt.grid_pieces(fmt.full_box(shape), chunk)])
        fmt.write_envelope(os.path.join(item, fmt.MANIFEST_NAME), "manifest", body)
        return f"bomb elements step {step}"
    raw = _bomb_body(kind)
    env = msgpack.packb({"magic": fmt.MAGIC, "kind": "manifest", "version": 2,
                         "crc32": fmt.crc32(raw), "encoding": "zlib", "body": raw})
    pathlib.Path(item, fmt.MANIFEST_NAME).write_bytes(env)
    return f"bomb {kind} step {step}"


def forged(rng: random.Random, root) -> str:
    """Payload or side bytes changed with the checksum recomputed (relaxed)."""
    step = rng.randrange(STEPS)
    item = _item(root, step)
    body = read_manifest_body(item)
    leaf = rng.choice(body["leaves"])
    if leaf["side"] and rng.random() < 0.3:
        side = leaf["side"][rng.choice(sorted(leaf["side"]))]
        data = bytearray(side["data"])
        if data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        side["data"] = bytes(data)
        where = "side"
    elif leaf["pieces"]:
        piece = rng.choice(leaf["pieces"])
        path = os.path.join(item, piece["file"])
        blob = bytearray(pathlib.Path(path).read_bytes())
        start, length = piece["offset"], piece["length"]
        chunk = bytearray(blob[start:start + length])
        op = rng.choice(["flip", "cut", "grow"])
        if op == "flip" and chunk:
            for _ in range(rng.randint(1, 4)):
                chunk[rng.randrange(len(chunk))] ^= 1 << rng.randrange(8)
        elif op == "cut" and chunk:
            chunk = chunk[: rng.randrange(len(chunk))]
        else:
            chunk += rng.randbytes(rng.randint(1, 16))
        piece.update(offset=len(blob), length=len(chunk), crc32=fmt.crc32(bytes(chunk)))
        pathlib.Path(path).write_bytes(bytes(blob + chunk))
        where = f"payload {op}"
    else:
        return "forged nothing"
    fmt.write_envelope(os.path.join(item, fmt.MANIFEST_NAME), "manifest", body)
    return f"forged {where} step {step} leaf {leaf['path']}"


# ------------------------------------------------------------------ trials


def _snapshot(root: pathlib.Path) -> tuple[set[str], dict[str, bytes]]:
    """The relative directory names and file contents under ``root``."""
    dirs, files = set(), {}
    for dirpath, _, filenames in os.walk(root):
        rel = os.path.normpath(os.path.relpath(dirpath, root))
        dirs.add(rel)
        for name in filenames:
            files[os.path.normpath(os.path.join(rel, name))] = pathlib.Path(
                dirpath, name).read_bytes()
    return dirs, files


def _reset(work: pathlib.Path, dirs: set[str], files: dict[str, bytes]) -> None:
    """Make ``work`` a byte-identical copy of the pristine tree (``_snapshot``) again,
    rewriting only what a trial changed: same directories, same files, same bytes. (A fresh
    copytree and rmtree per trial cost ~25 ms of directory creation and removal each on
    some filesystems, a third of the test.)"""
    for dirpath, dirnames, filenames in os.walk(work, topdown=False):
        rel = os.path.relpath(dirpath, work)
        for name in filenames:
            if os.path.normpath(os.path.join(rel, name)) not in files:
                os.remove(os.path.join(dirpath, name))
        for name in dirnames:
            if os.path.normpath(os.path.join(rel, name)) not in dirs:
                shutil.rmtree(os.path.join(dirpath, name))
    for rel in sorted(dirs):
        os.makedirs(work / rel, exist_ok=True)
    for rel, data in files.items():
        path = work / rel
        if not path.is_file() or path.read_bytes() != data:
            path.write_bytes(data)


def _restore(path: str, target: Any = None) -> Any:
    box: list = []

    def run() -> None:
        try:
            args = ol.LossyRestore(item=target)
            box.append(("ok", ol.LossyCheckpointHandler().restore(path, args)))
        except BaseException as e:  # noqa: BLE001 - judged by the caller
            box.append(("error", e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(TRIAL_TIMEOUT)
    if t.is_alive():
        return ("hang", None)
    return box[0]


def _judge(outcome, expected: dict, strict: bool) -> str | None:
    """None if acceptable, else what went wrong."""
    status, value = outcome
    if status == "hang":
        return f"no result after {TRIAL_TIMEOUT} s"
    if status == "error":
        if isinstance(value, ol.LossyError):
            return None
        return f"untyped {type(value).__name__}: {str(value)[:300]}"
    if not strict:
        return None
    got = _signature(value)
    if set(got) != set(expected):
        return f"leaves {sorted(set(got) ^ set(expected))} differ"
    for name, (kind, bits) in expected.items():
        gkind, gbits = got[name]
        if gkind != kind:
            return f"{name}: type {gkind}, saved {kind}"
        if bits is None:
            if gbits is not None:
                return f"{name}: not None"
            continue
        if gbits.dtype != bits.dtype or gbits.shape != bits.shape or not np.array_equal(
                gbits, bits):
            return f"{name}: WRONG VALUES"
    return None


KINDS = [("raw", 3), ("manifest", 5), ("link", 2), ("forged", 2), ("bomb", 1)]


def test_fuzz_restore_returns_saved_values_or_a_lossy_error(pristine, tmp_path) -> None:
    root, expected, target = pristine
    rng = random.Random(SEED)
    weights = [w for _, w in KINDS]
    failures, counts = [], {}
    deadline = time.monotonic() + SECONDS
    trials = 0
    dirs, files = _snapshot(root)
    work = tmp_path / "work"
    for trial in range(TRIALS):
        if time.monotonic() > deadline:
            break
        kind = rng.choices([k for k, _ in KINDS], weights)[0]
        if trial < len(KINDS):  # every kind at least once
            kind = KINDS[trial][0]
        _reset(work, dirs, files)  # every trial damages a fresh copy of the pristine chain
        strict = kind != "forged"
        if kind == "raw":
            what = raw_damage(rng, work)
        elif kind == "manifest":
            what, strict = manifest_mutation(rng, work)
        elif kind == "link":
            what = link_damage(rng, work)
        elif kind == "bomb":
            what = bomb(rng, work)
        else:
            what = forged(rng, work)
        with_target = rng.random() < 0.3  # also the path through target matching
        outcome = _restore(_item(work, STEPS - 1), target if with_target else None)
        problem = _judge(outcome, expected, strict)
        status = outcome[0] if outcome[0] != "error" else type(outcome[1]).__name__
        counts[(kind, status)] = counts.get((kind, status), 0) + 1
        if problem:
            failures.append(f"trial {trial} (seed {SEED}) {what}"
                            f"{' (with target)' if with_target else ''}: {problem}")
        trials += 1
    summary = ", ".join(f"{k}/{s}: {n}" for (k, s), n in sorted(counts.items()))
    print(f"{trials} trials: {summary}")
    assert trials >= min(TRIALS, 40), f"only {trials} trials ran in {SECONDS} s"
    assert not failures, f"{len(failures)} of {trials} trials failed:\n" + "\n".join(
        failures[:30])
    assert math.isfinite(SECONDS)
