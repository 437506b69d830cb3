"""Format 4: a delta's leaf entries are stored as differences from its chain base's.

What must hold: a delta's manifest reads back as the very entries it was written from; it is
smaller on disk; its header reads without the base; a replaced, rewritten or missing base is a
typed error naming the step, never entries merged with the wrong base; an entry that a
difference cannot express is stored whole.
"""

from __future__ import annotations

import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import orbax_lossy as ol
from orbax_lossy import format as fmt
from orbax_lossy.errors import ChainError, MissingStepError
from orbax_lossy.format import inherit
from orbax_lossy.format.envelope import read_envelope
from orbax_lossy.format.manifest import read_manifest_body, read_manifest_header


def _state(t: int) -> dict:
    rng = np.random.default_rng(t)
    w0 = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    return {
        "params": {f"layer{i}": {"kernel": jnp.asarray(w0 + 0.01 * t * rng.standard_normal(
            w0.shape).astype(np.float32)), "bias": jnp.full((32,), 0.1 * t + i, jnp.float32)}
            for i in range(4)},
        "opt_state": {"mu": jnp.asarray(rng.standard_normal((64, 32)) * 1e-3, jnp.float32),
                      "count": jnp.int32(t)},
        "batch_stats": {"mean": jnp.asarray(rng.standard_normal(32), jnp.float32)},
        "step": t,
    }


def _save(root, steps, base_interval: int = 10) -> list[dict]:
    saved = []
    with ol.checkpoint_manager(root, base_interval=base_interval, max_to_keep=None,
                               enable_async_checkpointing=False) as mngr:
        for t in steps:
            mngr.save(t, args=ol.LossySave(_state(t)))
            mngr.wait_until_finished()
            saved.append(_state(t))
    return saved


def _item(root, step: int) -> str:
    return os.path.join(root, str(step), "default")


def _raw(root, step: int) -> dict:
    return read_envelope(os.path.join(_item(root, step), fmt.MANIFEST_NAME), "manifest")


def test_deltas_inherit_from_their_base_and_read_back_whole(tmp_path) -> None:
    _save(tmp_path, range(4))
    assert inherit.INHERITS_KEY not in _raw(tmp_path, 0)  # a base is whole
    base_id = _raw(tmp_path, 0)["save_id"]
    for step in (1, 2, 3):
        raw = _raw(tmp_path, step)
        link = raw[inherit.INHERITS_KEY]
        assert link["relpath"] == "../../0/default" and link["step"] == 0
        assert link["save_id"] == base_id
        assert all("path" not in e and "stored_bytes" not in e for e in raw["leaves"])
        whole = read_manifest_body(_item(tmp_path, step))
        assert inherit.INHERITS_KEY not in whole
        for e in whole["leaves"]:
            assert e["stored_bytes"] == sum(p["length"] for p in e["pieces"])
        # Written whole, the same manifest is larger, and parses to the same entries.
        whole_dir = tmp_path / f"whole{step}" / "default"
        whole_dir.mkdir(parents=True)
        fmt.write_envelope(whole_dir / fmt.MANIFEST_NAME, "manifest", whole)
        assert (os.path.getsize(whole_dir / fmt.MANIFEST_NAME)
                > 1.2 * os.path.getsize(os.path.join(_item(tmp_path, step), fmt.MANIFEST_NAME)))
        assert fmt.read_manifest(whole_dir) == fmt.read_manifest(_item(tmp_path, step))
    restored = ol.checkpoint_manager(tmp_path).restore(3)
    np.testing.assert_array_equal(np.asarray(restored["opt_state"]["count"]), 3)
    np.testing.assert_array_equal(np.asarray(restored["batch_stats"]["mean"]),
                                  np.asarray(_state(3)["batch_stats"]["mean"]))


