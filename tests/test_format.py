"""Container format: chunk grid, envelopes, checksums, corruption never returns wrong values."""

from __future__ import annotations

import os
import pathlib

import jax.numpy as jnp
import msgpack
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_lossy as ol
from orbax_lossy import format as fmt
from orbax_lossy.format.manifest import read_manifest_body as read_manifest
from orbax_lossy.treepaths import path_str


def test_chunk_grid_depends_only_on_shape_and_dtype() -> None:
    assert fmt.chunk_shape_for((1024, 1024), 4, 1 << 20) == (512, 512)
    assert fmt.chunk_shape_for((10,), 4, 1 << 20) == (10,)
    assert fmt.chunk_shape_for((), 4, 1 << 20) == ()
    assert fmt.chunk_shape_for((0, 7), 4, 1 << 20) == (1, 7)
    chunk = fmt.chunk_shape_for((3, 5000, 7), 2, 4096)
    assert np.prod(chunk) * 2 <= 4096


def test_grid_pieces_tile_a_box_exactly() -> None:
    box = ((3, 17), (0, 9))
    pieces = list(fmt.grid_pieces(box, (4, 4)))
    covered = np.zeros((20, 9), int)
    for p in pieces:
        covered[p[0][0] : p[0][1], p[1][0] : p[1][1]] += 1
        assert p[0][0] // 4 == (p[0][1] - 1) // 4  # inside one grid cell
    assert covered[3:17].min() == 1 and covered.sum() == 14 * 9


def test_envelope_round_trip_and_corruption() -> None:
    data = fmt.pack_envelope("manifest", {"a": [1, 2, 3]})
    assert fmt.unpack_envelope(data, "manifest", "x") == {"a": [1, 2, 3]}
    outer = msgpack.unpackb(data)
    outer["body"] = outer["body"][:-1] + bytes([outer["body"][-1] ^ 1])
    with pytest.raises(ol.ChecksumError, match="x: checksum"):
        fmt.unpack_envelope(msgpack.packb(outer), "manifest", "x")
    with pytest.raises(ol.FormatError):
        fmt.unpack_envelope(data[:-3], "manifest", "x")
    with pytest.raises(ol.FormatError, match="expected a 'index'"):
        fmt.unpack_envelope(data, "index", "x")
    outer = msgpack.unpackb(data)
    outer["version"] = 99
    with pytest.raises(ol.UnsupportedVersionError):
        fmt.unpack_envelope(msgpack.packb(outer), "manifest", "x")


