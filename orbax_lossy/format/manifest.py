"""The typed manifest: one parse, one validation, one home for every structural check.

A committed item directory holds ``manifest.msgpack`` (an envelope of file type
``"manifest"``): a header (step, base or delta, the reference link, writer settings) and a
leaf table (path, storage, shape, dtype, codec, chunk grid, side arrays, pieces). The on-disk
keys are documented in ``docs/format.md``; this module turns them into dataclasses and
rejects anything a writer cannot have produced with a :class:`~orbax_lossy.FormatError`
naming the file and the leaf.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import threading
from functools import cached_property
from typing import Any

import numpy as np

from orbax_lossy.codecs.base import Codec, codec_from_config
from orbax_lossy.errors import ChainError, FormatError, LossyError
from orbax_lossy.format import inherit
from orbax_lossy.format.envelope import (
    crc32,
    read_envelope,
    read_envelope_bytes,
    unpack_body,
    write_envelope,
)
from orbax_lossy.format.grid import box_inside, chunk_shape_for, intersect, within_one_chunk
from orbax_lossy.format.payload import PieceRef
from orbax_lossy.format.schema import (
    MANIFEST_NAME,
    MAX_CHUNK_BYTES,
    MAX_LEAVES,
    MAX_SIDE_ARRAYS,
    MAX_SIDE_BYTES,
    dtype_of,
    empty_nodes_of,
    fail,
    get,
    path_of,
    shape_of,
    sharding_string,
    steps_of,
)
from orbax_lossy.format.steps import is_remote
from orbax_lossy.treepaths import StoredPath, path_str

#: raw bytes per chunk-grid cell that saves use by default: each cell is one piece per field,
#: read, checksummed and decoded as a unit (a 256 MB 9-delta restore: 0.69-0.75 s with 4 MiB
#: cells, 0.53-0.57 s with 16 MiB; same bytes, same commit time)
DEFAULT_CHUNK_BYTES = 16 << 20
#: the cell size of manifests that do not record one (written before chunk_bytes was stored)
LEGACY_CHUNK_BYTES = 4 << 20
# How a leaf is held and restored: a jax.Array, a numpy array, a numpy scalar ("scalar"),
# a Python scalar, or None ("none": an empty uint8 array without payload).
STORAGES = ("device", "numpy", "scalar", "int", "float", "bool", "none")
HOST_STORAGES = ("numpy", "scalar", "int", "float", "bool", "none")
SAVE_TYPES = ("base", "delta")
# Limits no writer reaches; a manifest past them is damaged or hostile.
@dataclasses.dataclass(frozen=True)
class ReferenceLink:
    """The step a delta checkpoint was encoded against."""

    relpath: str
    step: int | None
    save_id: str | None = None  # the referenced manifest's save id (None before it existed)

    def to_msgpack(self) -> dict[str, Any]:
        """On-disk form."""
        out: dict[str, Any] = {"relpath": self.relpath, "step": self.step}
        if self.save_id is not None:
            out["save_id"] = self.save_id
        return out

    @classmethod
    def parse(cls, d: Any, where: str) -> ReferenceLink:
        """Validate the on-disk form."""
        return cls(
            relpath=get(d, "relpath", str, where),
            step=get(d, "step", int, where, None),
            save_id=get(d, "save_id", str, where, None),
        )


@dataclasses.dataclass(frozen=True)
class Header:
    """Everything a manifest says about the save as a whole."""

    step: int | None
    save_type: str  # "base" or "delta"
    chain_length: int
    base_interval: int
    reference: ReferenceLink | None
    chunk_bytes: int
    process_count: int
    primary_host: int
    programs: str  # "tree" (one program for all leaves) or "per_leaf"
    writer: str = "orbax-lossy"
    save_id: str | None = None
    extra_dependencies: tuple[int, ...] = ()  # steps read besides the reference (PEC)
    empty_nodes: tuple[tuple[StoredPath, str], ...] = ()  # empty containers of the saved tree

    @property
    def is_base(self) -> bool:
        """A base is encoded against no other step."""
        return self.save_type == "base"

    @property
    def depends_on(self) -> tuple[int, ...]:
        """Every step a restore of this one reads (its reference, then any extra steps)."""
        ref = () if self.reference is None or self.reference.step is None else (
            self.reference.step,)
        return ref + tuple(s for s in self.extra_dependencies if s not in ref)

    def to_msgpack(self) -> dict[str, Any]:
        """On-disk form (the keys of format version 1 and 2)."""
        out: dict[str, Any] = {
            "step": self.step,
            "kind": self.save_type,
            "chain_length": self.chain_length,
            "base_interval": self.base_interval,
            "reference": None if self.reference is None else self.reference.to_msgpack(),
            "chunk_bytes": self.chunk_bytes,
            "process_count": self.process_count,
            "primary_host": self.primary_host,
            "programs": self.programs,
            "writer": self.writer,
        }
        if self.save_id is not None:
            out["save_id"] = self.save_id
        if self.extra_dependencies:
            out["extra_dependencies"] = list(self.extra_dependencies)
        if self.empty_nodes:
            out["empty_nodes"] = [[[list(e) for e in path], container]
                                  for path, container in self.empty_nodes]
        return out

    @classmethod
    def parse(cls, d: Any, where: str) -> Header:
        """Validate the on-disk form."""
        save_type = get(d, "kind", str, where)
        if save_type not in SAVE_TYPES:
            raise fail(where, f"save type {save_type!r} is neither base nor delta")
        ref = get(d, "reference", dict, where, None)
        reference = None if ref is None else ReferenceLink.parse(ref, f"{where} (reference)")
        if save_type == "delta" and reference is None:
            raise fail(where, "a delta checkpoint has no reference")
        header = cls(
            step=get(d, "step", int, where, None),
            save_type=save_type,
            chain_length=get(d, "chain_length", int, where, 0),
            base_interval=get(d, "base_interval", int, where, 1),
            reference=reference if save_type == "delta" else None,
            chunk_bytes=get(d, "chunk_bytes", int, where, LEGACY_CHUNK_BYTES),
            process_count=get(d, "process_count", int, where, 1),
            primary_host=get(d, "primary_host", int, where, 0),
            programs=get(d, "programs", str, where, "tree"),
            writer=get(d, "writer", str, where, "orbax-lossy"),
            save_id=get(d, "save_id", str, where, None),
            extra_dependencies=steps_of(get(d, "extra_dependencies", list, where, []), where),
            empty_nodes=empty_nodes_of(get(d, "empty_nodes", list, where, []), where),
        )
        if (header.chain_length < 0 or header.process_count < 1 or header.chunk_bytes < 1
                or header.base_interval < 1 or header.primary_host < 0
                or (header.step is not None and header.step < 0)
                or (header.save_type == "delta") != (header.chain_length > 0)):
            raise fail(where, "header has an out-of-range value")
        if header.programs not in ("tree", "per_leaf"):
            raise fail(where, f"unknown program layout {header.programs!r}")
        return header


@dataclasses.dataclass(frozen=True)
class LeafEntry:
    """One leaf of the leaf table."""

    path: StoredPath
    storage: str  # one of STORAGES
    shape: tuple[int, ...]
    dtype: np.dtype
    key_impl: str | None
    codec_config: dict[str, Any]
    chunk: tuple[int, ...]
    side: dict[str, np.ndarray]
    role: str | None
    rel_error: float
    pieces: tuple[PieceRef, ...] = ()
    sharding: str | None = None  # Orbax's serialized ShardingMetadata of a device leaf

    @property
    def name(self) -> str:
        """The leaf's path string (``params/Dense_0/kernel``)."""
        return path_str(self.path)

    @cached_property
    def codec(self) -> Codec:
        """The codec instance (decoded from its stored config)."""
        return codec_from_config(self.codec_config, self.name)

    @property
    def stored_bytes(self) -> int:
        """Payload bytes of this leaf in this checkpoint."""
        return sum(p.length for p in self.pieces)

    @property
    def raw_bytes(self) -> int:
        """Bytes of the leaf's value in memory."""
        return math.prod(self.shape) * self.dtype.itemsize

    def to_msgpack(self, with_pieces: bool = True) -> dict[str, Any]:
        """On-disk form."""
        out: dict[str, Any] = {
            "path": [list(p) for p in self.path],
            "kind": self.storage,
            "shape": list(self.shape),
            "dtype": self.dtype.name,
            "key_impl": self.key_impl,
            "codec": dict(self.codec_config),
            "chunk": list(self.chunk),
            "side": {
                k: {"dtype": v.dtype.name, "shape": list(v.shape), "data": v.tobytes()}
                for k, v in self.side.items()
            },
            "role": self.role,
            "rel_error": self.rel_error,
        }
        if self.sharding is not None:
            out["sharding"] = self.sharding
        if with_pieces:
            out["pieces"] = [p.to_msgpack() for p in self.pieces]
            out["stored_bytes"] = self.stored_bytes
        return out

    @classmethod
    def parse(cls, d: Any, where: str) -> LeafEntry:
        """Validate one leaf entry, its side arrays and its pieces."""
        path = path_of(get(d, "path", list, where), where)
        lw = f"{where}: leaf {path_str(path)!r}"
        storage = get(d, "kind", str, lw)
        if storage not in STORAGES:
            raise fail(lw, f"unknown storage {storage!r}")
        shape = shape_of(get(d, "shape", list, lw), lw)
        dtype = dtype_of(get(d, "dtype", str, lw), lw)
        chunk = shape_of(get(d, "chunk", list, lw, list(shape) or []), lw, "chunk")
        if len(chunk) != len(shape) or any(c < 1 for c in chunk if shape):
            raise fail(lw, f"chunk {chunk} does not fit shape {shape}")
        codec_config = get(d, "codec", dict, lw)
        codec = _parsed_codec(codec_config, lw)
        side = _side_arrays(get(d, "side", dict, lw, {}), lw)
        rel_error = get(d, "rel_error", (float, int), lw, 0.0)
        if storage == "none" and (shape != (0,) or dtype != np.uint8):
            raise fail(lw, f"a None leaf has shape {shape} and dtype {dtype}")
        if storage in ("scalar", "int", "float", "bool") and shape != ():
            raise fail(lw, f"a {storage} leaf has shape {shape}")
        key_impl = get(d, "key_impl", str, lw, None)
        pieces = _pieces(get(d, "pieces", list, lw, []), shape, chunk, lw)
        _check_codec(codec, codec_config, storage, dtype, key_impl, pieces, lw)
        entry = cls(
            path=path,
            storage=storage,
            shape=shape,
            dtype=dtype,
            key_impl=key_impl,
            codec_config=dict(codec_config),
            chunk=chunk,
            side=side,
            role=get(d, "role", str, lw, None),
            rel_error=float(rel_error),
            pieces=pieces,
            sharding=sharding_string(get(d, "sharding", str, lw, None), lw),
        )
        entry.__dict__["codec"] = codec  # the cached property, already computed
        return entry

    @classmethod
    def parse_difference(cls, diff: dict[str, Any], base_raw: dict[str, Any],
                         base: LeafEntry | None, where: str) -> LeafEntry:
        """The entry a delta's difference ``diff`` stands for, from its base's entry (raw
        and, where it parsed, validated): what :meth:`parse` of the merged entry
        (:func:`inherit.expand`) returns, parsing and checking only what the delta stores
        and what depends on it. A delta's leaf table differs from its base's in codecs, side
        arrays, measured errors and its pieces' checksums, offsets and lengths; any other
        difference (or a base entry that does not parse alone) takes :meth:`parse` of the
        merged entry. A 360-leaf chain's 9 deltas: 3,240 entries, each parsed whole before."""
        if base is None or not set(diff) <= _DIFFERENCE_KEYS:
            return cls.parse(inherit.merged_entry(diff, base_raw), where)
        lw = f"{where}: leaf {base.name!r}"
        pieces = base.pieces
        if "pieces" in diff:
            moved = _moved_pieces(diff["pieces"], base_raw.get("pieces"), base.pieces, lw)
            if moved is None:  # replaced whole, or a piece's field, box or file changed
                return cls.parse(inherit.merged_entry(diff, base_raw), where)
            pieces = moved
        codec, codec_config = base.codec, base.codec_config
        if "codec" in diff:
            codec_config = get(diff, "codec", dict, lw)
            codec = _parsed_codec(codec_config, lw)
        side = base.side if "side" not in diff else _side_arrays(
            get(diff, "side", dict, lw, {}), lw)
        rel_error = (get(diff, "rel_error", (float, int), lw, 0.0) if "rel_error" in diff
                     else base.rel_error)
        _check_codec(codec, codec_config, base.storage, base.dtype, base.key_impl, pieces, lw)
        entry = cls(path=base.path, storage=base.storage, shape=base.shape, dtype=base.dtype,
                    key_impl=base.key_impl, codec_config=dict(codec_config), chunk=base.chunk,
                    side=side, role=base.role, rel_error=float(rel_error), pieces=pieces,
                    sharding=base.sharding)
        entry.__dict__["codec"] = codec  # the cached property, already computed
        return entry

    def check_coverage(self, where: str) -> None:
        """Every field's pieces tile the array exactly: disjoint, and covering it by volume.

        Pieces lie inside one chunk-grid cell each (checked in :meth:`parse`), so overlaps
        are looked for only among the pieces of one cell.
        """
        total = math.prod(self.shape)
        fields = self.codec.field_dtypes(self.dtype)
        whole = tuple((0, d) for d in self.shape)
        if (len(self.pieces) == len(fields) and all(p.box == whole for p in self.pieces)
                and len({p.field for p in self.pieces}) == len(fields)):
            return  # one piece per field, each the whole leaf (fields were checked in parse)
        covered = dict.fromkeys(fields, 0)
        cells: dict[tuple[str, tuple[int, ...]], list[PieceRef]] = {}
        for p in self.pieces:
            covered[p.field] += math.prod(b - a for a, b in p.box)
            cell = tuple(a // c for (a, _), c in zip(p.box, self.chunk, strict=True))
            cells.setdefault((p.field, cell), []).append(p)
        for name, count in covered.items():
            if count != total:
                raise fail(
                    where, f"leaf {self.name!r} field {name!r} covers {count} of {total} elements"
                    " (a process did not write its shards)"
                )
        for (name, _), group in cells.items():
            if len(group) > 1 and _overlap(group):
                raise fail(where, f"leaf {self.name!r} field {name!r}: two pieces overlap")


#: the keys a delta's leaf entry may differ from its base's in for
#: :meth:`LeafEntry.parse_difference` to build it from the parsed base entry
_DIFFERENCE_KEYS = frozenset({"codec", "side", "rel_error", "pieces"})
#: the keys a piece may differ from its base's piece in (its place in the file)
_PIECE_DIFFERENCE_KEYS = frozenset({"crc32", "offset", "length"})


def _parsed_codec(config: dict[str, Any], lw: str) -> Codec:
    """The codec of a stored config (a FormatError names the leaf)."""
    try:
        return _codec_of(config, lw)
    except LossyError:
        raise
    except Exception as e:  # a codec constructor rejecting odd values
        raise fail(lw, f"bad codec config {str(config)[:200]} ({e})") from e


def _side_arrays(side_map: dict[Any, Any], lw: str) -> dict[str, np.ndarray]:
    """Validated side arrays of a leaf entry."""
    side = {}
    side_bytes = 0
    if len(side_map) > MAX_SIDE_ARRAYS:
        raise fail(lw, f"{len(side_map)} side arrays is more than any codec stores")
    for name, s in side_map.items():
        sw = f"{lw} side array {name!r}"
        sd = dtype_of(get(s, "dtype", str, sw), sw)
        sshape = shape_of(get(s, "shape", list, sw), sw)
        data = get(s, "data", bytes, sw)
        side_bytes += len(data)
        if len(data) != math.prod(sshape) * sd.itemsize or side_bytes > MAX_SIDE_BYTES:
            raise fail(sw, "has the wrong size")
        if not isinstance(name, str):
            raise fail(sw, "side array name is not a string")
        side[name] = np.frombuffer(data, sd).reshape(sshape)
    return side


def _pieces(raw: list[Any], shape: tuple[int, ...], chunk: tuple[int, ...],
            lw: str) -> tuple[PieceRef, ...]:
    """Validated pieces of a leaf entry, each inside the leaf and one cell of its grid."""
    pieces = tuple(PieceRef.from_msgpack(p, lw) for p in raw)
    for p in pieces:
        if not box_inside(p.box, shape) or (shape and not within_one_chunk(p.box, chunk)):
            raise fail(lw, f"piece box {p.box} lies outside the leaf or its chunk")
    return pieces


def _moved_pieces(diff: Any, base_raw: Any, base: tuple[PieceRef, ...], lw: str
                  ) -> tuple[PieceRef, ...] | None:
    """A delta's pieces from its base's when each differs only in its place in the file
    (``inherit.merged`` merges them piece by piece; checked by :meth:`PieceRef.moved`);
    None where :meth:`LeafEntry.parse` of the merged entry must decide (pieces replaced
    whole, or a piece's field, box or file changed)."""
    if not inherit.maps_alike(diff, base_raw) or len(base) != len(diff):
        return None
    if not all(set(d) <= _PIECE_DIFFERENCE_KEYS for d in diff):
        return None
    return tuple(b.moved(d, lw) if d else b for d, b in zip(diff, base, strict=True))


def _check_codec(codec: Codec, config: dict[str, Any], storage: str, dtype: np.dtype,
                 key_impl: str | None, pieces: tuple[PieceRef, ...], lw: str) -> None:
    """What a leaf's codec must agree with: its dtype, storage, key and pieces' fields."""
    try:
        fields = codec.field_dtypes(dtype)
    except Exception as e:
        raise fail(lw, f"codec {config.get('id')!r} cannot store dtype {dtype}") from e
    if storage in HOST_STORAGES and codec.needs_reference:
        raise fail(lw, f"a {storage} leaf cannot be delta coded")
    if key_impl is not None and (storage != "device" or dtype != np.uint32
                                 or codec.needs_reference):
        raise fail(lw, f"a PRNG key leaf ({key_impl!r}) is {storage} {dtype} "
                    f"coded with {config.get('id')!r}")
    for p in pieces:
        if p.field not in fields:
            raise fail(lw, f"piece of unknown field {p.field!r}")


_CODECS: dict[tuple, Codec] = {}
#: distinct codec configs remembered by :func:`_codec_of`
MAX_CACHED_CODECS = 1024


def _codec_of(config: dict[str, Any], where: str) -> Codec:
    """``codec_from_config(config)``, the same instance for the same config (a manifest of
    a few hundred leaves names a handful of codecs; codecs are immutable)."""
    key = []
    for k, v in config.items():
        kind = type(v)
        if kind not in _SCALARS or type(k) is not str:  # lists or maps: not cached
            return codec_from_config(config, where)
        # the type is part of the key: 3, 3.0 and True are equal, but a codec may take one
        key.append((k, kind, v))
    cache_key = tuple(key)  # in stored order: the same config in another order is another key
    codec = _CODECS.get(cache_key)
    if codec is None:
        codec = codec_from_config(config, where)
        if len(_CODECS) >= MAX_CACHED_CODECS:
            _CODECS.clear()
        _CODECS[cache_key] = codec
    return codec


_SCALARS = frozenset({str, int, float, bool, type(None)})


def _overlap(group: list[PieceRef]) -> bool:
    """Whether two of the boxes (all inside one chunk cell) overlap."""
    if len(group) <= 64:
        return any(
            intersect(a.box, b.box) is not None
            for i, a in enumerate(group) for b in group[i + 1:]
        )
    lo = [min(p.box[d][0] for p in group) for d in range(len(group[0].box))]
    hi = [max(p.box[d][1] for p in group) for d in range(len(group[0].box))]
    seen = np.zeros([h - low for low, h in zip(lo, hi, strict=True)], np.uint8)
    for p in group:
        view = seen[tuple(slice(a - low, b - low) for (a, b), low in zip(p.box, lo, strict=True))]
        if view.any():
            return True
        view[...] = 1
    return False


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest."""

    header: Header
    leaves: tuple[LeafEntry, ...]

    @cached_property
    def index(self) -> dict[StoredPath, int]:
        """Leaf position by path."""
        return {leaf.path: i for i, leaf in enumerate(self.leaves)}

    def to_msgpack(self) -> dict[str, Any]:
        """On-disk form."""
        return {**self.header.to_msgpack(), "leaves": [x.to_msgpack() for x in self.leaves]}

    @classmethod
    def parse(cls, body: Any, where: str, base: _Base | None = None) -> Manifest:
        """Validate a whole manifest body (with ``base``: a delta's own leaf entries, the
        differences among them merged with ``base``'s entries, see :mod:`inherit`)."""
        leaves = get(body, "leaves", list, where)
        if len(leaves) > MAX_LEAVES:
            raise fail(where, f"{len(leaves)} leaves is more than any writer produces")
        header = Header.parse(body, where)
        if header.chunk_bytes > MAX_CHUNK_BYTES:
            raise fail(where, f"chunk size {header.chunk_bytes} is larger than any we write")
        if base is None:
            parsed = tuple(LeafEntry.parse(leaf, where) for leaf in leaves)
        else:
            parsed = tuple(base.entry(i, leaf, where) for i, leaf in enumerate(leaves))
        for leaf in parsed:
            # The grid follows from the shape: a claimed chunk cannot make a piece (and so
            # the memory a restore allocates for it) larger than the writer's chunks.
            expected = chunk_shape_for(leaf.shape, leaf.dtype.itemsize, header.chunk_bytes)
            if leaf.shape and leaf.chunk != expected:
                raise fail(where, f"leaf {leaf.name!r}: chunk {leaf.chunk} is not the grid "
                            f"{expected} of its shape")
            leaf.check_coverage(where)
        manifest = cls(header, parsed)
        if len(manifest.index) != len(parsed):
            raise fail(where, "two leaves have the same path")
        return manifest


class _Base:
    """The leaf entries a delta's differences are merged with: raw, and parsed once per
    entry for all the deltas of a chain while the base's entries are cached
    (:func:`inherit.split`)."""

    def __init__(self, raw: list[Any], parsed: list[Any] | None) -> None:
        self.raw, self._parsed = raw, parsed

    def entry(self, i: int, leaf: Any, where: str) -> LeafEntry:
        """Entry ``i`` of the delta, ``leaf`` as stored (a difference, or complete)."""
        if not isinstance(leaf, dict) or "path" in leaf:
            return LeafEntry.parse(leaf, where)
        if i >= len(self.raw) or not isinstance(self.raw[i], dict):
            raise ChainError(f"{where}: leaf entry {i} inherits from the base's entry {i}, "
                             f"which the base (of {len(self.raw)} leaves) does not have")
        return LeafEntry.parse_difference(leaf, self.raw[i], self._base_entry(i), where)

    def _base_entry(self, i: int) -> LeafEntry | None:
        if self._parsed is None:
            return None
        entry = self._parsed[i]
        if entry is _UNPARSED:
            try:
                entry = LeafEntry.parse(self.raw[i], "base")
            except LossyError:  # a delta that overrides what does not parse: parsed whole
                entry = None
            self._parsed[i] = entry
        return entry


_UNPARSED = object()
_PARSED_BASES: collections.OrderedDict[tuple[Any, ...], list[Any]] = collections.OrderedDict()
_PARSED_LOCK = threading.Lock()


def _base_of(raw: list[Any], key: tuple[Any, ...] | None) -> _Base:
    """The base entries kept under ``key`` (parsed as the deltas need them)."""
    if key is None:
        return _Base(raw, None)
    with _PARSED_LOCK:
        parsed = _PARSED_BASES.get(key)
        if parsed is None or len(parsed) != len(raw):
            parsed = _PARSED_BASES[key] = [_UNPARSED] * len(raw)
            while len(_PARSED_BASES) > 2:
                _PARSED_BASES.popitem(last=False)
        _PARSED_BASES.move_to_end(key)
    return _Base(raw, parsed)


#: manifests parsed lately, by (path, inflated body length, its crc32), with the base link
#: of a delta (checked again at every read): a restore reads its chain's manifests once to
#: plan and once to restore, and a manager compiling ahead reads them before its restore
_MANIFESTS: collections.OrderedDict[tuple[Any, ...], tuple[Manifest, Any]] = (
    collections.OrderedDict())
_MANIFESTS_LOCK = threading.Lock()
_MANIFESTS_KEPT = 32
#: larger manifests (inflated bytes) are parsed at every read, not kept
_MANIFEST_CACHE_BYTES = 4 << 20


def read_manifest(item_dir: os.PathLike | str) -> Manifest:
    """Read, check and parse ``<item_dir>/manifest.msgpack`` (a delta's leaf entries merged
    with its base's, :mod:`orbax_lossy.format.inherit`). Every read checks the file's
    checksum; the same bytes at the same path parse once per process (a delta's base is
    checked again each time)."""
    item_dir = os.fspath(item_dir)
    path = os.path.join(item_dir, MANIFEST_NAME)
    raw = read_envelope_bytes(path, "manifest")
    key = None if is_remote(path) or len(raw) > _MANIFEST_CACHE_BYTES else (
        os.path.abspath(path), len(raw), crc32(raw))
    if key is not None:
        with _MANIFESTS_LOCK:
            hit = _MANIFESTS.get(key)
            if hit is not None:
                _MANIFESTS.move_to_end(key)
        if hit is not None:
            manifest, link = hit
            if link is not None:
                inherit.check_base(item_dir, link, path)
            return manifest
    manifest, link = _parse_manifest(item_dir, raw, path)
    if key is not None:
        with _MANIFESTS_LOCK:
            _MANIFESTS[key] = (manifest, link)
            while len(_MANIFESTS) > _MANIFESTS_KEPT:
                _MANIFESTS.popitem(last=False)
    return manifest


def _parse_manifest(item_dir: str, raw: bytes, path: str) -> tuple[Manifest, Any]:
    """The manifest of inflated body bytes ``raw``, and its base link (None: a whole one)."""
    body = unpack_body(raw, path)
    if not isinstance(body, dict):
        raise FormatError(f"{path}: manifest body is not a map")
    found = inherit.split(item_dir, body, path)
    if found is None:
        return Manifest.parse(body, path), None
    own, leaves, base_leaves, base_key = found
    return (Manifest.parse({**own, "leaves": leaves}, path, _base_of(base_leaves, base_key)),
            body[inherit.INHERITS_KEY])


def read_manifest_header(item_dir: os.PathLike | str) -> Header:
    """Read and check ``<item_dir>/manifest.msgpack`` (checksum included) and parse only its
    header (retention needs the dependencies; parsing every leaf entry costs ~10x more; a
    delta's base is not read)."""
    path = os.path.join(os.fspath(item_dir), MANIFEST_NAME)
    body = read_envelope(path, "manifest")
    if not isinstance(body, dict):
        raise FormatError(f"{path}: manifest body is not a map")
    return Header.parse(body, path)


def read_manifest_body(item_dir: os.PathLike | str) -> dict[str, Any]:
    """The manifest as msgpack decoded it, every leaf entry complete (a delta's merged with
    its base's): checksummed, not validated (for tools and tests that inspect or rewrite the
    format; everything else uses :func:`read_manifest`). Written back with
    :func:`~orbax_lossy.format.envelope.write_envelope`, it is a valid whole manifest."""
    path = os.path.join(os.fspath(item_dir), MANIFEST_NAME)
    body = read_envelope(path, "manifest")
    if not isinstance(body, dict):
        raise FormatError(f"{path}: manifest body is not a map")
    return inherit.unpack(os.fspath(item_dir), body, path, copy=True)


def write_manifest(item_dir: os.PathLike | str, manifest: Manifest) -> None:
    """Write ``<item_dir>/manifest.msgpack`` (a delta's leaf entries as differences from its
    chain base's where that base can be read)."""
    item_dir = os.fspath(item_dir)
    write_envelope(os.path.join(item_dir, MANIFEST_NAME), "manifest",
                   inherit.pack(item_dir, manifest.to_msgpack()))