def test_a_new_chain_inherits_from_its_own_base(tmp_path) -> None:
    _save(tmp_path, range(6), base_interval=3)  # bases 0 and 3
    assert _raw(tmp_path, 3)["kind"] == "base"
    assert _raw(tmp_path, 5)[inherit.INHERITS_KEY]["relpath"] == "../../3/default"
    assert _raw(tmp_path, 2)[inherit.INHERITS_KEY]["relpath"] == "../../0/default"


def test_the_header_reads_without_the_base(tmp_path) -> None:
    _save(tmp_path, range(3))
    shutil.rmtree(tmp_path / "0")
    header = read_manifest_header(_item(tmp_path, 2))
    assert header.step == 2 and header.depends_on == (1,)
    with pytest.raises(MissingStepError, match="step 0") as e:
        fmt.read_manifest(_item(tmp_path, 2))
    assert e.value.step == 0


def test_a_rewritten_base_is_refused_not_merged(tmp_path) -> None:
    _save(tmp_path, range(3))
    fmt.read_manifest(_item(tmp_path, 2))  # the base, read once, is kept for the next reads
    body = read_envelope(os.path.join(_item(tmp_path, 0), fmt.MANIFEST_NAME), "manifest")
    body["leaves"][0]["rel_error"] = 0.5  # any change of the base's bytes
    fmt.write_envelope(os.path.join(_item(tmp_path, 0), fmt.MANIFEST_NAME), "manifest", body)
    with pytest.raises(ChainError, match="step 0.*changed"):
        fmt.read_manifest(_item(tmp_path, 2))


def test_a_replaced_base_is_refused(tmp_path) -> None:
    _save(tmp_path / "a", range(2))
    _save(tmp_path / "b", [0])  # another save of step 0, same values, another save id
    fmt.read_manifest(_item(tmp_path / "a", 1))  # parsed and kept before the replacement
    shutil.rmtree(tmp_path / "a" / "0")
    shutil.copytree(tmp_path / "b" / "0", tmp_path / "a" / "0")
    with pytest.raises(ChainError, match="changed"):
        fmt.read_manifest(_item(tmp_path / "a", 1))


def test_a_base_link_cannot_leave_the_root(tmp_path) -> None:
    _save(tmp_path / "root", range(2))
    raw = _raw(tmp_path / "root", 1)
    raw[inherit.INHERITS_KEY]["relpath"] = "../../../elsewhere/0/default"
    fmt.write_envelope(os.path.join(_item(tmp_path / "root", 1), fmt.MANIFEST_NAME),
                       "manifest", raw)
    with pytest.raises(ChainError, match="leaves the checkpoint root"):
        fmt.read_manifest(_item(tmp_path / "root", 1))


def test_a_difference_past_the_base_is_refused(tmp_path) -> None:
    _save(tmp_path, range(2))
    raw = _raw(tmp_path, 1)
    raw["leaves"].append({"rel_error": 0.0})
    fmt.write_envelope(os.path.join(_item(tmp_path, 1), fmt.MANIFEST_NAME), "manifest", raw)
    with pytest.raises(ChainError, match="does not have"):
        fmt.read_manifest(_item(tmp_path, 1))


def test_entries_a_difference_cannot_express_are_stored_whole() -> None:
    base = [
        {"path": [["d", "a"]], "kind": "device", "sharding": "s", "pieces": [{"o": 1, "c": 2}]},
        {"path": [["d", "b"]], "kind": "device", "pieces": [{"o": 3}]},
        {"path": [["d", "c"]], "kind": "device", "pieces": []},
    ]
    leaves = [
        {"path": [["d", "a"]], "kind": "device", "pieces": [{"o": 5, "c": 2}]},  # lost a key
        {"path": [["d", "x"]], "kind": "device", "pieces": [{"o": 3}]},  # another path
        {"path": [["d", "c"]], "kind": "numpy", "pieces": [{"o": 9, "c": 1}]},  # a difference
        {"path": [["d", "d"]], "kind": "device"},  # past the base
    ]
    packed = inherit.compact(leaves, base)
    assert packed[:2] == leaves[:2] and packed[3] == leaves[3]
    assert packed[2] == {"kind": "numpy", "pieces": [{"o": 9, "c": 1}]}
    assert inherit.expand(packed, base, "x") == leaves
    # A piece list of the base's length is differenced piece by piece.
    diff = inherit.difference({"path": 1, "pieces": [{"o": 7, "c": 2}]},
                              {"path": 1, "pieces": [{"o": 1, "c": 2}]})
    assert diff == {"pieces": [{"o": 7}]}