def test_envelope_body_is_compressed_and_version_1_still_reads() -> None:
    body = {"leaves": [{"path": [["a", "params"], ["d", f"Dense_{i}"]], "codec": {"id": "lc"}}
                       for i in range(200)]}
    data = fmt.pack_envelope("manifest", body)
    assert len(data) * 4 < len(msgpack.packb(body))
    assert msgpack.unpackb(data)["encoding"] == "zlib"
    # A version-1 envelope (uncompressed body, no encoding key) still reads.
    plain = msgpack.packb(body)
    v1 = msgpack.packb({"magic": fmt.MAGIC, "kind": "manifest", "version": 1,
                        "crc32": fmt.crc32(plain), "body": plain})
    assert fmt.unpack_envelope(v1, "manifest", "x") == body
    # A compressed body cut short (checksum recomputed: a writer bug, not bit rot) is refused.
    outer = msgpack.unpackb(data)
    outer["body"] = outer["body"][: len(outer["body"]) // 2]
    outer["crc32"] = fmt.crc32(outer["body"])
    with pytest.raises(ol.FormatError, match="x: compressed body"):
        fmt.unpack_envelope(msgpack.packb(outer), "manifest", "x")
    outer["encoding"] = "lz77"
    with pytest.raises(ol.UnsupportedVersionError, match="encoding"):
        fmt.unpack_envelope(msgpack.packb(outer), "manifest", "x")


def _save_two(tmp_path):
    rng = np.random.default_rng(0)
    state = {
        "w": jnp.asarray(rng.standard_normal((64, 64)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal(64), jnp.bfloat16),
        "n": jnp.arange(5),
    }
    handler = ol.LossyCheckpointHandler(ol.LeafPolicy.params_only(), chunk_bytes=4096)
    mngr = ol.checkpoint_manager(tmp_path, handler=handler, max_to_keep=None)
    mngr.save(0, args=ol.LossySave(state))
    mngr.wait_until_finished()
    state2 = dict(state, w=state["w"] + 0.01, n=state["n"] + 1)  # (unchanged: `same`)
    mngr.save(1, args=ol.LossySave(state2))
    mngr.wait_until_finished()
    return mngr, handler


def test_every_piece_is_checksummed_on_read(tmp_path) -> None:
    mngr, _ = _save_two(tmp_path)
    item = os.path.join(tmp_path, "1", "default")
    manifest = read_manifest(item)
    pieces = [p for leaf in manifest["leaves"] for p in leaf["pieces"]]
    assert len(pieces) > 3  # small chunks: several pieces
    path = os.path.join(item, pieces[0]["file"])
    raw = bytearray(pathlib.Path(path).read_bytes())
    raw[pieces[0]["offset"]] ^= 0x40
    pathlib.Path(path).write_bytes(bytes(raw))
    fresh = ol.checkpoint_manager(tmp_path)
    with pytest.raises(ol.ChecksumError, match="checksum mismatch"):
        fresh.restore(1)


def test_corrupted_base_is_detected_through_the_delta(tmp_path) -> None:
    _save_two(tmp_path)
    base = os.path.join(tmp_path, "0", "default", fmt.data_file_name(0))
    raw = bytearray(pathlib.Path(base).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    pathlib.Path(base).write_bytes(bytes(raw))
    with pytest.raises(ol.ChecksumError, match=r"0/default"):
        ol.checkpoint_manager(tmp_path).restore(1)


def test_truncated_payload(tmp_path) -> None:
    _save_two(tmp_path)
    path = os.path.join(tmp_path, "1", "default", fmt.data_file_name(0))
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(ol.TruncatedError):
        ol.checkpoint_manager(tmp_path).restore(1)


def test_corrupted_and_truncated_manifest(tmp_path) -> None:
    _save_two(tmp_path)
    path = os.path.join(tmp_path, "1", "default", fmt.MANIFEST_NAME)
    raw = pathlib.Path(path).read_bytes()
    pathlib.Path(path).write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ol.FormatError, match="manifest.msgpack"):
        ol.checkpoint_manager(tmp_path).restore(1)


def _rewrite_manifest(item: str, mutate) -> None:
    body = read_manifest(item)
    mutate(body)
    fmt.write_envelope(os.path.join(item, fmt.MANIFEST_NAME), "manifest", body)


@pytest.mark.parametrize(
    "mutate, error",
    [
        (lambda b: b["leaves"][0]["pieces"][0].update(length=1 << 40), ol.TruncatedError),
        (lambda b: b["leaves"][0]["pieces"][0].update(offset=-5), ol.FormatError),
        (lambda b: b["leaves"][0].update(shape=[1 << 30, 1 << 30]), ol.FormatError),
        (lambda b: b["leaves"][0]["pieces"][0].update(file="../../etc/passwd"), ol.FormatError),
        (lambda b: b["leaves"][0]["pieces"].pop(), ol.FormatError),
        (lambda b: b["leaves"][0].update(codec={"id": "nope"}), ol.CodecError),
        (lambda b: b["leaves"][0].update(dtype="float1024"), ol.FormatError),
    ],
)
def test_impossible_manifest_entries_raise(tmp_path, mutate, error) -> None:
    """Valid checksums over impossible content: a clear error, no huge allocation."""
    _save_two(tmp_path)
    _rewrite_manifest(os.path.join(tmp_path, "1", "default"), mutate)
    with pytest.raises(error):
        ol.checkpoint_manager(tmp_path).restore(1)


def test_piece_payload_swapped_between_leaves_is_caught(tmp_path) -> None:
    """Checksums are per piece; a manifest pointing at the wrong piece fails size checks."""
    _save_two(tmp_path)
    item = os.path.join(tmp_path, "0", "default")

    def swap(body):
        a, b = body["leaves"][0], body["leaves"][1]
        a["pieces"][0], b["pieces"][0] = b["pieces"][0], a["pieces"][0]

    _rewrite_manifest(item, swap)
    with pytest.raises(ol.FormatError):
        ol.LossyCheckpointHandler().restore(item)


def test_no_pickle_in_the_item_directory(tmp_path) -> None:
    _save_two(tmp_path)
    item = os.path.join(tmp_path, "1", "default")
    assert sorted(os.listdir(item)) == sorted(
        ["commit_success.txt", fmt.MANIFEST_NAME, fmt.data_file_name(0)]
    ) or sorted(os.listdir(item)) == sorted([fmt.MANIFEST_NAME, fmt.data_file_name(0)])
    # the manifest is plain msgpack (no pickle opcodes: protocol 2+ starts with 0x80)
    raw = pathlib.Path(item, fmt.MANIFEST_NAME).read_bytes()
    assert raw[0] != 0x80 and msgpack.unpackb(raw)["magic"] == "orbax-lossy"


def test_manifest_records_format_codecs_and_grid(tmp_path) -> None:
    _save_two(tmp_path)
    base = read_manifest(os.path.join(tmp_path, "0", "default"))
    delta = read_manifest(os.path.join(tmp_path, "1", "default"))
    assert base["kind"] == "base" and base["reference"] is None
    assert delta["kind"] == "delta" and delta["reference"]["step"] == 0
    codecs = {tuple(k for _, k in leaf["path"]): leaf["codec"] for leaf in delta["leaves"]}
    assert codecs[("w",)] == {"id": "lc", "bits": 3, "stats": "leaf", "mode": "delta",
                                "domain": "linear"}
    assert codecs[("n",)] == {"id": "exact"}
    assert all(leaf["codec"]["id"] == "exact" for leaf in base["leaves"])
    w = next(leaf for leaf in delta["leaves"] if leaf["path"] == [["d", "w"]])
    assert w["chunk"] == list(fmt.chunk_shape_for((64, 64), 4, 4096))


def test_bare_checkpointer_round_trip(tmp_path) -> None:
    """The handler also works under a plain (synchronous) ocp.Checkpointer."""
    value = {"x": jnp.linspace(0, 1, 100), "i": jnp.arange(3)}
    handler = ol.LossyCheckpointHandler()
    ckptr = ocp.Checkpointer(handler)
    ckptr.save(tmp_path / "a", args=ol.LossySave(value))
    held = {path_str(p): np.array(v) for p, v in
            zip(handler.reference.paths, handler.reference.values, strict=True)}
    restored = ckptr.restore(tmp_path / "a", args=ol.LossyRestore())
    assert set(restored) == set(value)
    # the handler's reconstruction bit for bit (the default base codes float params lossily)
    np.testing.assert_array_equal(np.asarray(restored["x"]).view(np.uint32),
                                  held["x"].view(np.uint32))
    np.testing.assert_allclose(np.asarray(restored["x"]), np.asarray(value["x"]), atol=1e-2)
    np.testing.assert_array_equal(restored["i"], value["i"])


def test_checkpoint_stats_reads_back_per_leaf_statistics(tmp_path) -> None:
    _save_two(tmp_path)
    rows = {r["path"]: r for r in ol.checkpoint_stats(tmp_path / "1" / "default")}
    assert set(rows) == {"w", "b", "n"}
    w = rows["w"]
    assert w["codec"]["id"] == "lc" and w["role"] == "param"
    assert w["raw_bytes"] == 64 * 64 * 4 and 0 < w["stored_bytes"] < w["raw_bytes"]
    assert w["ratio"] == w["raw_bytes"] / w["stored_bytes"]
    assert 0 < w["rel_error"] < 0.5
    assert rows["n"]["codec"] == {"id": "exact"} and rows["n"]["rel_error"] == 0.0


def test_restore_reads_exact_leaves_from_the_newest_link_only(tmp_path) -> None:
    """Delta leaves need every link since the base; exact leaves only the newest link."""
    rng = np.random.default_rng(1)
    state = {"w": jnp.asarray(rng.standard_normal((128, 64)), jnp.float32),
             "counts": jnp.asarray(rng.integers(0, 1 << 30, (256, 64)), jnp.int32)}
    handler = ol.LossyCheckpointHandler(base_interval=10)
    mngr = ol.checkpoint_manager(tmp_path, handler=handler, max_to_keep=None)
    for step in range(4):
        state = {"w": state["w"] + 0.01, "counts": state["counts"] + 1}
        mngr.save(step, args=ol.LossySave(state))
        mngr.wait_until_finished()

    def leaf_bytes(step: int, name: str) -> int:
        manifest = read_manifest(os.path.join(tmp_path, str(step), "default"))
        leaf = next(x for x in manifest["leaves"] if x["path"] == [["d", name]])
        return sum(p["length"] for p in leaf["pieces"])

    restored = handler.restore(os.path.join(tmp_path, "3", "default"))
    expected = sum(leaf_bytes(s, "w") for s in range(4)) + leaf_bytes(3, "counts")
    assert handler.last_restore_bytes_read == expected
    np.testing.assert_array_equal(np.asarray(restored["counts"]), np.asarray(state["counts"]))


def test_crc32_is_zlibs_checksum():
    """The stored checksums stay zlib's CRC-32 whichever library computes them."""
    import zlib

    rng = np.random.default_rng(3)
    for size in (0, 1, 7, 4096, (1 << 20) + 3):
        data = rng.integers(0, 256, size, dtype=np.uint8)
        assert fmt.crc32(data) == zlib.crc32(data.tobytes()) & 0xFFFFFFFF
        assert fmt.crc32(memoryview(data.tobytes())) == fmt.crc32(data)