def test_training_continues_on_a_format_3_chain(tmp_path) -> None:
    """A run resumed with this version on a format-3 checkpoint: the next delta references
    a format-3 delta, which names no base, so it is written whole; the next chain's deltas
    inherit again. Every step restores."""
    fixtures = os.path.join(os.path.dirname(__file__), "fixtures", "v3", "ckpt")
    shutil.copytree(fixtures, tmp_path / "ckpt")
    root = tmp_path / "ckpt"
    with ol.checkpoint_manager(root, base_interval=10, max_to_keep=None,
                               enable_async_checkpointing=False) as mngr:
        state = mngr.restore(2)
        mngr.save(3, args=ol.LossySave(state))
        mngr.wait_until_finished()
        mngr.save(4, args=ol.LossySave(state, force_base=True))
        mngr.wait_until_finished()
        mngr.save(5, args=ol.LossySave(state))
        mngr.wait_until_finished()
    assert _raw(root, 3)["kind"] == "delta" and inherit.INHERITS_KEY not in _raw(root, 3)
    assert _raw(root, 5)[inherit.INHERITS_KEY]["step"] == 4
    fresh = ol.checkpoint_manager(root, max_to_keep=None)
    want = np.asarray(state["params"]["dense"]["kernel"])
    for step in (3, 5):  # lossy saves of the same state: within the codecs' error
        got = np.asarray(fresh.restore(step)["params"]["dense"]["kernel"])
        assert np.linalg.norm(got - want) <= 0.05 * np.linalg.norm(want), step
        assert np.asarray(fresh.restore(step)["step"]) == np.asarray(state["step"])
    fresh.close()


def _same_entries(fast, full) -> None:
    assert fast.header == full.header
    assert len(fast.leaves) == len(full.leaves)
    for a, b in zip(fast.leaves, full.leaves, strict=True):
        for name in ("path", "storage", "shape", "dtype", "key_impl", "codec_config", "chunk",
                     "role", "rel_error", "pieces", "sharding"):
            assert getattr(a, name) == getattr(b, name), (a.name, name)
        assert a.codec == b.codec and set(a.side) == set(b.side), a.name
        for k in a.side:
            assert a.side[k].dtype == b.side[k].dtype, (a.name, k)
            np.testing.assert_array_equal(a.side[k], b.side[k])


@pytest.mark.parametrize("policy", [None, "lc"])
def test_differences_parse_as_their_merged_entries(tmp_path, policy) -> None:
    """``read_manifest`` builds a delta's entries from the base's parsed entries, parsing only
    what the delta stores (``LeafEntry.parse_difference``); the result is exactly the merged
    entries parsed whole, for every delta of a chain."""
    pol = ol.LeafPolicy.create(defaults={"param": ol.LC(3), "first_moment": ol.LC(3)}) \
        if policy else None
    kwargs = {"policy": pol} if pol else {}
    with ol.checkpoint_manager(tmp_path, max_to_keep=None, enable_async_checkpointing=False,
                               **kwargs) as mngr:
        for t in range(5):
            mngr.save(t, args=ol.LossySave(_state(t)))
    for step in range(1, 5):
        assert inherit.INHERITS_KEY in _raw(tmp_path, step)
        item = _item(tmp_path, step)
        full = fmt.Manifest.parse(read_manifest_body(item),
                                  os.path.join(item, fmt.MANIFEST_NAME))
        _same_entries(fmt.read_manifest(item), full)


def _mutations() -> list:
    def piece(key, value):
        def mutate(entry):
            entry["pieces"] = [dict(p) for p in entry["pieces"]]
            entry["pieces"][0][key] = value
        return mutate

    def put(key, value):
        def mutate(entry):
            entry[key] = value
        return mutate

    return [
        ("offset a string", piece("offset", "12")), ("negative length", piece("length", -1)),
        ("crc a bool", piece("crc32", True)), ("another field", piece("field", "nope")),
        ("another box", piece("box", [[0, 1], [0, 1]])), ("another file", piece("file", "x")),
        ("pieces not a list", put("pieces", {"a": 1})), ("no pieces", put("pieces", [])),
        ("rel_error a string", put("rel_error", "0.1")),
        ("rel_error a bool", put("rel_error", True)),
        ("codec unknown", put("codec", {"id": "no-such-codec"})),
        ("codec bad value", put("codec", {"id": "lc", "bits": "3"})),
        ("codec not a map", put("codec", [1])),
        ("side of a wrong size", put("side", {"rep": {"dtype": "float32", "shape": [9],
                                                      "data": b"\0" * 8}})),
        ("side not a map", put("side", 3)),
        ("another role", put("role", "state")), ("another shape", put("shape", [3])),
        ("a key that no entry has", put("extra", 1)),
    ]


@pytest.mark.parametrize("label,mutate", _mutations(), ids=[m[0] for m in _mutations()])
def test_a_damaged_difference_fails_as_its_merged_entry_does(tmp_path, label, mutate) -> None:
    """A difference with a bad or unexpected value is refused (or accepted) exactly as the
    merged entry parsed whole is: same exception type, or the same entries."""
    from orbax_lossy.format.envelope import write_envelope

    _save(tmp_path, range(3))
    item = _item(tmp_path, 2)
    path = os.path.join(item, fmt.MANIFEST_NAME)
    body = _raw(tmp_path, 2)
    target = next(i for i, e in enumerate(body["leaves"])
                  if "path" not in e and "pieces" in e and "codec" in e)
    mutate(body["leaves"][target])
    write_envelope(path, "manifest", body)

    def outcome(read):
        try:
            return read()
        except Exception as e:  # noqa: BLE001 - compared by type
            return type(e)

    fast = outcome(lambda: fmt.read_manifest(item))
    full = outcome(lambda: fmt.Manifest.parse(read_manifest_body(item), path))
    if isinstance(full, type):
        assert fast is full, (label, fast, full)
        assert issubclass(full, ol.LossyError), (label, full)
    else:
        _same_entries(fast, full)


def test_a_manifest_parses_once_per_content_and_its_base_is_checked_each_read(tmp_path):
    """``read_manifest`` keeps what it parsed by path and content: the same bytes give the
    same (immutable) manifest, rewritten bytes are parsed again, and a kept delta's base is
    checked at every read (a deleted base is a typed error naming its step)."""
    from orbax_lossy.format.envelope import write_envelope

    _save(tmp_path, range(3))
    item = _item(tmp_path, 2)
    first = fmt.read_manifest(item)
    assert fmt.read_manifest(item) is first
    body = _raw(tmp_path, 2)
    target = next(i for i, e in enumerate(body["leaves"]) if "rel_error" in e)
    body["leaves"][target]["rel_error"] = 0.25
    write_envelope(os.path.join(item, fmt.MANIFEST_NAME), "manifest", body)
    again = fmt.read_manifest(item)
    assert again is not first and again.leaves[target].rel_error == 0.25
    shutil.rmtree(tmp_path / "0")
    with pytest.raises(MissingStepError) as e:
        fmt.read_manifest(item)
    assert e.value.step == 0
